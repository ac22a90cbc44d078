"""The encoder role: feature keys → cached embeddings from the model's own towers (see `app.py`)."""
