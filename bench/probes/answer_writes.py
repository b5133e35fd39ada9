"""What the server pays to build and send a large non-streamed answer: bench_serving's 30B-A3B RL
batch with routed experts (256 answers, each 511 positions x 48 layers x 8 int32 ids, base64-encoded
as the rows arrive in `engine.client.output.Base64Stream`: ~1.05 MB an answer, ~270 MB in all;
`--item-bytes 1`: uint8 ids, `--routed-experts-dtype uint8`, a quarter of that).

Three ways, each building the 256 answers' JSON at request time from the same streams and a small
meta_info, then sending them from uvicorn in its own process (this interpreter):
- `joined`: each answer encoded whole (its base64 joined, quoted, embedded as msgspec.Raw), the
  array joined, one `Response` write (the server before 75739fb);
- `parts`: the same answers, sent by `server.json_parts.JsonParts` one answer a piece (75739fb);
- `pieces`: each answer's other fields encoded, then its base64 in the pieces it was made in, sent
  by `JsonParts` in 1 MiB writes (what `/generate` does now).

The reader is a raw socket with a 1 MiB buffer, so the time is the server's building and writing
and the kernel's copy, not a client's parsing. Rounds alternate the three, then read `pieces`
with bench_serving's client (an httpx.AsyncClient `post`: `httpx read`), and time its `json()`
apart (`json parse`, which bench_serving's clock leaves out): the client's share of the tail.

    python3 bench/probes/answer_writes.py --out /tmp/writes.json
    python3 bench/probes/answer_writes.py --item-bytes 1 --out /tmp/writes8.json
    python3 bench/probes/answer_writes.py --answers 8 --positions 20 --rounds 2 --out /tmp/w.json   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import free_port, say, write_json  # noqa: E402

WAYS = ("joined", "parts", "pieces")
ROW_IDS = 48 * 8  # one position's routes at the 30B-A3B shape: layers x top-k

SERVER = """
import os, sys, msgspec, uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from engine.client.output import Base64Stream
from server.json_parts import JsonParts
n, positions, row = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
encode = msgspec.json.Encoder().encode
streams = []
for _ in range(n):
    s = Base64Stream()
    for _ in range(positions):
        s.add(os.urandom(row))
    streams.append(s)
def result(i, routes=None):
    meta = {"id": f"r{i}", "finish_reason": {"type": "length"}, "completion_tokens": positions,
            "output_token_logprobs": [(-0.5, 7, None)] * 256}
    if routes is not None:
        meta["routed_experts"] = routes
    return {"text": "x" * 1000, "output_ids": list(range(256)), "meta_info": meta}
def whole():
    return [encode(result(i, msgspec.Raw(b'"' + s.value() + b'"'))) for i, s in enumerate(streams)]
app = FastAPI()
app.post("/joined")(lambda: Response(b"[" + b",".join(whole()) + b"]", media_type="application/json"))
app.post("/parts")(lambda: JsonParts([[a] for a in whole()], array=True))
app.post("/pieces")(lambda: JsonParts([[encode(result(i))[:-2], b',"routed_experts":"', *s.pieces(), b'"}}']
                                       for i, s in enumerate(streams)], array=True))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _fetch(port: int, path: str) -> tuple[float, int]:
    """(seconds from sending the request to the body's last byte, the body's length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        buf, got = bytearray(1 << 20), b""
        t0 = time.perf_counter()
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".encode())
        while b"\r\n\r\n" not in got:  # headers (and the body's first bytes)
            more = s.recv(1 << 16)
            if not more:
                raise RuntimeError(f"{path}: the connection closed before the headers")
            got += more
        head, _, seen = got.partition(b"\r\n\r\n")
        length = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")).split(b":")[1])
        n = len(seen)
        while n < length:
            k = s.recv_into(buf)
            if not k:
                raise RuntimeError(f"{path}: the connection closed after {n} of {length} bytes")
            n += k
        return time.perf_counter() - t0, length


async def _httpx_reads(port: int, rounds: int) -> tuple[list[float], list[float]]:
    """bench_serving's client on /pieces: (seconds to the body's last byte, seconds of its json())."""
    import httpx

    read, parse = [], []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = await client.post("/pieces", content=b"")
            read.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert len(r.json()) > 0
            parse.append(time.perf_counter() - t0)
    return read, parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=int, default=256)
    ap.add_argument("--positions", type=int, default=511, help="prompt + output - 1 positions an answer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--item-bytes", type=int, default=4, choices=(4, 2, 1),
                    help="bytes an expert id: int32 4, uint16 2, uint8 1 (the server's --routed-experts-dtype)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    port = free_port()
    paths = [os.path.dirname(BENCH), os.environ.get("PYTHONPATH", "")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    argv = [sys.executable, "-c", SERVER, str(port), str(args.answers), str(args.positions), str(ROW_IDS * args.item_bytes)]
    proc = subprocess.Popen(argv, env=env)
    try:
        for _ in range(1200):  # bounded: 120 s for the server to build its streams and listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        lengths = set()
        for r in range(args.rounds):
            for way in WAYS:
                seconds, length = _fetch(port, f"/{way}")
                times[way].append(seconds)
                lengths.add(length)
            say(f"round {r}: " + ", ".join(f"{w} {times[w][-1]:.3f} s" for w in WAYS))
        times["httpx read"], times["json parse"] = asyncio.run(_httpx_reads(port, args.rounds))
    finally:
        proc.kill()
    assert len(lengths) == 1, f"the three ways gave bodies of different lengths: {lengths}"
    med = {w: statistics.median(v) for w, v in times.items()}
    say(f"{lengths.pop() / 1e6:.1f} MB, Python {sys.version.split()[0]}: median " + ", ".join(f"{w} {med[w]:.3f} s" for w in WAYS)
        + f"; pieces / joined {med['pieces'] / med['joined']:.3f}; pieces read by httpx {med['httpx read']:.3f} s, "
        f"its json() {med['json parse']:.3f} s")
    write_json(args.out, {"python": sys.version, "answers": args.answers, "positions": args.positions, "item_bytes": args.item_bytes,
                          "seconds": times, "median": med})


if __name__ == "__main__":
    main()
