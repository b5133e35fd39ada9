"""The worker process of one tensor-parallel rank above 0: join the group, build this rank's
`Rank` (in step with the others), say `RankReady`, then do what rank 0 sends (engine/core/ranks.py)
until it says stop or is gone.

Rules: a failed step is the engine's death (this process exits and rank 0's watchdog reports it);
a failed control message is answered with its error and the rank goes on. A watchdog thread ends
the process when rank 0 is gone, even while it is blocked in a collective.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback

import msgspec

from engine.config import EngineConfig, ModelConfig, context_length
from engine.core import rank_protocol as rp
from engine.core.process_title import set_process_title
from engine.core.protocol import ControlError, connect_pipes
from engine.core.rank import Rank
from engine.errors import error_kind
from engine.parallel import TensorParallel

log = logging.getLogger("siesta.engine")

# How often the watchdog looks whether rank 0 is still there, seconds.
_PARENT_POLL_S = 0.5


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def run_worker(
    config: EngineConfig, rank: int, size: int, init_method: str, in_addr: str, out_addr: str, log_level: str
) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    ctx, inbox, outbox = connect_pipes(in_addr, out_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(rp.ToRank)
    tp = TensorParallel(rank, size)
    try:
        model_config = ModelConfig.from_hf(config.model)
        me = Rank(config, model_config, context_length(config, model_config), tp, init_method)
    except Exception as e:
        log.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        outbox.send(encoder.encode(rp.RankFailed(rank=rank, error=f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from None
    outbox.send(encoder.encode(rp.RankReady(rank=rank)))
    gc.collect()
    gc.freeze()
    try:
        while True:
            msg = decoder.decode(inbox.recv())
            if isinstance(msg, rp.StopRank):
                return
            if isinstance(msg, (rp.RunStep, rp.AfterReply)):
                me.handle(msg)  # a failure here is fatal: the ranks are no longer in step
                continue
            try:
                reply = rp.RankReply(rank=rank, result=me.handle(msg))
            except Exception as e:
                if not isinstance(e, (ValueError, TypeError, LookupError, TimeoutError, PermissionError)):
                    log.error("rank %d: %s failed:\n%s", rank, type(msg).__name__, traceback.format_exc())
                reply = rp.RankReply(rank=rank, error=ControlError(kind=error_kind(e), message=f"{type(e).__name__}: {e}"))
            outbox.send(encoder.encode(reply))
    except Exception:
        log.error("rank %d died:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        inbox.close()
        outbox.close()
        ctx.term()


if __name__ == "__main__":  # started by engine/core/ranks.py: rank size init_method in out log_level config
    _rank, _size, _init, _in, _out, _level, _config = sys.argv[1:8]
    set_process_title(f"siesta::tp{_rank}")
    run_worker(msgspec.json.decode(_config, type=EngineConfig), int(_rank), int(_size), _init, _in, _out, _level)
