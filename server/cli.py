"""`siesta`: the command line.

- `siesta serve [--model DIR|REPO_ID] [--host H] [--port P] [--api-key K] [every EngineConfig knob]`
- `siesta demo-model DIR`: write the embedded tiny checkpoint.

Rules:
- Engine flags are generated from `EngineConfig`'s fields, so defaults live in one place; `--help`
  prints each default once (a help text that states its own default gets no second one).
- Parsing imports neither torch, transformers nor fastapi: `siesta --help` answers at once, and
  `serve` logs its first line before it imports them.
- A bad `--model` or flag value is one line on stderr and exit status 2, never a traceback; an
  engine that fails to start is one line and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import sys
import time
import types
import typing
from typing import Any

from engine.config import ConfigError, EngineConfig
from server.server_config import KEEP_ALIVE_S, ServerConfig

log = logging.getLogger("siesta.server")

# Where `siesta serve` with no --model keeps the demo model.
DEMO_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "siesta", "demo-model")


def _flag_type(hint: Any) -> tuple[type, bool]:
    """(the scalar type of a field's hint, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        scalar = [a for a in args if a is not type(None)]
        return scalar[0], type(None) in args
    return hint, False


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's `(default: X)` after a flag's help, unless the help states its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = (action.help or "").replace(" (default: %(default)s)", "")  # BooleanOptionalAction's own
        if "(default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        scalar, _ = _flag_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        flags = (flag, *f.metadata.get("aliases", ()))  # SGLang's or vLLM's name for the same switch
        if scalar is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=scalar, default=f.default, help=help_text)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def bind_warning(server: ServerConfig) -> str | None:
    """A warning when the server listens beyond loopback with no key at all."""
    if server.api_key or server.admin_api_key:
        return None
    host = "127.0.0.1" if server.host == "localhost" else server.host
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve anywhere
    return (f"listening on {server.host} with no --api-key or --admin-api-key: anyone who reaches it "
            "can release memory and replace the weights")


def _fail(message: object, status: int = 2) -> int:
    """One line on stderr, as argparse reports a bad flag; the exit status."""
    print(f"siesta serve: error: {message}", file=sys.stderr)
    return status


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's settings, `--model` resolved to a local checkpoint directory
    (engine/weights/model_dir.py). Raises `ConfigError` with a one-line message."""
    from engine.weights.model_dir import hub_offline, is_local, resolve_config

    if not args.model:
        from engine.demo_model import create_demo_model

        log.info("no --model given: writing the embedded demo model (tiny random Qwen3) to %s", DEMO_CACHE)
        args.model = create_demo_model(DEMO_CACHE)
    elif not is_local(args.model) and not hub_offline():
        log.info("--model %s: a Hugging Face repo id, fetched through huggingface_hub unless cached", args.model)
    config = resolve_config(engine_config_from(args))
    if config.model != args.model:
        log.info("--model %s is %s", args.model, config.model)
    server = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, admin_api_key=args.admin_api_key,
        max_request_bytes=args.max_request_bytes, served_model_name=tuple(args.served_model_name or [args.model]),
        log_level=args.log_level, api_server_count=args.api_server_count, tool_call_parser=args.tool_call_parser,
    )
    if server.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be >= 1, got {server.api_server_count}")
    return config, server


def _serve(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, server = _configs(args)
    except ConfigError as e:
        return _fail(e)
    log.info("starting: model %s, served as %s, on %s", config.model, ", ".join(server.served_model_name), config.device)
    warning = bind_warning(server)
    if warning:
        log.warning(warning)

    t1 = time.perf_counter()
    import uvicorn

    from engine.client.async_client import AsyncEngineClient
    from engine.errors import EngineDeadError
    from server.api_servers import ApiServers, listen_socket, share_metrics
    from server.app import build_app

    log.info("HTTP server modules imported in %.1f s", time.perf_counter() - t1)
    metrics_dir = share_metrics() if server.api_server_count > 1 else None
    try:
        client = AsyncEngineClient(config, log_level=args.log_level, num_clients=server.api_server_count)
    except EngineDeadError as e:
        return _fail(f"the engine did not start: {e}", 1)
    info = client.info
    log.info(
        "engine ready in %.1f s: %s (%s) on %s in %s, context %d; weights %.1f MiB, KV cache %.1f MiB "
        "(%d blocks of %d tokens)",
        time.perf_counter() - t0, info["architecture"], info["model_path"], info["device"], info["dtype"],
        info["max_context_length"], info["weights_bytes"] / (1 << 20), info["kv_cache_bytes"] / (1 << 20),
        info["kv_blocks_total"], info["block_size"],
    )
    died: list[str] = []

    def on_death(why: str = "the engine process died") -> None:  # stop serving, exit non-zero: a supervisor restarts us
        died.append(why)
        uv.should_exit = True

    helpers = ApiServers(config, server, client.pipes[1:], client.pid, metrics_dir) if metrics_dir is not None else None
    app = build_app(client, server, on_death, before_shutdown=helpers.stop if helpers else None)
    uv = uvicorn.Server(uvicorn.Config(
        app, host=server.host, port=server.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    ))
    log.info("serving on http://%s:%d with %d API server process(es)", server.host, server.port, server.api_server_count)
    if helpers is None:
        uv.run()
    else:
        sock = listen_socket(server.host, server.port)  # bound before the helpers start, so they bind beside it
        try:
            helpers.start(on_death)
        except RuntimeError as e:
            log.error("%s: exiting with status 1", e)
            return 1  # the engine, a daemon child, stops with this process
        uv.run(sockets=[sock])
    if died:
        log.error("%s: exiting with status 1", died[0])
        return 1
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from engine.demo_model import create_demo_model

    path = create_demo_model(args.dir, seed=args.seed)
    print(f"demo model (tiny random Qwen3 with a local tokenizer) written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="siesta", description="Siesta: an LLM server for RL rollouts")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over HTTP", formatter_class=_DefaultsOnce)
    defaults = ServerConfig()
    serve.add_argument("--host", default=defaults.host, help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=defaults.port, help="port to listen on")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route but /health")
    serve.add_argument("--admin-api-key", default=None,
                       help="the only key for the control routes (memory, weights, flush, pause, abort_all)")
    serve.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                       help="larger request bodies get 413")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names the /v1 routes answer to and /v1/models lists; replies carry the first "
                            "(default: --model as given)")
    serve.add_argument("--api-server-count", type=int, default=defaults.api_server_count,
                       help="HTTP processes in front of the one engine, sharing the port (as vLLM's; more admit "
                            "bursts of requests faster)")
    serve.add_argument("--tool-call-parser", default=defaults.tool_call_parser, choices=["hermes", "qwen25"],
                       help="how /v1/chat/completions reads tool calls from the output (vLLM's names; Qwen2.5 and Qwen3: hermes)")
    serve.add_argument("--log-level", default=defaults.log_level, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="DEBUG, INFO, WARNING or ERROR")
    add_engine_flags(serve)
    serve.set_defaults(func=_serve)

    table = sub.add_parser("config-table", help="print serve's flags as a markdown table (for README.md)")
    table.set_defaults(func=_config_table)

    demo = sub.add_parser("demo-model", help="write a tiny random Qwen3 checkpoint with a tokenizer")
    demo.add_argument("dir", help="directory to write")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo_model)
    return parser


def config_table() -> str:
    """The markdown table of `siesta serve`'s flags, as README.md shows it (a test keeps them equal)."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in serve._actions:  # noqa: SLF001
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = f"--[no-]{flag[2:]}"
        text = (action.help or "").replace("|", "\\|")
        rows.append(f"| `{flag}` | `{action.default}` | {text} |")
    return "\n".join(rows)


def _config_table(args: argparse.Namespace) -> int:
    print(config_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
