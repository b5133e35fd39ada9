"""The second servers of bench_serving.py. `--routed-experts` (a mixture-of-experts checkpoint):
the RL modes again against a server started with `--enable-return-routed-experts`, every request
carrying `"return_routed_experts": true`, each mode's tok/s against the same mode without (issue
74: >= 0.95). `--compare-server-args FLAGS`: the same against a server started with FLAGS added
(`--deterministic`, issue 76: >= 0.90), requests unchanged.

Rules:
- An answer's `meta_info.routed_experts` is the base64 of [prompt + output - 1, layers, top_k]
  integers of the server's `routed_experts_dtype` (server/schemas.py: int32 unless
  `--server-args "--routed-experts-dtype uint8"` or SGLang's SGLANG_ROUTED_EXPERTS_DTYPE say
  otherwise; read from the server's own config): its length is checked, never decoded.
- The routed run leaves out streams (an RL rollout does not stream, and every event would repeat
  the routes so far) and the online shape; its prompts are the run without's (the same seeds).
"""

from __future__ import annotations

from typing import Any

from serving_clients import SAMPLES

ROUTED_TARGET = 0.95  # a mode's tok/s with routed experts over the same mode's without
ROUTED_MODES = ("batched", "singles", "n8")


_ITEM_BYTES = {"int32": 4, "uint16": 2, "uint8": 1}  # an expert id, by the server's routed_experts_dtype


def route_ids(shape: dict[str, Any]) -> int:
    """Expert ids of routes per position: one per decoder layer per chosen expert (a dense
    layer's column is there too, as zeros)."""
    if not shape.get("num_experts"):
        raise ValueError("--routed-experts needs a mixture-of-experts checkpoint (--shape 30b-a3b, tiny-moe)")
    return int(shape["num_hidden_layers"]) * int(shape["num_experts_per_tok"])


def route_bytes(ids: int, server_info: dict[str, Any]) -> int:
    """Bytes of routes per position on a server whose /get_server_info is `server_info`."""
    return ids * _ITEM_BYTES[server_info["config"]["routed_experts_dtype"]]


def routed_rows(res: dict[str, Any], row: Any) -> None:
    """Per N and mode: tok/s with routed experts, then with --compare-server-args' flags, against
    the same mode without (`row` is serving_table's row builder)."""
    args = res["meta"]["args"]
    for key, what, least in (("rl_routed", "return_routed_experts", ROUTED_TARGET),
                             ("rl_compare", args.get("compare_server_args"), args.get("compare_target"))):
        for n, sec in sorted((res.get(key) or {}).items(), key=lambda kv: int(kv[0])):
            off = res["rl"].get(n) or {}
            for mode in ROUTED_MODES:
                if mode in sec:
                    label = {"batched": "one batched /generate", "singles": "N concurrent singles",
                             "n8": f"N/{SAMPLES} concurrent n:{SAMPLES}"}[mode]
                    row(f"N={n} {label} with {what}, tok/s; ref = without", sec[mode]["tokens_per_s"],
                        (off.get(mode) or {}).get("tokens_per_s"), f">= {least}", least, sec[mode])
