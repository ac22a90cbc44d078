"""The capacity twin: what RL post-training costs on GPUs one does not have — a discrete-event cost model of
Weir's engines and trainer, and Weir's real control plane run against simulated GPUs (`weir twin`, whose options
are `launcher.twin_command`'s).

* `twin.model` — the cost model alone: sim engines on a virtual clock and the sim trainer's formulas, colocate and
  async (no control plane, no HTTP, no sleeping);
* `twin.plan` — what is asked of it: the best engine:trainer split and staleness bound (``weir twin plan``), the
  sensitivity to estimated constants, the one calibrated knob (``weir twin calibrate``);
* `twin.live` — the live twin: a stack of roles with sim engines and the real RL loop with a sim trainer, per mode
  and compression factor (the stack is the caller's: a library starts no roles itself);
* `twin.report` — the live runs as a table, the control-plane finding, scaling, the calibration against Relax,
  the plot;
* `twin.config` (what a live twin runs), `twin.records` (the JSON shapes every module shares),
  `twin.reference` (the published figures, Relax's), `twin.intervals` (95 % intervals: Student's t, Welch).

A library: it imports `engines`, `trainer`, `rollout` and `encoders`, never the launcher or the roles.
"""
