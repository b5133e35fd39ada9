"""The load generator of bench_serving.py: client processes, what they send, what they record
(serving_summary.py sums a section up).

Rules:
- P client processes (multiprocessing, spawn), each with its own asyncio loop and httpx.AsyncClients
  kept for the whole run, talking to 127.0.0.1 only. A process spreads its requests round-robin
  over ceil(requests / PER_CLIENT) clients, so no client has more than PER_CLIENT in flight:
  httpcore's pool re-scans all its connections on every request event (encode/httpx#3215), which
  at 128 connections in one client cost 0.77 ms of CPU per streamed event here (0.28 ms sharded).
- A section is a list of requests per process, each with its send time as an offset from a
  common start (`time.perf_counter`, CLOCK_MONOTONIC: one clock for every process). Bodies are
  JSON-encoded before the start, so the clients spend the section's time on the wire only.
- A non-streamed request ends when its whole body has arrived; it is parsed and checked after
  that (every result finished by `length` with the tokens expected, logprobs when asked).
- A stream is read as raw bytes split into `data:` events; a token count is taken from each
  event's `"completion_tokens": ` without parsing the event (the server repeats all ids so far in
  every event); only the last event is parsed and checked. TTFT: the first event with a token;
  inter-token latency: the gap between events that add tokens, per event (as
  sglang.bench_serving records it).
- Each process reports its CPU seconds (`time.process_time`) from the start to its last answer.
- Bounded: every request has a timeout; a worker waits at most MAX_IDLE_S for a command and exits
  when its parent is gone; the parent waits at most the section's timeout for each answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any

import httpx

MAX_IDLE_S = 3600
PER_CLIENT = 16
SAMPLES = 8  # n of the n8 mode's requests
CLIENT_CPU_LIMIT_PCT = 90.0  # a section whose busiest client process used more is invalid
_JSON = {"content-type": "application/json"}
_COUNT_KEY = b'"completion_tokens":'  # then optional spaces, then the count (any JSON writer)


# ---- what is sent -------------------------------------------------------------------------------


def random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def spec(body: dict[str, Any], expect_tokens: int, expect_results: int = 1, at: float = 0.0,
         gaps: bool = False, routes: int = 0) -> dict[str, Any]:
    """One request: the encoded body, when to send it, what a correct answer holds (`routes`:
    the length of each result's base64 routed experts; 0: none asked)."""
    return {"payload": json.dumps(body).encode(), "stream": bool(body.get("stream")), "at": at,
            "expect_tokens": expect_tokens, "expect_results": expect_results,
            "logprobs": bool(body.get("return_logprob")), "gaps": gaps, "routes": routes}


def poisson_offsets(rng: random.Random, count: int, rate: float) -> list[float]:
    """Send times of `count` requests arriving as a Poisson process of `rate` per second (all at
    once when the rate is infinite), as sglang.bench_serving schedules them."""
    if math.isinf(rate):
        return [0.0] * count
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def deal(items: list[Any], procs: int) -> list[list[Any]]:
    """Round-robin over the client processes."""
    return [items[i::procs] for i in range(procs)]


def rl_specs(mode: str, prompts: list[list[int]], sampling: dict[str, Any], procs: int,
             samples: int = SAMPLES, route_bytes: int = 0) -> tuple[list[list[dict[str, Any]]], int]:
    """One RL-shape section's requests dealt to the client processes, and the output tokens it
    expects. batched: one request of all prompts; singles: one request each; streams: one stream
    each, no logprobs; n8: the first len/samples prompts, `n: samples` each (as many samples).
    `route_bytes` > 0 (bytes of routes per position): every request asks for its routed experts."""
    out = sampling["max_new_tokens"]
    top = {"return_logprob": True} | ({"return_routed_experts": True} if route_bytes else {})
    b64 = 4 * -(-(len(prompts[0]) + out - 1) * route_bytes // 3) if route_bytes else 0  # same length prompts
    if mode == "batched":
        body = {"input_ids": prompts, "sampling_params": sampling} | top
        return [[spec(body, out, len(prompts), routes=b64)]] + [[] for _ in range(procs - 1)], out * len(prompts)
    if mode == "n8":
        group = prompts[: len(prompts) // samples]
        body = {"sampling_params": sampling | {"n": samples}} | top
        specs = [spec(body | {"input_ids": p}, out, samples, routes=b64) for p in group]
        return deal(specs, procs), out * samples * len(group)
    extra = {"stream": True} if mode == "streams" else top
    specs = [spec({"input_ids": p, "sampling_params": sampling} | extra, out, routes=b64 * (mode != "streams"))
             for p in prompts]
    return deal(specs, procs), out * len(prompts)


def online_specs(rng: random.Random, count: int, rate: float, input_len: int, output_len: int, ratio: float,
                 vocab: int, sampling: dict[str, Any], procs: int) -> tuple[list[list[dict[str, Any]]], int]:
    """sglang.bench_serving's random dataset: streamed requests with input and output lengths
    uniform in [max(ratio * len, 1), len], sent at Poisson arrival times; (shares, tokens expected)."""
    specs, total = [], 0
    for at in poisson_offsets(rng, count, rate):
        n_in = rng.randint(max(int(input_len * ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * ratio), 1), output_len)
        body = {"input_ids": random_prompts(rng, 1, n_in, vocab)[0], "stream": True,
                "sampling_params": sampling | {"max_new_tokens": n_out}}
        specs.append(spec(body, n_out, at=at, gaps=True))
        total += n_out
    return deal(specs, procs), total


# ---- the client process -------------------------------------------------------------------------


def _count(event: bytes) -> int | None:
    i = event.rfind(_COUNT_KEY)
    if i < 0:
        return None
    j = i + len(_COUNT_KEY)
    while j < len(event) and event[j] == 32:  # json.dumps writes ": ", compact writers ":"
        j += 1
    k = j
    while k < len(event) and 48 <= event[k] <= 57:
        k += 1
    return int(event[j:k]) if k > j else None


def _check(results: list[dict[str, Any]], s: dict[str, Any]) -> str | None:
    """Why an answer is wrong, or None."""
    if len(results) != s["expect_results"]:
        return f"{len(results)} results, expected {s['expect_results']}"
    for r in results:
        meta = r.get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason != "length" or meta.get("completion_tokens") != s["expect_tokens"]:
            return f"finish {reason} after {meta.get('completion_tokens')} tokens, expected length after {s['expect_tokens']}"
        if s["logprobs"] and len(meta.get("output_token_logprobs") or []) != s["expect_tokens"]:
            return "output_token_logprobs missing or short"
        if s["routes"] and len(meta.get("routed_experts") or "") != s["routes"]:
            return f"routed_experts of {len(meta.get('routed_experts') or '')} base64 characters, expected {s['routes']}"
    return None


async def _stream(client: httpx.AsyncClient, s: dict[str, Any], rec: dict[str, Any]) -> None:
    async with client.stream("POST", "/generate", content=s["payload"], headers=_JSON) as r:
        if r.status_code != 200:
            rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        buf, last, count, prev = b"", b"", 0, 0.0
        async for chunk in r.aiter_raw():
            now = time.perf_counter()
            *events, buf = (buf + chunk).split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                n = _count(ev)
                if n is None:
                    rec["error"] = f"event without a token count: {ev[:200]!r}"
                    continue
                if n > count:
                    if rec["first"] is None:
                        rec["first"] = now
                    elif s["gaps"]:
                        rec["gaps"].append(now - prev)
                    count, prev = n, now
                last = ev
    rec["end"] = time.perf_counter()
    rec["tokens"] = count
    if rec["error"] is None:
        rec["error"] = _check([json.loads(last[6:])], s) if last else "no events"


async def _post(client: httpx.AsyncClient, s: dict[str, Any], rec: dict[str, Any]) -> None:
    r = await client.post("/generate", content=s["payload"], headers=_JSON)
    rec["end"] = time.perf_counter()
    if r.status_code != 200:
        rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
        return
    data = r.json()
    results = data if isinstance(data, list) else [data]
    rec["tokens"] = sum((x.get("meta_info") or {}).get("completion_tokens", 0) for x in results)
    rec["error"] = _check(results, s)


async def _one(client: httpx.AsyncClient, s: dict[str, Any], start_at: float, timeout: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start_at + s["at"] - time.perf_counter()))
    rec: dict[str, Any] = {"start": time.perf_counter(), "first": None, "end": None, "tokens": 0, "gaps": [],
                           "error": None}
    try:
        await asyncio.wait_for((_stream if s["stream"] else _post)(client, s, rec), timeout)
    except Exception as e:  # a timeout, a refused connection: recorded, the section goes on
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    if rec["end"] is None:
        rec["end"] = time.perf_counter()
    rec["ok"] = rec["error"] is None
    return rec


class _Clients:
    """A process's httpx clients: request i of n goes to client i % ceil(n / PER_CLIENT)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout, self.all = url, timeout, []

    def share(self, n: int) -> list[httpx.AsyncClient]:
        """The clients n concurrent requests are dealt to, made when first needed."""
        k = max(1, -(-n // PER_CLIENT))
        while len(self.all) < k:  # keepalive_expiry under uvicorn's 5 s: never reuse one it is closing
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=3.0)
            self.all.append(httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.timeout, connect=30.0), verify=False,
                                              limits=limits))
        return self.all[:k]

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, job["start_at"] - time.perf_counter()))
        cpu0, reqs = time.process_time(), job["requests"]
        cs = self.share(len(reqs))
        recs = await asyncio.gather(*(_one(cs[i % len(cs)], s, job["start_at"], job["timeout"]) for i, s in enumerate(reqs)))
        return {"records": recs, "cpu_s": time.process_time() - cpu0, "end": time.perf_counter()}

    async def warm(self, n: int) -> int:
        """Open the keep-alive connections n concurrent requests will use (GET /v1/models, which
        does not reach the engine), so a section does not pay for connection setup."""
        cs = self.share(n)
        rs = await asyncio.gather(*(cs[i % len(cs)].get("/v1/models") for i in range(n)), return_exceptions=True)
        return sum(1 for r in rs if isinstance(r, httpx.Response) and r.status_code == 200)

    async def close(self) -> None:
        for c in self.all:
            await c.aclose()


def _worker(conn: Any, url: str, timeout: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us; Ctrl-C is its to handle
    loop = asyncio.new_event_loop()
    clients = _Clients(url, timeout)
    parent, idle = os.getppid(), 0.0
    try:
        while idle < MAX_IDLE_S and os.getppid() == parent:
            if not conn.poll(1.0):
                idle += 1.0
                continue
            idle = 0.0
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            conn.send(loop.run_until_complete(clients.warm(arg) if cmd == "warm" else clients.run(arg)))
    finally:
        loop.run_until_complete(clients.close())
        loop.close()


class ClientPool:
    """`procs` client processes against `url`; `run` sends one section's requests, each process
    its share, and returns one result per process (records, CPU seconds, end time)."""

    def __init__(self, url: str, procs: int, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self._conns, self._procs = [], []
        for i in range(procs):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(there, url, timeout), name=f"bench-client-{i}", daemon=True)
            p.start()
            self._conns.append(here)
            self._procs.append(p)

    @property
    def size(self) -> int:
        return len(self._procs)

    def _ask(self, cmds: list[tuple[str, Any]], wait_s: float) -> list[Any]:
        for conn, cmd in zip(self._conns, cmds, strict=True):
            conn.send(cmd)
        out = []
        for conn, p in zip(self._conns, self._procs, strict=True):
            if not conn.poll(wait_s):
                raise TimeoutError(f"client process {p.name} did not answer within {wait_s:.0f} s")
            out.append(conn.recv())
        return out

    def warm(self, connections: list[int]) -> int:
        return sum(self._ask([("warm", n) for n in connections], 120.0))

    def run(self, shares: list[list[dict[str, Any]]], delay_s: float = 0.3) -> tuple[float, list[dict[str, Any]]]:
        """(the common start, per-process results); the last send offset bounds the wait."""
        start_at = time.perf_counter() + delay_s
        last = max((s["at"] for share in shares for s in share), default=0.0)
        job = [("run", {"start_at": start_at, "requests": share, "timeout": self.timeout}) for share in shares]
        return start_at, self._ask(job, delay_s + last + self.timeout + 60.0)

    def close(self) -> None:
        for conn, p in zip(self._conns, self._procs, strict=True):
            try:
                conn.send(("stop", None))
            except OSError:
                pass
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
