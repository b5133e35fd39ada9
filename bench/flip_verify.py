"""bench_flip.py's proof that the server took the pushed weights, from `/weights_checker`
checksums (a hash of every tensor of the server's model, on every tensor-parallel rank): the loaded weights first; after a flip,
every tensor must differ from the last checksum (each flip pushes new random values); at the end
the checkpoint's own tensors are pushed back and the checksum must equal the loaded one bit for
bit. A checkpoint without weights (load_format dummy) has none to push back: every tensor is
refilled at random (`reset_tensors`), the last flip's tensors are made again (its seed) and pushed,
and the checksum must equal the one the last flip left. Costs a device-to-host copy and a hash of the model per checksum (tens of seconds at 8B)."""

from __future__ import annotations

import time
from typing import Any

from bench_runtime import say
from flip_http import Http
from flip_trainer import checkpoint_weights, free, new_weights


class Verify:
    """`/weights_checker` checksums: the loaded weights, after flips (every tensor changed), and
    after pushing the checkpoint back (equal to the loaded ones)."""

    def __init__(self, res: dict[str, Any], http: Http) -> None:
        self.out, self.http = res["verify"], http
        self.prev: dict[str, str] | None = None
        self.prev_total: str | None = None

    def checksum(self) -> tuple[dict[str, str], str, float]:
        """Every rank's tensors (`rank:name` at tp_size > 1), the engine's checksum, seconds."""
        t = time.perf_counter()
        answer, _ = self.http.post("/weights_checker", {"action": "checksum"})
        ranks = answer["ranks"]
        self.out["ranks"] = len(ranks)
        sums = {
            (f"{i}:{name}" if len(ranks) > 1 else name): value
            for i, r in enumerate(ranks)
            for name, value in r["checksums"].items()
        }
        return sums, answer["per_engine_checksum"], time.perf_counter() - t

    def initial(self) -> None:
        self.prev, total, seconds = self.checksum()
        self.out |= {
            "initial_checksum": total,
            "tensors": len(self.prev),
            "checksum_s": seconds,
            "flips_checked": 0,
            "all_changed": True,
        }
        say(f"verify: {len(self.prev)} tensors, checksum {total[:16]} ({seconds:.1f} s)")

    def after_flip(self, f: dict[str, Any]) -> None:
        if self.prev is None:
            return
        sums, total, seconds = self.checksum()
        self.prev_total = total
        changed = [k for k, v in sums.items() if self.prev.get(k) != v]
        f["verify"] = {
            "changed": len(changed),
            "tensors": len(sums),
            "all_changed": len(changed) == len(sums),
            "unchanged": sorted(set(sums) - set(changed))[:20],
            "checksum_s": seconds,
        }
        self.out["flips_checked"] += 1
        self.out["all_changed"] = self.out["all_changed"] and f["verify"]["all_changed"]
        self.prev = sums

    def restore(self, path: str, device: Any, flips: list[dict[str, Any]], others: list[Any] = ()) -> None:
        """Push the checkpoint back (one payload per tensor-parallel rank: `others` are the GPUs
        of ranks 1..) and compare the checksum with the loaded one."""
        self.out["restore_of"] = "the checkpoint"
        self._push_back(lambda d: checkpoint_weights(path, d), device, flips, others, self.out.get("initial_checksum"))

    def repush(self, specs: list[Any], device: Any, flips: list[dict[str, Any]], others: list[Any] = ()) -> None:
        """A checkpoint without weights: the checksum the last flip left (taken now if that flip
        was not checked), every tensor refilled at random, the last flip's tensors made again
        from its seed and pushed; the checksum must equal the one before the refill, which must
        have changed every tensor."""
        if not flips:
            raise RuntimeError("no flip to push again")
        before, want = (self.prev, self.prev_total) if "verify" in flips[-1] else self.checksum()[:2]
        self.http.post("/weights_checker", {"action": "reset_tensors"})
        reset = self.checksum()[0]
        self.out["restore_of"] = f"the last flip's tensors (seed {flips[-1]['seed']})"
        self.out["reset_changed_all"] = all(reset.get(k) != v for k, v in before.items())
        self.out["all_changed"] = self.out["all_changed"] and self.out["reset_changed_all"]
        self._push_back(lambda d: new_weights(specs, d, flips[-1]["seed"]), device, flips, others, want)

    def _push_back(self, make: Any, device: Any, flips: list[dict[str, Any]], others: list[Any], want: str | None) -> None:
        """Push `make(device)`'s tensors (tensor mode) and compare the checksum with `want`."""
        from engine.weights.payload import serialize_named_tensors

        # kv_cache released meanwhile, as in a flip: the trainer's copy fits beside the server.
        self.http.post("/release_memory_occupation", {"tags": ["kv_cache"]})
        try:
            pairs = [make(d) for d in [device, *others]]
            payload = [serialize_named_tensors(p) for p in pairs]
            body = {
                "serialized_named_tensors": payload,
                "load_format": None,
                "weight_version": "restored",
            }
            answer, wall = self.http.post("/update_weights_from_tensor", body)
            del pairs, body, payload
            for d in [device, *others]:
                free(d)
        finally:
            self.http.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
        _, total, _ = self.checksum()
        self.out |= {
            "restore_push_wall_s": wall,
            "restore_answer": answer,
            "restored_checksum": total,
            "restored_exactly": total == want,
            "versions_ok": bool(flips) and all(f["version_ok"] for f in flips),
        }
        self.out["pushed_weights_taken"] = bool(
            self.out["flips_checked"]
            and self.out["all_changed"]
            and self.out["restored_exactly"]
            and self.out["versions_ok"]
        )
        say(
            f"verify: {self.out['restore_of']} pushed back -> checksum {'equals' if total == want else 'DIFFERS from'} "
            f"the one they left; {self.out['flips_checked']} flips checked, every tensor changed: {self.out['all_changed']}; "
            f"pushed_weights_taken {self.out['pushed_weights_taken']}"
        )
