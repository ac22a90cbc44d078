"""The engine role: one generation engine behind SGLang's HTTP API (see `protocol.py`)."""
