"""Errors as JSON: every failure is `{"error": {"message", "type", "code"}}` (the OpenAI shape,
which the `openai` client parses), with 4xx for the caller's mistakes, 503 for an engine that
cannot serve, and never a traceback. One table (`HTTP_STATUS`) maps each failure's exception type
(engine/errors.py) to its status and error type. `code` is the HTTP status, but for an unknown
`model`: 404 with OpenAI's `"code": "model_not_found"` and `"param": "model"`, as vLLM answers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.errors import EngineDeadError, EngineUnavailable, Forbidden, InvalidRequest
from server.generation import ClientDisconnected
from server.model_names import ModelNotServed
from server.schemas import UNION_TAGS

log = logging.getLogger("siesta.server")

# nginx's code for "client closed the request": nobody reads it, but the log says what happened.
CLIENT_CLOSED = 499

# Each failure's HTTP status and error type. PermissionError is Forbidden's base: a route's own
# permission check (an admin-only field) raises it.
HTTP_STATUS: dict[type[BaseException], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    ModelNotServed: (404, "invalid_request_error"),
    Forbidden: (403, "forbidden"),
    PermissionError: (403, "forbidden"),
    EngineUnavailable: (503, "service_unavailable"),
    EngineDeadError: (503, "service_unavailable"),
    ClientDisconnected: (CLIENT_CLOSED, "client_closed"),
}


def error_body(exc: BaseException, type_: str | None = None, code: int = 400) -> dict:
    if type_ is None:
        code, type_ = next((v for t, v in HTTP_STATUS.items() if isinstance(exc, t)), (code, "invalid_request_error"))
    if isinstance(exc, ModelNotServed):  # OpenAI's body: the code names the error, `param` the field
        return {"error": {"message": str(exc), "type": type_, "param": exc.param, "code": exc.code}}
    return {"error": {"message": str(exc), "type": type_, "code": code}}


def service_unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(RuntimeError(message), "service_unavailable", 503), status_code=503)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and p not in UNION_TAGS)
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(ValueError(_validation_message(exc))), status_code=400)

    async def _failure(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, EngineDeadError):
            exc = EngineDeadError(f"engine is dead: {exc}")
        body = error_body(exc)
        status = next(v[0] for t, v in HTTP_STATUS.items() if isinstance(exc, t))
        return JSONResponse(body, status_code=status)

    for exc_type in HTTP_STATUS:
        app.add_exception_handler(exc_type, _failure)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        body = error_body(RuntimeError(str(exc.detail)), "http_error", exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        body = error_body(RuntimeError(f"internal error: {type(exc).__name__}"), "internal_error", 500)
        return JSONResponse(body, status_code=500)
