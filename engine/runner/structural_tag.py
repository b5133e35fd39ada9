"""Structural tags: free text in which a trigger opens a tag whose content must follow its format
up to its end (agentic tool calls: `<tool_call>{json}</tool_call>` amid prose). `xgrammar_tag`
turns what a client sends into xgrammar's StructuralTag JSON, which `Grammars` compiles.

Two shapes, as JSON text (SGLang's `sampling_params.structural_tag`, vLLM's
`structured_outputs.structural_tag`, or either's `response_format` serialized):
- SGLang's and vLLM's first form (their `LegacyStructuralTagResponseFormat`):
  {"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...], "triggers": [...],
  "at_least_one": false}. It becomes xgrammar's `triggered_tags` format, as xgrammar's
  `StructuralTag.from_legacy_structural_tag` builds it: any text until a trigger, then a
  structure whose `begin` starts with it, its content JSON matching `schema`, its `end`; then
  free text again. `at_least_one` (SGLang's) makes the output open with a structure.
- xgrammar's: {"type": "structural_tag", "format": {...}} (tags, sequences, triggered tags, ...),
  checked in full by xgrammar when compiled.

Rules:
- `type`, when given, is "structural_tag". A structure's `schema` null or absent is any JSON value,
  as SGLang's backend reads it; else a JSON schema object (or true/false). `begin` and `end` are
  non-empty strings; `triggers` a non-empty list of non-empty strings, and every `begin` starts
  with one of them (xgrammar's rule, named here before it compiles). Other keys are ignored, as
  both servers' models do.
- Every `json_schema` content allows whitespace between elements, at most `whitespace` characters
  in a row unless it sets its own `max_whitespace_cnt` (grammar.JSON_WHITESPACE: a weak policy
  otherwise spends its tokens on whitespace inside the tag); a null `json_schema` is any JSON.
- Anything else is an `InvalidRequest` that names the field. Pure Python: the server checks a
  request's tag with it before the engine sees the request.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequest

NAME = "structural_tag"


def xgrammar_tag(spec: str | dict[str, Any], whitespace: int | None = None, where: str = NAME) -> str:
    """xgrammar's StructuralTag JSON for a client's structural tag (text or parsed);
    `whitespace`: the most whitespace characters in a row in JSON contents that set no limit."""
    tag = _parse(spec, where)
    if tag.get("type", NAME) != NAME:
        raise InvalidRequest(f"{where}.type must be 'structural_tag', got {tag.get('type')!r}")
    if "structures" in tag:
        fmt = _legacy_format(tag, where)
    elif isinstance(tag.get("format"), dict):
        fmt = tag["format"]
        if not isinstance(fmt.get("type"), str):
            raise InvalidRequest(f"{where}.format.type must name a format (tag, triggered_tags, sequence, ...)")
    else:
        raise InvalidRequest(f"{where} needs `structures` and `triggers` (SGLang's and vLLM's form) "
                             "or a `format` object (xgrammar's)")
    return json.dumps({"type": NAME, "format": _bounded(fmt, whitespace)})


def _parse(spec: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (ValueError, RecursionError) as e:
            raise InvalidRequest(f"{where} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where} must be a JSON object, got {type(spec).__name__}")
    return spec


def _legacy_format(tag: dict[str, Any], where: str) -> dict[str, Any]:
    """SGLang's and vLLM's {structures, triggers, at_least_one} as xgrammar's triggered_tags."""
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise InvalidRequest(f"{where}.structures must be a non-empty list of {{begin, schema, end}}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequest(f"{where}.triggers must be a non-empty list of non-empty strings, got {triggers!r}")
    at_least_one = tag.get("at_least_one", False)
    if not isinstance(at_least_one, bool):
        raise InvalidRequest(f"{where}.at_least_one must be true or false, got {at_least_one!r}")
    tags = []
    for i, s in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not isinstance(s, dict):
            raise InvalidRequest(f"{at} must be an object {{begin, schema, end}}")
        for key in ("begin", "end"):
            if not isinstance(s.get(key), str) or not s[key]:
                raise InvalidRequest(f"{at}.{key} must be a non-empty string, got {s.get(key)!r}")
        schema = s.get("schema")
        if schema is not None and not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"{at}.schema must be a JSON schema object, got {type(schema).__name__}")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise InvalidRequest(f"{at}.begin {s['begin']!r} starts with none of the triggers {triggers!r}")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": {} if schema is None else schema}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": at_least_one}


def _bounded(fmt: dict[str, Any], whitespace: int | None) -> dict[str, Any]:
    """`fmt` with every json_schema content's defaults filled in (a copy; the walk is iterative:
    the nesting is the client's)."""
    root = json.loads(json.dumps(fmt))
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema":
                if node.get("json_schema") is None:
                    node["json_schema"] = {}
                if whitespace is not None and "max_whitespace_cnt" not in node:
                    node["max_whitespace_cnt"] = whitespace
                continue  # a JSON schema's own keys are not formats
            stack.extend(node.values())
    return root
