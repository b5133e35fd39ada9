"""The FastAPI app: one engine client, its metrics, the error handlers, the API-key check, and the
routers (SGLang-native, OpenAI-compatible and vLLM's RL dialect)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.client.async_client import AsyncEngineClient
from server.errors import error_body, install_error_handlers
from server.json_bodies import JsonBodies
from server.metrics import Metrics
from server.model_names import ModelNames
from server.server_config import ServerConfig

# Routes a load balancer or supervisor probes without credentials.
OPEN_ROUTES = frozenset({"/health"})
# Routes that change what the engine holds or serves: with --admin-api-key, only that key.
# (/abort_request with abort_all is checked in its route.)
ADMIN_ROUTES = frozenset({
    "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
    "/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/flush_cache", "/pause_generation", "/continue_generation",
    "/weights_checker", "/post_process_weights", "/start_profile", "/stop_profile",
    # vLLM's dialect (server/vllm_api.py, server/vllm_weights_api.py)
    "/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache", "/collective_rpc",
    "/init_weight_transfer_engine", "/update_weights", "/start_weight_update", "/finish_weight_update",
    "/init_broadcaster",
})
# After the engine process dies, /health answers 503 this long before the server exits (non-zero,
# so that a supervisor restarts it).
DEATH_GRACE_S = 3.0


def build_app(
    client: AsyncEngineClient, config: ServerConfig, on_engine_death: Callable[[], None] | None = None,
    api_server_index: int = 0, before_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """`on_engine_death` runs DEATH_GRACE_S after the engine process is found dead (the CLI stops
    the server with a non-zero exit). `api_server_index`: which of `config.api_server_count`
    processes this app serves in. `before_shutdown` runs (in a thread) when the server stops,
    before the engine does (process 0 stops the other API servers there)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        watcher = asyncio.create_task(_after_death(client, on_engine_death))
        yield
        watcher.cancel()
        if before_shutdown is not None:
            await asyncio.to_thread(before_shutdown)
        await client.shutdown()

    app = FastAPI(title="Siesta", lifespan=lifespan)
    app.state.client = client
    app.state.server_config = config
    app.state.metrics = Metrics()
    app.state.api_server_index = api_server_index
    app.state.model_names = ModelNames.of(config.served_model_name, client.config.model)
    app.state.model_name = app.state.model_names.served[0]
    install_error_handlers(app)
    app.add_middleware(KeyCheck, api_key=config.api_key, admin_key=config.admin_api_key)
    app.add_middleware(JsonBodies, max_bytes=config.max_request_bytes)

    from server.info_api import router as info
    from server.memory_api import router as memory
    from server.native_api import router as native
    from server.openai_api import router as openai
    from server.profile_api import router as profile
    from server.tokenize_api import router as tokenize
    from server.vllm_api import router as vllm
    from server.vllm_generate import router as vllm_generate
    from server.vllm_weights_api import router as vllm_weights
    from server.weight_checks_api import router as weight_checks
    from server.weights_api import router as weights

    app.include_router(native)
    app.include_router(info)
    app.include_router(memory)
    app.include_router(weights)
    app.include_router(weight_checks)
    app.include_router(profile)
    app.include_router(openai)
    app.include_router(tokenize)
    app.include_router(vllm)
    app.include_router(vllm_weights)
    app.include_router(vllm_generate)
    return app


async def _after_death(client: AsyncEngineClient, on_death: Callable[[], None] | None) -> None:
    await client.died.wait()
    await asyncio.sleep(DEATH_GRACE_S)
    if on_death is not None:
        on_death()


class KeyCheck:
    """--api-key: every route but /health needs a key (401). --admin-api-key: the admin routes
    need that key; a plain key gets 403 there. The admin key opens every route. Sets
    `request.state.is_admin` for routes that decide by body (abort_all). Pure ASGI (Starlette's
    BaseHTTPMiddleware would hide client disconnects from the routes)."""

    def __init__(self, app: Any, api_key: str | None, admin_key: str | None) -> None:
        self.app = app
        self.plain = f"Bearer {api_key}".encode() if api_key else None
        self.admin = f"Bearer {admin_key}".encode() if admin_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        admin_ok = self.admin is not None and hmac.compare_digest(given, self.admin)
        plain_ok = self.plain is not None and hmac.compare_digest(given, self.plain)
        is_user = admin_ok or plain_ok or self.plain is None
        is_admin = admin_ok or (self.admin is None and is_user)  # no admin key: any valid key
        scope.setdefault("state", {})["is_admin"] = is_admin
        path = scope["path"]
        denied = None
        if path in OPEN_ROUTES:
            pass
        elif path in ADMIN_ROUTES and not is_admin:
            denied = _denied(403, "this route needs the admin key (--admin-api-key)") if plain_ok else (
                _denied(401, "missing or wrong admin key (Authorization: Bearer KEY)"))
        elif not is_user:
            denied = _denied(401, "missing or wrong API key (Authorization: Bearer KEY)")
        if denied is not None:
            await denied(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _denied(status: int, message: str) -> JSONResponse:
    kind = "forbidden" if status == 403 else "unauthorized"
    return JSONResponse(error_body(PermissionError(message), kind, status), status_code=status)
