"""Tool calls on `/v1/chat/completions` (`tools`, `tool_choice`, `parallel_tool_calls`), as vLLM
serves them.

Modes (`tool_choice`):
- `auto` (the default with tools): the model decides; its output is parsed by the server's
  parser (`--tool-call-parser`): each call block becomes a call, the text outside them the content.
  A block that does not parse stays in the content, as vLLM leaves it.
- `none`: the tools are rendered, the output is not parsed.
- `required`: the output is constrained (engine/runner/grammar.py) to a JSON array of
  {"name", "parameters"} objects naming the tools, at least one (exactly one without
  `parallel_tool_calls`): vLLM's way.
- a named function: the output is constrained to its parameters' schema and is that call's
  arguments; finish_reason stays "stop" (OpenAI's, for a forced call).
Without `parallel_tool_calls` an `auto` reply keeps its first call. A reply with calls in `auto`
and `required` ends with finish_reason "tool_calls" where it would end with "stop".

Parsers, by vLLM's names: `hermes` (Qwen2.5, Qwen3, Hermes; SGLang's `qwen25`):
    <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest

Call = dict[str, Any]  # {"id", "type": "function", "function": {"name", "arguments": JSON text}}

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


def make_call(name: str, arguments: Any) -> Call:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _call_of(block: str) -> Call | None:
    """A Hermes block's call, None when it is not {"name": str, "arguments": ...}."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return make_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """(content: the text outside the parsed blocks, stripped, or None when empty; the calls)."""
    calls: list[Call] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        call = _call_of(m.group(1).strip())
        kept.append(text[at : m.start()] if call is not None else text[at : m.end()])
        at = m.end()
        if call is not None:
            calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return content or None, calls


class HermesStream:
    """One streamed choice's text, fed as it arrives: content as soon as it cannot begin a call
    block, each call once its block closes."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[Call]]:
        self.buffer += text
        content, calls = [], []
        while True:
            start = self.buffer.find(_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, _OPEN)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content.append(self.buffer[:start])
            end = self.buffer.find(_CLOSE, start)
            if end < 0:
                if final:
                    content.append(self.buffer[start:])
                    self.buffer = ""
                else:
                    self.buffer = self.buffer[start:]
                break
            block = self.buffer[start : end + len(_CLOSE)]
            call = _call_of(block[len(_OPEN) : -len(_CLOSE)].strip())
            if call is None:
                content.append(block)
            else:
                calls.append(call)
            self.buffer = self.buffer[end + len(_CLOSE) :]
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --tool-call-parser names (vLLM's; SGLang's `qwen25` is the same format) -> (whole, streamed).
PARSERS: dict[str, tuple[Any, Any]] = {"hermes": (parse_hermes, HermesStream), "qwen25": (parse_hermes, HermesStream)}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "named"
    functions: tuple[dict[str, Any], ...]  # each tool's "function": name, description, parameters
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"  # a PARSERS name

    @classmethod
    def of(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: str = "hermes") -> ToolChoice | None:
        """The request's tool settings; None without tools. 400s name the bad field."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise InvalidRequest("tool_choice needs tools")
            return None
        functions = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
            functions.append(fn)
        names = [f["name"] for f in functions]
        par = True if parallel is None else parallel
        if tool_choice in (None, "auto", "none", "required"):
            return cls(tool_choice or "auto", tuple(functions), None, par, parser)
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if name is None:
            raise InvalidRequest("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return cls("named", tuple(functions), name, par, parser)

    def json_schema(self) -> str | None:
        """The schema the output is constrained to (required, named), else None."""
        if self.mode == "named":
            fn = next(f for f in self.functions if f["name"] == self.name)
            return json.dumps(fn.get("parameters") or {"type": "object"})
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"enum": [f["name"]]},
                                                   "parameters": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "parameters"]} for f in self.functions]  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """A whole output's (content, calls)."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [make_call(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short by max_tokens: not an array yet
            return None, [make_call(c["name"], c["parameters"]) for c in items]
        content, calls = PARSERS[self.parser][0](text)
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> HermesStream:
        """A streamed choice's parser (`auto`)."""
        return PARSERS[self.parser][1]()

    def finish_reason(self, reason: str | None, calls: list[Call]) -> str | None:
        return "tool_calls" if calls and reason == "stop" and self.mode in ("auto", "required") else reason
