"""Siesta's front end: the command line (`cli.py`), the HTTP app (`app.py` and its routers) and,
with `--api-server-count N`, API server processes 1..N-1 (`api_servers.py`)."""
