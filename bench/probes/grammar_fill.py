"""The host's grammar mask fill at a real model's vocabulary, xgrammar against llguidance.

No model's tokenizer is at hand offline, so bench/bpe_tokenizer.py builds one: a byte-level BPE of
`--vocab` tokens (default Qwen3's 151,643) trained on generated text, cached under `--cache-dir`.
For each backend and grammar (`--grammars`: a tool-call-like JSON schema, `json_object`, regexes
of a dated sentence: its words as a character class, as a repeated group, and, when named, as a
group repeated 3 to 40 times), used as the engine uses them (engine/runner/grammar.py: JSON whitespace at most 16
characters in a row, `--whitespace`; compiled on one thread; masks over the tokenizer's span),
through each library's Python API:

- tokenizer info: xgrammar's TokenizerInfo + GrammarCompiler, llguidance's LLTokenizer;
- compile: xgrammar's compile (once per grammar text, cached by the engine), llguidance's
  LLMatcher (the grammar compiles as a matcher is built: every request builds one, as vLLM's
  backend does), and `matcher`: what each new request pays (xgrammar's GrammarMatcher,
  llguidance's LLMatcher again);
- per-token fill and accept at batch 1: a fresh matcher walks the tokens of a generated document
  the grammar accepts, filling the mask before each token (and checking it allows that token);
- `--batch` matchers per step (a decode step's rows, each walking its own documents, spread
  over their positions): the fill of every row one after another, and through each library's
  parallel API (xgrammar's BatchGrammarMatcher, llguidance's LLExecutor) on `--threads` threads.

A mask that does not allow the document's next token, or a token refused, counts under `refused`
and makes the exit status 1.

    python3 bench/probes/grammar_fill.py --out /tmp/grammar_fill.json        # 151,643 tokens
    python3 bench/probes/grammar_fill.py --tiny --out /tmp/grammar_fill.json  # ~2k tokens, seconds
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCH]

from bench_runtime import say, write_json  # noqa: E402
from bpe_tokenizer import Text, bpe_tokenizer  # noqa: E402
from report import print_table  # noqa: E402

TOOLS = ["get_weather", "search_web", "read_file", "write_file", "run_query", "send_email", "list_events", "translate"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "arguments", "id"], "properties": {
    "name": {"type": "string", "enum": TOOLS},
    "arguments": {"type": "object", "additionalProperties": False, "required": ["query", "unit", "filters"], "properties": {
        "query": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include": {"type": "array", "items": {"type": "string", "enum": ["hourly", "daily", "alerts", "radar"]}},
        "filters": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                               "required": ["field", "op", "value"], "properties": {
            "field": {"type": "string"}, "op": {"type": "string", "enum": ["eq", "ne", "lt", "gt", "in"]},
            "value": {"anyOf": [{"type": "string"}, {"type": "number"}]}}}},
        "locale": {"type": "string", "pattern": "^[a-z]{2}-[A-Z]{2}$"}}},
    "id": {"type": "string"}}}
MODULES = {"xgrammar": ["xgrammar"], "llguidance": ["llguidance", "llguidance.hf", "llguidance.torch"]}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]): "
GRAMMARS = {"json_schema": json.dumps(SCHEMA), "json_object": json.dumps({"type": "object"}),
            "regex": DATE + r"[A-Z][a-z]+[a-z ,]*\.",  # every regex accepts document(text, "regex")
            "regex_words": DATE + r"[A-Z][a-z]+( [a-z]+,?)+\.", "regex_words_40": DATE + r"[A-Z][a-z]+( [a-z]+,?){3,40}\."}


def document(text: Text, kind: str) -> str:
    """A document `kind`'s grammar accepts, as a model would write it (one line, ", " and ": ")."""
    r = text.rng
    if kind == "json_object":
        return json.dumps({text.ident(): text.value(1) for _ in range(r.randrange(4, 9))}, ensure_ascii=False)
    if kind.startswith("regex"):
        date = f"{r.randrange(1900, 2100)}-{r.randrange(1, 13):02d}-{r.randrange(1, 29):02d}"
        words = " ".join(text.pick(text.words) + r.choice(("", ",")) for _ in range(r.randrange(3, 40)))
        return f"{date}: {text.pick(text.words).title()} {words}."
    filters = [{"field": text.ident(), "op": r.choice(["eq", "ne", "lt", "gt", "in"]),
                "value": text.phrase(1, 4) if r.random() < 0.5 else round(r.uniform(-100, 1e4), 2)}
               for _ in range(r.randrange(1, 5))]  # fmt: skip
    args = {"query": text.phrase(3, 16), "unit": r.choice(["celsius", "fahrenheit", "kelvin"]), "days": r.randrange(1, 15),
            "include": r.sample(["hourly", "daily", "alerts", "radar"], r.randrange(0, 5)), "filters": filters,
            "locale": r.choice(["en-US", "fr-FR", "de-DE", "zh-CN", "ja-JP"])}
    return json.dumps({"name": r.choice(TOOLS), "arguments": args, "id": f"call_{r.getrandbits(64):016x}"}, ensure_ascii=False)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf: Any, threads: int, whitespace: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, len(hf)
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf)), max_threads=1,
                                            cache_enabled=False)  # fmt: skip
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.whitespace = whitespace if whitespace > 0 else None

    def compile(self, kind: str, text: str) -> Any:
        if kind.startswith("regex"):
            return self.compiler.compile_regex(text)
        return self.compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=self.whitespace)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: Any, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def fill_batch(self, ms: list[Any], mask: Any) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, mask)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf: Any, threads: int, whitespace: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.fills, self.vocab = llguidance, llguidance.torch, len(hf)
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.whitespace = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{1,{whitespace}}}"} if whitespace > 0 else {}

    def compile(self, kind: str, text: str) -> Any:
        M = self.llg.LLMatcher
        grammar = M.grammar_from_regex(text) if kind.startswith("regex") else M.grammar_from_json_schema(text, overrides=self.whitespace)
        self.matcher(grammar)  # the grammar compiles when a matcher is built
        return grammar

    def matcher(self, grammar: str) -> Any:
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fill(self, m: Any, mask: Any, row: int) -> None:
        self.fills.fill_next_token_bitmask(m, mask, row)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()

    def fill_batch(self, ms: list[Any], mask: Any) -> None:
        self.fills.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)


def allows(mask: Any, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def walk(be: Any, grammar: Any, docs: list[list[int]]) -> dict[str, Any]:
    """Batch 1: a fresh matcher per document, the mask filled before each of its tokens."""
    import torch

    mask = torch.zeros(1, (be.vocab + 31) // 32, dtype=torch.int32)
    fill, accept, new, first, refused = [], [], [], [], 0
    for tokens in docs:
        t0 = time.perf_counter()
        m = be.matcher(grammar)
        new.append(time.perf_counter() - t0)
        for i, t in enumerate(tokens):
            t0 = time.perf_counter()
            be.fill(m, mask, 0)
            (first if i == 0 else fill).append(time.perf_counter() - t0)
            refused += not allows(mask, 0, t)
            t0 = time.perf_counter()
            refused += not be.accept(m, t)
            accept.append(time.perf_counter() - t0)
    return {"tokens": sum(map(len, docs)), "refused": refused, "matcher_s": statistics.median(new), "first_fill_s": statistics.median(first),
            "fill_s_p50": statistics.median(fill), "fill_s_mean": statistics.fmean(fill), "fill_s_p99": pct(fill, 0.99), "accept_s_p50": statistics.median(accept)}


def steps(be: Any, grammar: Any, docs: list[list[int]], batch: int, parallel: bool, max_steps: int) -> dict[str, Any]:
    """`batch` rows, each walking documents one after another (a fresh matcher each, built outside
    the clock), row i starting i / batch of the way into its first: per step the fill of every
    row's mask (timed), then each row accepts its next token."""
    import torch

    rows = []  # [matcher, tokens, position, the next document's index]
    for i in range(batch):
        m, tokens = be.matcher(grammar), docs[i % len(docs)]
        start = i * len(tokens) // batch
        assert all(be.accept(m, t) for t in tokens[:start])
        rows.append([m, tokens, start, i + batch])
    mask = torch.zeros(batch, (be.vocab + 31) // 32, dtype=torch.int32)
    times, refused, ended = [], 0, 0
    for _ in range(max_steps):
        t0 = time.perf_counter()
        if parallel:
            be.fill_batch([r[0] for r in rows], mask)
        else:
            for i, r in enumerate(rows):
                be.fill(r[0], mask, i)
        times.append(time.perf_counter() - t0)
        for i, r in enumerate(rows):
            m, tokens, pos, nxt = r
            refused += not allows(mask, i, tokens[pos]) or not be.accept(m, tokens[pos])
            if pos + 1 < len(tokens):
                r[2] = pos + 1
            else:
                r[:], ended = [be.matcher(grammar), docs[nxt % len(docs)], 0, nxt + batch], ended + 1
    return {"steps": len(times), "documents_ended": ended, "refused": refused, "step_s_p50": statistics.median(times),
            "step_s_p99": pct(times, 0.99)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151643, help="tokens of the BPE tokenizer (Qwen3's 151,643)")
    p.add_argument("--tiny", action="store_true", help="a ~2k-token tokenizer, one document per grammar: seconds")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "siesta-grammar-fill"))
    p.add_argument("--docs", type=int, default=8, help="documents walked at batch 1, per grammar")
    p.add_argument("--batch", type=int, default=64, help="matchers per step")
    p.add_argument("--max-steps", type=int, default=256, help="steps timed at --batch rows")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the parallel fill APIs")
    p.add_argument("--backends", default="xgrammar,llguidance")
    p.add_argument("--whitespace", type=int, default=16, help="most JSON whitespace in a row (the engine's); 0: any")
    p.add_argument("--grammars", default="json_schema,json_object,regex,regex_words", help=f"of {', '.join(GRAMMARS)}")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    vocab, ndocs, max_steps = (2048, 1, min(args.max_steps, 64)) if args.tiny else (args.vocab, args.docs, args.max_steps)
    hf, tok = bpe_tokenizer(vocab, args.cache_dir)
    say(f"tokenizer: {tok['vocab']} tokens, {'trained' if tok['trained'] else 'cached'} in {tok['seconds']:.1f} s ({tok['path']})")
    text = Text(vocab, seed=1)
    grammars = {k: GRAMMARS[k] for k in args.grammars.split(",")}
    docs = {k: [hf.encode(document(text, k), add_special_tokens=False) for _ in range(max(ndocs, 2 * args.batch))] for k in grammars}
    res: dict[str, Any] = {"grammars": grammars, "tokenizer": tok, "args": vars(args), "cpus": os.cpu_count(), "backends": {}}
    backends = {}
    for name in args.backends.split(","):
        for module in MODULES[name]:  # imported before the clock starts
            importlib.import_module(module)
        t0 = time.perf_counter()
        backends[name] = {"xgrammar": Xgrammar, "llguidance": Llguidance}[name](hf, args.threads, args.whitespace)
        res["backends"][name] = {"tokenizer_info_s": time.perf_counter() - t0, "grammars": {}}
        say(f"{name}: tokenizer info {res['backends'][name]['tokenizer_info_s'] * 1e3:.0f} ms")
    rows = []
    for kind, source in grammars.items():  # the backends side by side in time: the same load on both
        for name, be in backends.items():
            t0 = time.perf_counter()
            grammar = be.compile(kind, source)
            g = res["backends"][name]["grammars"][kind] = {"compile_s": time.perf_counter() - t0,
                                                          "batch1": walk(be, grammar, docs[kind][:ndocs])}  # fmt: skip
            g["sequential"] = steps(be, grammar, docs[kind], args.batch, False, max_steps)
            g["parallel"] = steps(be, grammar, docs[kind], args.batch, True, max_steps)
            b1, sq, pa = g["batch1"], g["sequential"], g["parallel"]
            refused = b1["refused"] + sq["refused"] + pa["refused"]
            say(f"{name} {kind}: compile {g['compile_s'] * 1e3:.1f} ms, fill p50 {b1['fill_s_p50'] * 1e6:.1f} us, "
                f"{args.batch} rows {sq['step_s_p50'] * 1e3:.2f} ms, parallel {pa['step_s_p50'] * 1e3:.2f} ms, refused {refused}")
            rows.append([kind, name, g["compile_s"] * 1e3, b1["matcher_s"] * 1e3, b1["first_fill_s"] * 1e6, b1["tokens"],
                         b1["fill_s_p50"] * 1e6, b1["fill_s_mean"] * 1e6, b1["fill_s_p99"] * 1e6, b1["accept_s_p50"] * 1e6,
                         sq["step_s_p50"] * 1e3, sq["step_s_p99"] * 1e3, pa["step_s_p50"] * 1e3, pa["step_s_p99"] * 1e3, refused])
            write_json(args.out, res)
    res["table"] = rows
    write_json(args.out, res)
    info = ", ".join(f"{n} {b['tokenizer_info_s'] * 1e3:.0f} ms" for n, b in res["backends"].items())
    B = args.batch
    print_table(f"grammar mask fill, {tok['vocab']}-token BPE, {os.cpu_count()} CPUs, {args.threads} fill threads",
                ["grammar", "backend", "compile ms", "matcher ms", "first fill us", "tokens", "fill p50 us", "fill mean us", "fill p99 us",
                 "accept p50 us", f"{B} rows p50 ms", f"{B} rows p99 ms", f"{B} rows par p50 ms", f"{B} rows par p99 ms", "refused"],
                rows, [f"tokenizer info: {info}; JSON in {args.out}"])  # fmt: skip
    return 1 if any(r[-1] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
