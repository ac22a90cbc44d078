"""Vision and audio towers turned into an encoder stage (the encoder role's library).

Not built yet: see the rollout issue. This package never imports FastAPI.
"""
