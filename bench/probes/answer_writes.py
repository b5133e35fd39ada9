"""How fast a large non-streamed answer crosses loopback from uvicorn: the body written whole in
one `Response`, against `server.json_parts.JsonParts` (the same bytes as its parts, at most 1 MiB a
write). The default body is the routed-experts batch of bench_serving's 30B-A3B RL shape: 256
answers of 1.05 MB of base64 each (~270 MB).

A uvicorn server in its own process (this interpreter) serves both; the reader is a raw socket
with a 1 MiB buffer, so the time is the server's writing and the kernel's copy, not a client's
parsing. Rounds alternate the two.

    python3 bench/probes/answer_writes.py --out /tmp/writes.json
    python3 bench/probes/answer_writes.py --answers 8 --answer-bytes 100000 --rounds 2 --out /tmp/w.json   # smoke
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import free_port, say, write_json  # noqa: E402

SERVER = """
import sys, uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from server.json_parts import JsonParts
n, size = int(sys.argv[2]), int(sys.argv[3])
parts = [b'{"meta_info":{"routed_experts":"' + bytes([65 + i % 26]) * size + b'"}}' for i in range(n)]
whole = b"[" + b",".join(parts) + b"]"
app = FastAPI()
app.post("/whole")(lambda: Response(whole, media_type="application/json"))
app.post("/parts")(lambda: JsonParts(parts, array=True))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _fetch(port: int, path: str, length: int) -> float:
    """Seconds from sending the request to the last byte of a `length`-byte body."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        buf, got = bytearray(1 << 20), b""
        t0 = time.perf_counter()
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".encode())
        while b"\r\n\r\n" not in got:  # headers (and the body's first bytes)
            got += s.recv(1 << 16)
        head, _, seen = got.partition(b"\r\n\r\n")
        assert b"content-length: %d" % length in head.lower(), head
        n = len(seen)
        while n < length:
            k = s.recv_into(buf)
            if not k:
                raise RuntimeError(f"{path}: the connection closed after {n} of {length} bytes")
            n += k
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=int, default=256)
    ap.add_argument("--answer-bytes", type=int, default=1_048_000, help="base64 characters an answer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    port = free_port()
    env = os.environ | {"PYTHONPATH": os.path.dirname(BENCH)}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.answers), str(args.answer_bytes)], env=env)
    try:
        for _ in range(600):  # bounded: 60 s for the server to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        length = args.answers * (len(b'{"meta_info":{"routed_experts":""}}') + args.answer_bytes) + args.answers + 1
        times: dict[str, list[float]] = {"whole": [], "parts": []}
        for r in range(args.rounds):
            for path in times:
                times[path].append(_fetch(port, f"/{path}", length))
            say(f"round {r}: whole {times['whole'][-1]:.3f} s, parts {times['parts'][-1]:.3f} s")
    finally:
        proc.kill()
    med = {k: statistics.median(v) for k, v in times.items()}
    say(f"{length / 1e6:.1f} MB, Python {sys.version.split()[0]}: median whole {med['whole']:.3f} s, "
        f"parts {med['parts']:.3f} s, parts / whole {med['parts'] / med['whole']:.3f}")
    write_json(args.out, {"bytes": length, "python": sys.version, "seconds": times, "median": med})


if __name__ == "__main__":
    main()
