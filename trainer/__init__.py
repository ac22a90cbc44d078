"""The trainer side: micro-batch feed client, RL losses, Megatron adapter, weight publishing.

Not built yet: see the micro-batch feed issue. This package never imports FastAPI.
"""
