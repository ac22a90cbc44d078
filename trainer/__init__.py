"""The trainer side: the micro-batch feed client (`feed`), RL losses (advantages are the data role's:
`experience.advantages`), a reference PyTorch trainer (`reference`), the Megatron-LM adapter
(`megatron`), weight publishing (`publish`), the rollout driver and the RL loop (`driver`, `loop`: read
top to bottom as the algorithm, over `strategy` — async or colocate —, `policy_version` — its one owner —,
`commit` — checkpoint, then acknowledge —, `lockstep` — data-parallel agreement, nothing on one rank —,
`step_record` and `readings`), the demo task and plots.

This package never imports FastAPI: it talks to the roles over HTTP as any client would.
"""
