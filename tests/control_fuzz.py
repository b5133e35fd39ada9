"""A model-based fuzzer of the control plane: a seeded random walk of control calls against a real
server while traffic runs, with an oracle (tests/test_control_fuzz.py runs it on a CPU, and as a
GPU soak with graphs and overlap on).

The walk. One controller sends control calls one at a time and keeps a model of what they did:
release (a tag subset or all, `wait` or `abort`), resume (a subset or all), `pause_generation` in
its three modes then `continue_generation`, weight updates from disk and from tensors (per tensor
or a flattened bucket) alternating between two checkpoints, with and without `flush_cache`,
`flush_cache`, `abort_request`, and bursts: several of these at once with generates among them
(the storm of issue 72), after which the model re-reads the server. Traffic workers send greedy
and seeded generates meanwhile: shared prefixes, batches, `n > 1`, streams, streams aborted
mid-way. Choices come from `random.Random(seed)`; timing does not, so a replay of a seed makes the
same calls, not always in the same interleaving.

The oracle:
- A request that ran on one weight version equals that version's reference (transformers greedy
  on its checkpoint; an aborted one is a prefix of it). A request is judged so unless its life
  overlaps a weight update, or a time when the prefix cache may hold KV of other weights (from an
  update with `flush_cache: false` until a kv_cache release or a successful flush): that KV is
  kept on purpose. Seeded samples of one (version, prompt, seed) agree with each other.
- No 5xx but the 503 of generation while a tag is released or a release drains, and only then; no
  call without an answer within `call_timeout_s`.
- `/memory_occupation` agrees with the calls applied; once idle, no KV block is held, and every
  prompt gives its reference again.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

TAGS = ("weights", "kv_cache", "cuda_graph")
MAX_NEW = 24  # the references' length; requests ask for at most this many tokens


@dataclass(frozen=True)
class FuzzSetup:
    prompts: list[list[int]]
    refs: dict[str, list[list[int]]]  # checkpoint name -> greedy MAX_NEW tokens of each prompt
    dirs: dict[str, str]  # checkpoint name -> directory (updates from disk)
    tensors: dict[str, list[tuple[str, Any]]]  # checkpoint name -> a trainer's (name, tensor) pairs
    call_timeout_s: float = 120.0


@dataclass
class _Interval:
    start: float
    end: float | None = None  # None: still open

    def overlaps(self, start: float, end: float) -> bool:
        return self.start <= end and (self.end is None or self.end >= start)


@dataclass
class ControlWalk:
    url: str
    setup: FuzzSetup
    seed: int
    version: str  # the checkpoint name the server runs now
    failures: list[str] = field(default_factory=list)
    judged: int = 0  # requests compared with a reference
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.tags = dict.fromkeys(TAGS, "resident")
        self.paused = False
        self.unsafe: list[_Interval] = []  # outputs in these may mix weight versions
        self.unavailable: list[_Interval] = []  # generation may get 503 in these
        self.contamination: _Interval | None = None
        self.samples: dict[tuple[str, int, int], list[int]] = {}  # (version, prompt, seed) -> longest seen
        self.stop = False
        self.background: list[asyncio.Task] = []  # generates of bursts, awaited at the end

    # ---- the walk ----------------------------------------------------------------------------

    async def run(self, steps: int, workers: int = 3) -> None:
        # A pooled connection idle past the server's keep-alive (uvicorn's 5 s) may be closed by
        # the server just as the walk sends on it: a disconnect that says nothing of the server.
        # Idle connections are dropped here first.
        limits = httpx.Limits(max_connections=64, keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.setup.call_timeout_s, limits=limits) as http:
            self.http = http
            traffic = [asyncio.create_task(self._traffic(random.Random(self.seed * 1000 + w))) for w in range(workers)]
            try:
                for _ in range(steps):
                    await self._step()
                    if self.failures:
                        break
            finally:
                await self._settle()
                self.stop = True
                await asyncio.wait_for(asyncio.gather(*traffic, *self.background), self.setup.call_timeout_s)
            if not self.failures:
                await self._final_checks()

    async def _step(self) -> None:
        rules = [(self._release, 3), (self._resume, 3), (self._pause, 2), (self._update, 3),
                 (self._flush, 1), (self._abort_all, 1), (self._burst, 1), (self._idle, 4)]
        rule = self.rng.choices([r for r, _ in rules], [w for _, w in rules])[0]
        await rule()
        if rule is not self._burst:
            await self._check_occupation()

    async def _call(self, path: str, body: dict[str, Any] | None = None, expect: tuple[int, ...] = (200,)) -> httpx.Response:
        shown = {k: ("..." if k == "serialized_named_tensors" else v) for k, v in (body or {}).items()}
        self.log.append(f"{time.monotonic():.3f} {path} {json.dumps(shown) if body else ''}")
        try:
            r = await self.http.post(path, json=body)
        except httpx.TimeoutException:
            self._fail(f"{path} {json.dumps(body)[:200]} got no answer within {self.setup.call_timeout_s:.0f} s")
            raise
        if r.status_code not in expect:
            self._fail(f"{path} {json.dumps(body)[:200]}: {r.status_code} (expected {expect}): {r.text[:300]}")
        return r

    # ---- control rules ----------------------------------------------------------------------

    def _subset(self) -> list[str] | None:
        if self.rng.random() < 0.3:
            return None
        return self.rng.sample(TAGS, self.rng.randint(1, 3))

    async def _release(self) -> None:
        tags, mode = self._subset(), self.rng.choice(["wait", "abort"])
        gap = _Interval(time.monotonic())
        self.unavailable.append(gap)
        await self._call("/release_memory_occupation", {"tags": tags, "mode": mode})
        for t in tags or TAGS:
            self.tags[t] = "released"
        if "kv_cache" in (tags or TAGS):
            self._clean_kv()
        if self.rng.random() < 0.5:  # as a trainer does: train, then resume
            await self._idle()
            await self._resume()

    async def _resume(self) -> None:
        tags = self._subset()
        await self._call("/resume_memory_occupation", {"tags": tags})
        for t in tags or TAGS:
            self.tags[t] = "resident"
        self._maybe_available()

    async def _pause(self) -> None:
        await self._call("/pause_generation", {"mode": self.rng.choice(["abort", "retract", "in_place"])})
        self.paused = True
        for _ in range(self.rng.randint(0, 2)):  # a few other calls while paused
            await self.rng.choice([self._release, self._resume, self._update, self._idle])()
            await self._check_occupation()
        await self._call("/continue_generation")
        self.paused = False

    async def _update(self) -> None:
        target = "new" if self.version == "old" else "old"
        flush = self.rng.random() < 0.7
        source = self.rng.choice(["disk", "tensor", "bucket"])
        if source == "disk":
            path, body = "/update_weights_from_disk", {"model_path": self.setup.dirs[target]}
        else:  # a payload is read once (its shared memory goes with it): made for each call
            from engine.weights.payload import (
                flatten_bucket,
                serialize_named_tensors,
                serialize_payload,
            )

            pairs = self.setup.tensors[target]
            payload = serialize_payload(flatten_bucket(pairs)) if source == "bucket" else serialize_named_tensors(pairs)
            path = "/update_weights_from_tensor"
            body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket" if source == "bucket" else None}
        window = _Interval(time.monotonic())
        self.unsafe.append(window)
        resident = self.tags["weights"] == "resident"
        r = await self._call(path, body | {"flush_cache": flush}, expect=(200,) if resident else (400,))
        window.end = time.monotonic()
        if r.status_code != 200:
            return
        self.version = target
        if not flush and self.contamination is None:
            self.contamination = _Interval(window.start)
            self.unsafe.append(self.contamination)

    async def _flush(self) -> None:
        r = await self._call("/flush_cache", expect=(200, 400))
        if r.status_code == 200:
            self._clean_kv()

    async def _abort_all(self) -> None:
        await self._call("/abort_request", {"abort_all": True})

    async def _idle(self) -> None:
        await asyncio.sleep(self.rng.uniform(0.1, 1.0))

    async def _burst(self) -> None:
        """Several calls at once, generates among them; then the model re-reads the server. The
        generates are judged as any others: a release or a flush in the burst must not change them."""
        self.unavailable.append(_Interval(time.monotonic()))
        kinds = ["release", "resume", "flush", "pause", "continue", "generate"]
        calls = []
        for kind in self.rng.choices(kinds, k=self.rng.randint(4, 16)):
            if kind == "release":
                calls.append(self.http.post("/release_memory_occupation", json={"tags": self._subset()}))
            elif kind == "resume":
                calls.append(self.http.post("/resume_memory_occupation", json={"tags": self._subset()}))
            elif kind == "flush":
                calls.append(self.http.post("/flush_cache"))
            elif kind == "pause":
                calls.append(self.http.post("/pause_generation", json={"mode": self.rng.choice(["retract", "in_place"])}))
            elif kind == "continue":
                calls.append(self.http.post("/continue_generation"))
            else:  # judged when it ends: it may wait for the continue or the resume below or later
                self.background.append(asyncio.create_task(self._generate(self.rng, kind="batch")))
        self.log.append(f"{time.monotonic():.3f} burst of {len(calls)}")
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, Exception):
                self._fail(f"a call of a burst failed: {r!r}")
            elif isinstance(r, httpx.Response) and r.status_code >= 500:
                self._fail(f"a control call of a burst answered {r.status_code}: {r.text[:300]}")
        occupation = (await self.http.get("/memory_occupation")).json()
        self.tags = {t: v["state"] for t, v in occupation["tags"].items()}
        if (await self.http.get("/get_server_info")).json()["paused"]:
            await self._call("/continue_generation")
        self._maybe_available()

    def _clean_kv(self) -> None:
        """The KV from before is gone: no KV of other weights is left to read."""
        if self.contamination is not None:
            self.contamination.end = time.monotonic()
            self.contamination = None

    def _maybe_available(self) -> None:
        if all(s == "resident" for s in self.tags.values()):
            for gap in self.unavailable:
                if gap.end is None:
                    gap.end = time.monotonic()

    async def _check_occupation(self) -> None:
        r = await self.http.get("/memory_occupation")
        if r.status_code != 200:
            return self._fail(f"/memory_occupation: {r.status_code} {r.text[:300]}")
        got = {t: v["state"] for t, v in r.json()["tags"].items()}
        if got != self.tags:
            self._fail(f"/memory_occupation says {got}, the calls applied say {self.tags}")

    async def _settle(self) -> None:
        """Leave the server serving: continue, resume everything."""
        await self.http.post("/continue_generation")
        await self.http.post("/resume_memory_occupation", json={"tags": None})
        self.paused = False
        self.tags = dict.fromkeys(TAGS, "resident")
        self._maybe_available()

    # ---- traffic ----------------------------------------------------------------------------

    async def _traffic(self, rng: random.Random) -> None:
        while not self.stop and not self.failures:
            await self._generate(rng, kind=rng.choice(["single", "single", "batch", "n", "stream", "seeded"]))
            await asyncio.sleep(rng.uniform(0.0, 0.05))

    async def _generate(self, rng: random.Random, kind: str) -> None:
        k = rng.randrange(len(self.setup.prompts))
        m = rng.choice([1, 4, 8, 16, MAX_NEW])
        sp: dict[str, Any] = {"max_new_tokens": m, "temperature": 0, "ignore_eos": True}
        body: dict[str, Any] = {"input_ids": self.setup.prompts[k], "sampling_params": sp}
        rows = [k]
        if kind == "batch":
            rows = [rng.randrange(len(self.setup.prompts)) for _ in range(rng.randint(2, 3))]
            body["input_ids"] = [self.setup.prompts[i] for i in rows]
        elif kind == "n":
            sp["n"] = n = rng.randint(2, 3)
            rows = [k] * n
        elif kind == "seeded":
            sp |= {"temperature": 0.8, "seed": rng.randint(1, 3)}
        start, version = time.monotonic(), self.version
        if kind == "stream":
            outs = await self._stream(body, abort=rng.random() < 0.4)
        else:
            try:
                r = await self.http.post("/generate", json=body)
            except httpx.TimeoutException:
                return self._fail(f"/generate {body} got no answer within {self.setup.call_timeout_s:.0f} s")
            outs = self._outcome(r, start, body)
        end = time.monotonic()
        if outs is None:
            return
        for row, (ids, reason) in zip(rows, outs, strict=True):
            self._judge(version, row, m, ids, reason, start, end, seed=sp.get("seed"))

    async def _stream(self, body: dict[str, Any], abort: bool) -> list[tuple[list[int], str]] | None:
        rid = f"fuzz-{uuid.uuid4().hex}"
        start, last = time.monotonic(), None
        async with self.http.stream("POST", "/generate", json=body | {"stream": True, "rid": rid}) as r:
            if r.status_code != 200:
                await r.aread()
                return self._outcome(r, start, body)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return self._refusal(503 if "released" in json.dumps(event) else 500, json.dumps(event), start, body)
                last = event
                if abort:
                    abort = False
                    await self.http.post("/abort_request", json={"rid": rid})
        if last is None or last["meta_info"]["finish_reason"] is None:
            return self._fail(f"stream {body} ended without a finished event: {last}")
        return [(last["output_ids"], last["meta_info"]["finish_reason"]["type"])]

    def _outcome(self, r: httpx.Response, start: float, body: dict[str, Any]) -> list[tuple[list[int], str]] | None:
        if r.status_code != 200:
            return self._refusal(r.status_code, r.text, start, body)
        data = r.json()
        data = data if isinstance(data, list) else [data]
        return [(d["output_ids"], d["meta_info"]["finish_reason"]["type"]) for d in data]

    def _refusal(self, status: int, text: str, start: float, body: dict[str, Any]) -> None:
        if status == 503 and any(g.overlaps(start, time.monotonic()) for g in self.unavailable):
            return None
        self._fail(f"/generate {json.dumps(body)[:200]}: {status} {text[:300]}")

    def _judge(self, version: str, row: int, m: int, ids: list[int], reason: str, start: float, end: float,
               seed: int | None) -> None:
        if reason not in ("length", "abort") or len(ids) > m or (reason == "length" and len(ids) != m):
            return self._fail(f"prompt {row}: finish_reason {reason} with {len(ids)} of {m} tokens: {ids}")
        if any(u.overlaps(start, end) for u in self.unsafe):
            return  # ran across a weight change or beside KV of other weights: no single reference
        self.judged += 1
        if seed is None:
            ref = self.setup.refs[version][row][: len(ids)]
            if ids != ref:
                self._fail(f"prompt {row} on weights {version!r}: {ids} != reference {ref} ({reason})")
            return
        seen = self.samples.setdefault((version, row, seed), ids)
        n = min(len(seen), len(ids))
        if seen[:n] != ids[:n]:
            self._fail(f"prompt {row} seed {seed} on {version!r}: {ids} disagrees with an earlier sample {seen}")
        elif len(ids) > len(seen):
            self.samples[(version, row, seed)] = ids

    # ---- the end ----------------------------------------------------------------------------

    async def _final_checks(self) -> None:
        deadline = time.monotonic() + self.setup.call_timeout_s
        while time.monotonic() < deadline:
            info = (await self.http.get("/get_server_info")).json()
            if info["num_running"] == 0 and info["num_waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        if info["num_running"] or info["num_waiting"] or info["kv_blocks_free"] != info["kv_blocks_total"]:
            self._fail(f"idle server holds requests or blocks: {info}")
        if self.contamination is not None:  # KV of the weights before a no-flush update, kept on purpose
            await self._call("/flush_cache")
            self._clean_kv()
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        r = await self.http.post("/generate", json={"input_ids": self.setup.prompts, "sampling_params": sp})
        got = [d["output_ids"] for d in r.json()]
        for row, (ids, ref) in enumerate(zip(got, self.setup.refs[self.version], strict=True)):
            if ids != ref:
                self._fail(f"at the end, prompt {row} on {self.version!r}: {ids} != reference {ref}")

    def _fail(self, message: str) -> None:
        self.failures.append(message)
