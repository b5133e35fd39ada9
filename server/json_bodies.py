"""The JSON body middleware: every POST/PUT body is read whole (bounded) and handed on as JSON.

Rules:
- Every body here is JSON, whatever the Content-Type says, so that a plain `curl -d '{...}'`
  (which says form-urlencoded) works as users expect.
- A body over `max_bytes` gets 413 (by Content-Length, or once it streams past the limit), before
  any route sees it.
- No string in a body may hold a lone UTF-16 surrogate (U+D800..U+DFFF): such a string is not
  Unicode text, and the tokenizer, the engine's messages and the log all fail on it. Python's
  `json` lets three forms through: a `\\ud800` escape, the three raw bytes a lax encoder writes
  for one (ED A0..BF xx, decoded with "surrogatepass"), and UTF-16/32 bodies. Such a body gets
  400 naming the JSON path of the first bad string. A valid high+low escape pair is one
  character and passes.
- Only bodies that can hold one are parsed here: a UTF-8 body is first searched for a backslash
  and an ED byte (memchr, ~0.04 ms per MB), then for the escape or raw bytes themselves (~0.6 ms
  per MB); only a hit (an emoji sent as an escaped pair is one) costs a parse and a walk here.
  Invalid JSON is left to the app (400 there).
- Both refusals come before the API-key check (this middleware is the outermost).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.errors import InvalidRequest
from server.errors import error_body

# What a UTF-8 body must contain to decode to a surrogate: a `\uD800`..`\uDFFF` escape (any case),
# or the raw bytes of one (UTF-8 proper never has ED followed by A0..BF). Each is searched for only
# when its first byte is in the body (a memchr: about 0.03 ms per MB).
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonBodies:
    """ASGI middleware: reads the body whole, refuses it when too large (413) or when a string in
    it holds a lone surrogate (400), and hands it on with Content-Type application/json."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await _too_large(self.max_bytes, send)
            return
        scope = scope | {"headers": [*((k, v) for k, v in scope["headers"] if k != b"content-type"),
                                     (b"content-type", b"application/json")]}
        # Read the whole body first (bounded), then hand it to the app: a body that streams past
        # the limit is refused before any route sees it.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message]), send)
                return
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await _too_large(self.max_bytes, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        data = b"".join(chunks)
        problem = lone_surrogate(data)
        if problem is not None:
            await _send_json(send, 400, error_body(InvalidRequest(problem)))
            return
        body = {"type": "http.request", "body": data, "more_body": False}
        await self.app(scope, _replay([body], then=receive), send)


def lone_surrogate(data: bytes) -> str | None:
    """Why `data` (a JSON body) is refused for a lone surrogate, naming where it is; None when it
    holds none, or is not JSON at all (the app answers that)."""
    if not data or not _may_hold_surrogate(data):
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        return None
    return _first_bad_string(value)


def _may_hold_surrogate(data: bytes) -> bool:
    if json.detect_encoding(data) != "utf-8":  # UTF-16/32: rare, checked whole
        return True
    return (b"\\" in data and _ESCAPE.search(data) is not None) or (b"\xed" in data and _RAW.search(data) is not None)


def _first_bad_string(value: Any) -> str | None:
    """Walks the parsed body (iteratively: nesting depth is the client's) for a string or key
    holding a surrogate; after json.loads, any surrogate left is a lone one."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                return f"{path or 'the body'} holds a lone UTF-16 surrogate ({_escape(found.group())}), which is not valid Unicode text"
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                found = _SURROGATE.search(key)
                if found is not None:
                    return (f"a key in {path or 'the body'} ({ascii(key)}) holds a lone UTF-16 surrogate "
                            f"({_escape(found.group())}), which is not valid Unicode text")
                children.append((child, f"{path}.{key}" if path else key))
            stack.extend(reversed(children))  # first field first
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _escape(char: str) -> str:
    return f"\\u{ord(char):04x}"


def _replay(messages: list[dict], then: Any = None) -> Any:
    """An ASGI receive that gives `messages`, then defers to `then` (disconnect notices)."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive


async def _too_large(max_bytes: int, send: Any) -> None:
    await _send_json(send, 413, error_body(ValueError(f"request body over {max_bytes} bytes (--max-request-bytes)"),
                                           "request_too_large", 413))


async def _send_json(send: Any, status: int, payload: dict) -> None:
    """A whole JSON response. The request body was read to its end, so the connection stays open
    for the client's next request."""
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
