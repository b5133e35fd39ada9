"""`ServerConfig`: the HTTP server's settings (`siesta serve`'s flags that are not the engine's).

It imports nothing heavy: the CLI reads its defaults while it builds `--help`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Seconds an idle HTTP connection stays open. Longer than the clients' own keep-alive (httpx 5 s,
# aiohttp 15 s), so a client always drops an idle connection first: a server closing one while a
# client sends on it is a disconnect the client cannot tell from a crash.
KEEP_ALIVE_S = 75


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_bytes: int = 64 << 20
    # The `model` names the /v1 routes accept, the first in replies; () means the engine's model.
    served_model_name: tuple[str, ...] = ()
    log_level: str = "INFO"
    api_server_count: int = 1  # HTTP processes in front of the one engine (server/api_servers.py)
    tool_call_parser: str = "hermes"  # how `auto` tool calls are read from the output (server/tool_calls.py)

    def public(self) -> dict[str, Any]:
        """Settings safe to show: keys are redacted."""
        out = dataclasses.asdict(self)
        out["api_key"] = "***" if self.api_key else None
        out["admin_api_key"] = "***" if self.admin_api_key else None
        out["served_model_name"] = list(self.served_model_name)
        return out
