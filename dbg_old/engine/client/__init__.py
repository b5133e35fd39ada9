"""The engine's clients. Runs in the CALLER's process (the HTTP server, or a trainer using
`engine.Engine`), never in the engine process.

- `core_process.py`: `CoreProcess` spawns the engine process and holds the two ZeroMQ sockets to it.
- `async_client.py`: `AsyncEngineClient`, the server's asyncio client (requests, streams, control calls).
- `sync_client.py`: `Engine`, the blocking Python API over the same engine process.
- `output.py`, `detokenizer.py`: token deltas from the engine turned into outputs and text.

Arrows: client -> core.protocol (the messages) and core.loop (what the spawned process runs).
"""
