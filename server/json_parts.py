"""A JSON answer sent as the parts it was encoded in: `/generate`'s non-streamed body.

Rules:
- The parts are the answers' JSON, each encoded as its job ended; a batch or an `n > 1` answer is
  their array. The body is never joined: with routed experts a 256-answer batch is ~270 MB, and
  a join is one more copy of it at the moment every answer ends.
- Writes are at most `WRITE_BYTES` each, and each waits for the socket to drain (uvicorn's flow
  control). On Python 3.10 and 3.11 asyncio keeps an unsent write in one bytearray and deletes its
  sent head after every `send`, so one 270 MB write crossed loopback in 0.44-0.51 s where 1 MiB
  writes took 0.055-0.062 s (bench/probes/answer_writes.py). Python 3.12 queues memoryviews:
  there both take ~0.06 s.
- The length is known before the first byte: `Content-Length`, not chunked encoding, as a
  `Response` would send it.
"""

from __future__ import annotations

from collections.abc import Iterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

WRITE_BYTES = 1 << 20


def pieces(parts: list[bytes], array: bool) -> Iterator[bytes]:
    """The body's bytes in order: the parts, in `[`, `,` and `]` when `array`, the parts larger
    than WRITE_BYTES cut into slices of it."""
    if array:
        yield b"["
    for i, part in enumerate(parts):
        if array and i:
            yield b","
        if len(part) <= WRITE_BYTES:
            yield part
            continue
        view = memoryview(part)
        for start in range(0, len(part), WRITE_BYTES):
            yield bytes(view[start : start + WRITE_BYTES])
    if array:
        yield b"]"


class JsonParts(Response):
    """Status 200, `application/json`, the parts (an array of them when `array`)."""

    media_type = "application/json"

    def __init__(self, parts: list[bytes], array: bool) -> None:
        self.parts, self.array = parts, array
        self.status_code, self.background = 200, None
        length = sum(map(len, parts)) + (2 + max(len(parts) - 1, 0) if array else 0)  # brackets, commas
        self.raw_headers = [(b"content-length", b"%d" % length), (b"content-type", self.media_type.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for piece in pieces(self.parts, self.array):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
