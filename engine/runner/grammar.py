"""Grammar-constrained decoding (SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag`
sampling params; the OpenAI routes' `response_format` and forced tool calls), through xgrammar:
`Grammars` compiles a request's grammar once (cached by its text) and gives the request a
`RequestGrammar`, its matcher. Structural tags are read by engine/runner/structural_tag.py.

    mask [V // 32 rounded up] int32: bit t of word t // 32 set iff token t may come next

Rules:
- The mask of a step is the matcher's state after every token the request has: the engine reads
  a step that has a constrained row before it schedules the next (`LaunchedStep.needs_host_tokens`),
  and `accept` takes each token as it is read, before anything else of the step is applied.
- The stop tokens of a grammar are the request's (the model's EOS unless `ignore_eos`, plus its
  `stop_token_ids`): once the grammar can end, a stop token is allowed, and sampling it finishes
  the request as any stop does. A request with none (`ignore_eos`, no stop ids) finishes with
  `stop` as soon as its grammar can end (`RequestGrammar.ended`); a structural tag's free text
  can end anywhere, so such a request ends only where nothing may follow (checked by filling
  one more mask when its grammar can end). A request that runs out of tokens first ends with
  `length`.
- A matcher's failure never stops the engine: a mask it cannot fill allows every token (logged).
  Nor does an install without xgrammar (a declared dependency): a constrained request is then
  refused with a message naming the package, and the engine serves the others.
- Masks span the tokenizer's vocabulary, the first rows of the model's (its embedding rows, padded
  past the tokenizer): the sampler never allows a row past the mask. (xgrammar fills a mask 100x
  slower when told the padded size: 333 against 3 us a row at Qwen3's 151,936 over a 512-token
  tokenizer.) A step's masks are filled into one buffer, one row per constrained request.
- JSON schemas allow whitespace between elements, as vLLM's and SGLang's defaults do, but at most
  JSON_WHITESPACE characters in a row: a weak policy otherwise spends its tokens on whitespace
  (the loop both projects' issues report) and never closes the object.
- The tokenizer is loaded in the engine process on the first constrained request.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from engine.errors import InvalidRequest
from engine.request import Request
from engine.runner.structural_tag import xgrammar_tag

log = logging.getLogger("siesta.engine")

# SamplingParams field -> the xgrammar compiler method that reads it, and its options.
KINDS = {"json_schema": "compile_json_schema", "regex": "compile_regex", "ebnf": "compile_grammar",
         "structural_tag": "compile_structural_tag"}
JSON_WHITESPACE = 16
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_OPTIONS: dict[str, dict[str, Any]] = {"json_schema": {"any_whitespace": True, "max_whitespace_cnt": JSON_WHITESPACE}}


class RequestGrammar:
    """One request's position in its grammar; `vocab`: the tokenizer's size, its masks' span.
    `open_ended`: its matcher terminates wherever the grammar can end (no stop token) though text
    may go on there (a structural tag's free text)."""

    def __init__(self, matcher: Any, vocab: int, open_ended: bool = False) -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.open_ended = open_ended
        self.ended = False  # nothing may follow: the request finishes (engine/request.py)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it (or has ended)."""
        ok = bool(self.matcher.accept_token(token_id))
        self.ended = bool(self.matcher.is_terminated()) and not (self.open_ended and self._may_go_on())
        return ok

    def _may_go_on(self) -> bool:
        """Some token may come next (its mask, [1, ceil(vocab / 32)] int32, has a bit set)."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return bool(mask.any())


def fill_masks(grammars: list[RequestGrammar]) -> bytes:
    """The next-token masks of a step's constrained rows: [rows, ceil(vocab / 32)] int32, as
    little-endian bytes (every row of one tokenizer)."""
    import xgrammar as xgr

    masks = xgr.allocate_token_bitmask(len(grammars), grammars[0].vocab)
    for i, g in enumerate(grammars):
        try:
            g.matcher.fill_next_token_bitmask(masks, i)
        except RuntimeError as e:  # xgrammar's checks: a bug of ours, not the engine's end
            log.error("grammar mask failed (%s); this row is unconstrained for the step", e)
            masks[i].fill_(-1)
    return masks.numpy().tobytes()


class Grammars:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's: token ids past it are never sampled
        self._compiler: Any = None
        self._vocab = 0  # the tokenizer's, once loaded
        self._compiled: dict[tuple[str, str], Any] = {}

    def attach(self, req: Request) -> str | None:
        """Give `req` its matcher if its params name a grammar; the error (a 400's message) when
        the grammar does not compile, else None."""
        spec = constraint(req)
        if spec is None:
            return None
        try:
            compiled = self._compile(*spec)
        except InvalidRequest as e:
            return str(e)
        except ImportError as e:
            return f"sampling_params.{spec[0]} needs grammar-constrained decoding, and this server cannot import xgrammar ({e})"
        import xgrammar as xgr

        p = req.sampling_params
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)))
        matcher = (xgr.GrammarMatcher(compiled, override_stop_tokens=stops) if stops
                   else xgr.GrammarMatcher(compiled, terminate_without_stop_token=True))  # fmt: skip
        req.grammar = RequestGrammar(matcher, self._vocab, open_ended=not stops and spec[0] == "structural_tag")
        return None

    def _compile(self, kind: str, text: str) -> Any:
        key = (kind, text)
        if key not in self._compiled:
            compiler = self._compiler_once()
            source = text
            if kind == "structural_tag":  # either client's shape; an InvalidRequest names the field
                source = xgrammar_tag(text, JSON_WHITESPACE, "sampling_params.structural_tag")
            try:
                self._compiled[key] = getattr(compiler, KINDS[kind])(source, **_OPTIONS.get(kind, {}))
            except Exception as e:  # xgrammar's parse errors name the position
                raise InvalidRequest(f"sampling_params.{kind} does not compile: {_reason(e)}") from None
        return self._compiled[key]

    def _compiler_once(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self._vocab = min(len(tokenizer), self.vocab_size)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[time] file.cc:line: Check failed: ... is
    false: "), under the exception's type name."""
    text = _LOG_PREFIX.sub("", str(e).strip())
    return f"{type(e).__name__}: {text}"


def constraint(req: Request) -> tuple[str, str] | None:
    """(kind, grammar text) of the request's constraint, or None."""
    p = req.sampling_params
    for kind in KINDS:
        text = getattr(p, kind)
        if text is not None:
            return kind, text
    return None
