"""Errors as JSON: every failure is `{"error": {"message", "type", "code"}}` (the OpenAI shape,
which the `openai` client parses), with 4xx for the caller's mistakes, 503 for an engine that
cannot serve, and never a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.client.async_client import EngineUnavailable
from engine.client.core_process import EngineDeadError
from engine.request import InvalidRequest
from server.generation import ClientDisconnected

log = logging.getLogger("siesta.server")

# nginx's code for "client closed the request": nobody reads it, but the log says what happened.
CLIENT_CLOSED = 499


def error_body(exc: BaseException, type_: str | None = None, code: int = 400) -> dict:
    if type_ is None:
        unavailable = isinstance(exc, (EngineDeadError, EngineUnavailable))
        type_ = "service_unavailable" if unavailable else "invalid_request_error"
        code = 503 if unavailable else code
    return {"error": {"message": str(exc), "type": type_, "code": code}}


def service_unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(RuntimeError(message), "service_unavailable", 503), status_code=503)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(ValueError(_validation_message(exc))), status_code=400)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return service_unavailable(f"engine is dead: {exc}")

    @app.exception_handler(PermissionError)
    async def _forbidden(request: Request, exc: PermissionError) -> JSONResponse:
        return JSONResponse(error_body(exc, "forbidden", 403), status_code=403)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return service_unavailable(str(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> JSONResponse:
        return JSONResponse(error_body(exc, "client_closed", CLIENT_CLOSED), status_code=CLIENT_CLOSED)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        body = error_body(RuntimeError(str(exc.detail)), "http_error", exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        body = error_body(RuntimeError(f"internal error: {type(exc).__name__}"), "internal_error", 500)
        return JSONResponse(body, status_code=500)
