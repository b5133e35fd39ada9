"""What constrains an OpenAI-route request's output: `response_format` and vLLM's structured
outputs, read as the engine's one grammar param (engine/runner/grammar.py).

Rules:
- `response_format`: `text` (none), `json_object` (any object), `json_schema` (its `schema`),
  `structural_tag` (free text with constrained tags, SGLang's and vLLM's: either their
  {structures, triggers} form or xgrammar's {format}; engine/runner/structural_tag.py). The
  completions and chat routes take it alike, as both servers do.
- vLLM's `structured_outputs` {json | regex | grammar | structural_tag} (null keys are unset) and
  its older top-level `guided_json`, `guided_regex`, `guided_grammar`: the engine's json_schema,
  regex, ebnf and structural_tag. Another key is a 400 naming it.
- One constraint per request (a chat's forced tool choice counts as one); two are a 400 naming
  both. A malformed constraint is a 400 naming the field before the engine sees it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from engine.errors import InvalidRequest
from engine.runner.structural_tag import xgrammar_tag

# vLLM's structured_outputs keys -> the engine's SamplingParams field.
_STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "structural_tag": "structural_tag"}


def structured_output(so: Any, where: str = "structured_outputs") -> dict[str, str]:
    """Every constraint vLLM's `structured_outputs` gives, as {engine field: text} (0 or more)."""
    if so is None:
        return {}
    if not isinstance(so, dict):
        raise InvalidRequest(f"{where} must be an object with one of {', '.join(_STRUCTURED)}")
    found = {}
    for key, spec in so.items():
        if spec is None:
            continue
        if key not in _STRUCTURED:
            raise InvalidRequest(f"{where}.{key} is not supported ({', '.join(_STRUCTURED)})")
        field = _STRUCTURED[key]
        if field == "json_schema":
            found[field] = spec if isinstance(spec, str) else json.dumps(spec)
        elif field == "structural_tag":
            found[field] = _checked_tag(spec, f"{where}.structural_tag")
        else:
            found[field] = str(spec)
    return found


def _checked_tag(spec: Any, where: str) -> str:
    """A structural tag's JSON text, its shape checked (a 400 naming the field when wrong)."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    xgrammar_tag(text, where=where)
    return text


class OutputConstraints(BaseModel):
    """The fields that constrain the output, shared by the completions and chat requests."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None

    def constraint(self, forced: dict[str, tuple[str, str]] | None = None) -> dict[str, str]:
        """The engine's grammar param ({} or {field: text}, one field of json_schema, regex, ebnf
        and structural_tag); `forced`: {source name: (field, text)} of the route's own (a chat's
        forced tool choice)."""
        found = dict(forced or {})
        fmt = self.response_format_constraint()
        if fmt is not None:
            found["response_format"] = fmt
        guided = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("grammar", self.guided_grammar)) if v is not None}  # fmt: skip
        so = {**(self.structured_outputs or {}), **guided}
        for field, text in structured_output(so).items():
            found[f"structured_outputs.{field}"] = (field, text)
        if len(found) > 1:
            raise InvalidRequest(f"give one output constraint, got {', '.join(found)}")
        return dict(found.values())

    def response_format_constraint(self) -> tuple[str, str] | None:
        """(engine field, text) that `response_format` constrains the output to; None for `text`
        or none."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return "json_schema", json.dumps({"type": "object"})
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object")
            return "json_schema", json.dumps(schema)
        if kind == "structural_tag":
            return "structural_tag", _checked_tag(fmt, "response_format")
        raise InvalidRequest(f"response_format.type must be text, json_object, json_schema or structural_tag, got {kind!r}")
