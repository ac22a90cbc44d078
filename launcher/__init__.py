"""The launcher: the ``weir`` command (`launcher.cli`), the local stack (`launcher.stack`), the training
launcher (`launcher.training`), the capacity twin's command (`launcher.twin_command`; the twin is `twin`), the
demo tasks, plot and showcase (`launcher.demo`) and their Ray counterparts (`launcher.cluster`).

It starts and drives the roles; it is not one. Imports run one way: launcher → services → libraries;
nothing in `services/` or the libraries imports the launcher.
"""
