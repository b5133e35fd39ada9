"""A JSON answer sent as the pieces it was encoded in: `/generate`'s non-streamed body.

Rules:
- Each answer is a list of byte pieces whose concatenation is its JSON, encoded as its job ended.
  An answer with routed experts is its other fields, then the base64 pieces made as the rows
  arrived (~1 MB an answer at the 30B-A3B RL shape), never copied into one string. A batch or an
  `n > 1` answer is their array.
- The body is never joined whole (a 256-answer batch with routed experts is ~270 MB). It goes out
  in writes of WRITE_BYTES: small pieces are gathered into one write, larger ones cut into
  several, so each byte is copied once and the write count follows the bytes, not the pieces.
- Each write waits for the socket to drain (uvicorn's flow control). On Python 3.10 and 3.11
  asyncio keeps an unsent write in one bytearray and deletes its sent head after every `send`, so
  one 268 MB write left uvicorn in 0.413 s where 1 MiB writes took 0.079 s. Built and sent this
  way the 256-answer routed-experts batch took 0.121 s against 0.615 s joined, on Python 3.12
  (bench/probes/answer_writes.py; bench/history/2026-11-30.md, entry g).
- The length is known before the first byte: `Content-Length`, not chunked encoding, as a
  `Response` would send it.
"""

from __future__ import annotations

from collections.abc import Iterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

WRITE_BYTES = 1 << 20


def _body(answers: list[list[bytes]], array: bool) -> Iterator[bytes]:
    """Every piece of the body in order, with the array's brackets and commas when `array`."""
    if array:
        yield b"["
    for i, answer in enumerate(answers):
        if array and i:
            yield b","
        yield from answer
    if array:
        yield b"]"


def writes(answers: list[list[bytes]], array: bool) -> Iterator[bytes]:
    """The body in writes of WRITE_BYTES (the last one shorter)."""
    group: list[bytes] = []
    size = 0
    for piece in _body(answers, array):
        if len(piece) <= WRITE_BYTES - size:
            group.append(piece)
            size += len(piece)
            continue
        view, start = memoryview(piece), 0
        while start < len(piece):  # fill the write, then whole writes, then keep the rest
            take = min(WRITE_BYTES - size, len(piece) - start)
            group.append(view[start : start + take])
            size, start = size + take, start + take
            if size == WRITE_BYTES:
                yield b"".join(group)
                group, size = [], 0
    if group:
        yield b"".join(group)


class JsonParts(Response):
    """Status 200, `application/json`, the answers (an array of them when `array`)."""

    media_type = "application/json"

    def __init__(self, answers: list[list[bytes]], array: bool) -> None:
        self.answers, self.array = answers, array
        self.status_code, self.background = 200, None
        length = sum(len(p) for answer in answers for p in answer)
        length += 2 + max(len(answers) - 1, 0) if array else 0  # brackets, commas
        self.raw_headers = [(b"content-length", b"%d" % length), (b"content-type", self.media_type.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for chunk in writes(self.answers, self.array):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
