"""The data role: the experience store and the streamed micro-batch feed (see `store.py`, `app.py`)."""
