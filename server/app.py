"""The FastAPI app: one engine client, its metrics, the error handlers, the API-key check, and the
routers (SGLang-native and OpenAI-compatible)."""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from engine.async_client import AsyncEngineClient
from server.errors import error_body, install_error_handlers
from server.metrics import Metrics

# Routes a load balancer or supervisor probes without credentials.
OPEN_ROUTES = frozenset({"/health"})


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # the `model` of /v1 routes (default: --model)
    log_level: str = "INFO"

    def public(self) -> dict[str, Any]:
        """Settings safe to show: keys are redacted."""
        out = dataclasses.asdict(self)
        out["api_key"] = "***" if self.api_key else None
        return out


def build_app(client: AsyncEngineClient, config: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        yield
        await client.shutdown()

    app = FastAPI(title="Siesta", lifespan=lifespan)
    app.state.client = client
    app.state.server_config = config
    app.state.metrics = Metrics()
    app.state.model_name = config.served_model_name or client.config.model
    install_error_handlers(app)
    app.add_middleware(JsonBodies)
    if config.api_key:
        _require_api_key(app, config.api_key)

    from server.memory_api import router as memory
    from server.native_api import router as native
    from server.openai_api import router as openai
    from server.weights_api import router as weights

    app.include_router(native)
    app.include_router(memory)
    app.include_router(weights)
    app.include_router(openai)
    return app


class JsonBodies:
    """Every body here is JSON: read it as JSON whatever the Content-Type says, so that a plain
    `curl -d '{...}'` (which says form-urlencoded) works as users expect."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = scope | {"headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _require_api_key(app: FastAPI, key: str) -> None:
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path in OPEN_ROUTES:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            body = error_body(PermissionError("missing or wrong API key (Authorization: Bearer KEY)"), "unauthorized", 401)
            return JSONResponse(body, status_code=401)
        return await call_next(request)
