"""Vision and audio towers turned into an encoder stage (the encoder role's library).

`towers` (the model's own vision / audio towers, loaded alone), `embeddings` (the embedding cache:
one forward per unique item per weights version), `embedded_model` (`weir init-model`), `errors`.
This package never imports FastAPI; the encoder role (`services/encoder`) serves it.
"""
