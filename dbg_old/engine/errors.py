"""Every failure the engine reports to a caller: one exception type per failure, each with the
`kind` a control reply carries across the process boundary (`ControlError.kind` in
engine/core/protocol.py) and turns back into the same type in the caller's process. The server maps
each type to one HTTP status, in one table (`HTTP_STATUS` in server/errors.py).

Rules:
- A control call that fails is the caller's failure unless it says otherwise: `invalid` (400),
  as SGLang answers a failed weight update, a bad tag or a process group that would not form.
  The engine keeps running and its old state stays in use.
- `forbidden` (403): a disk path outside --allowed-model-dirs (raised as PermissionError).
- `unavailable` (503): the engine is alive but cannot serve now (memory released, weights to
  update); the message says what to call first.
- `dead` (503): the engine process failed to start or died. No reply carries it: the client sees
  the process gone.
Pure Python; every process imports it.
"""

from __future__ import annotations

from typing import ClassVar


class EngineError(Exception):
    """A failure the caller is told about; `kind` names it on the wire."""

    kind: ClassVar[str] = "invalid"


class InvalidRequest(EngineError, ValueError):
    """A request or control call the engine refuses; the message names the bad field (HTTP 400)."""

    kind = "invalid"


class Forbidden(EngineError, PermissionError):
    """A call the server's settings do not allow (HTTP 403)."""

    kind = "forbidden"


class EngineUnavailable(EngineError, RuntimeError):
    """The engine is alive but cannot serve now (memory released, weights to update): HTTP 503."""

    kind = "unavailable"


class EngineDeadError(EngineError, RuntimeError):
    """The engine process failed to start or died; the message says why (HTTP 503)."""

    kind = "dead"


ERRORS: dict[str, type[EngineError]] = {e.kind: e for e in (InvalidRequest, Forbidden, EngineUnavailable, EngineDeadError)}


def error_kind(e: BaseException) -> str:
    """The kind a control call's exception crosses the process boundary as (rules above)."""
    if isinstance(e, EngineError):
        return e.kind
    if isinstance(e, PermissionError):
        return Forbidden.kind
    return InvalidRequest.kind


def from_kind(kind: str, message: str) -> EngineError:
    """The exception a caller raises for a failure the engine reported."""
    return ERRORS.get(kind, InvalidRequest)(message)
