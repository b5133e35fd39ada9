"""`Engine`: the blocking Python API over the engine process, for trainers that want no HTTP."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from engine.client.core_process import (
    POLL_MS,
    CoreProcess,
    refuse_while_bootstrapping,
    reply_result,
)
from engine.client.output import GenerationOutput, RequestState
from engine.config import EngineConfig
from engine.core import calls
from engine.core.protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    ControlReply,
    FromCore,
    StepOutputs,
)
from engine.errors import EngineDeadError, InvalidRequest
from engine.request import SamplingParams
from engine.weights.model_dir import resolve_config

log = logging.getLogger("siesta.client")


class MemoryNotAvailable(RuntimeError):
    """A resume found too little free device memory for some tags; `answer["refused"]` names
    them with the bytes needed and free. The engine is unharmed: resume again later."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(f"not enough free device memory to resume {sorted(answer['refused'])}: {answer['refused']}")
        self.answer = answer

class Engine:
    """Blocking Python API: `Engine(model=DIR_OR_REPO_ID, device="cpu", dtype="float32", **engine_knobs)`.
    A repo id resolves through the Hugging Face cache (engine/weights/model_dir.py); a model that
    is not there raises `ModelNotFound` before any process starts."""

    def __init__(self, model: str | None = None, *, log_level: str = "WARNING", **knobs: Any) -> None:
        refuse_while_bootstrapping()  # a script without `if __name__ == "__main__":`, imported by the engine process
        from transformers import AutoTokenizer

        self.config = resolve_config(EngineConfig(model=model or knobs.pop("model", ""), **knobs))
        self._core = CoreProcess(self.config, log_level=log_level)
        try:  # while the engine process starts
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or self.config.model)
            self._core.wait_ready()
        except BaseException:
            self._core.close()
            self._core = None  # type: ignore[assignment]
            raise
        self.info = self._core.info
        # Whether the engine serves, as of its last control reply (engine/core/availability.py).
        self.state = self._core.state
        self._ids = itertools.count(1)

    # ---- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in input order."""
        prompt_ids = self._prompt_ids(prompts, input_ids)
        params = self._params(sampling_params, len(prompt_ids))
        states: dict[str, RequestState] = {}
        adds = []
        for ids, sp in zip(prompt_ids, params, strict=True):
            rid = f"gen-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            states[rid] = RequestState(rid, ids, sp, self.tokenizer, incremental=bool(sp.stop),  # text once, at the end
                                       routes_dtype=self.config.routed_experts_dtype)
            adds.append(AddRequest(request_id=rid, prompt_token_ids=ids, sampling_params=sp))
        if adds:
            self._core.send(AddRequests(requests=adds))  # one message: added whole before the next step
        pending = set(states)
        try:
            while pending:
                msg = self._recv()
                if not isinstance(msg, StepOutputs):
                    continue
                for delta in msg.deltas:
                    state = states.get(delta.request_id)
                    if state is None or delta.request_id not in pending:
                        continue
                    update = state.apply(delta)
                    if update.abort:
                        self._core.send(AbortRequests(request_ids=[delta.request_id]))
                    if update.finished:
                        pending.discard(delta.request_id)
        except BaseException:
            if self._core.dead is None and pending:
                self._core.send(AbortRequests(request_ids=list(pending)))
            raise
        return [s.output for s in states.values()]

    def _prompt_ids(self, prompts: Any, input_ids: Any) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of prompts (text) and input_ids")
        if input_ids is not None:
            if len(input_ids) > 0 and isinstance(input_ids[0], int):
                input_ids = [input_ids]
            return [[int(t) for t in ids] for ids in input_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]

    @staticmethod
    def _params(sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise InvalidRequest(f"{len(sp)} sampling_params for {n} prompts")
        return list(sp)

    def _recv(self) -> FromCore:
        while True:
            msg = self._core.recv(timeout_ms=POLL_MS)
            if self._core.dead is not None:
                raise EngineDeadError(self._core.dead)
            if msg is not None:
                return msg

    # ---- control --------------------------------------------------------------------------------

    def call(self, call: calls.Call) -> Any:
        """Run a control call between steps; its result (`call.reply`); a failure raises the
        engine's error type for it (engine/errors.py): `InvalidRequest` for a refused call."""
        try:  # the engine decodes by the field types: check them here, where the caller sees it
            call = msgspec.convert(msgspec.structs.asdict(call) | {"call_id": next(self._ids)}, type(call))
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"{type(call).__name__}: {e}") from None
        self._core.send(call)
        while True:
            msg = self._recv()
            if isinstance(msg, ControlReply) and msg.call_id == call.call_id:
                self.state = msg.state
                return reply_result(msg, call.reply)

    def _answer(self, call: calls.Call) -> Any:
        """A call's result as JSON-like builtins, as the HTTP routes answer it."""
        return msgspec.to_builtins(self.call(call))

    def flush_cache(self) -> bool:
        return self.call(calls.FlushCache())

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return self._answer(calls.PauseGeneration(mode=mode))

    def continue_generation(self) -> dict[str, Any]:
        return self._answer(calls.ContinueGeneration())

    def release_memory_occupation(self, tags: list[str] | None = None, mode: str = "wait") -> dict[str, Any]:
        """Hand the GPU memory of `tags` (None: all) back to the driver; see engine/memory/regions.py."""
        return self._answer(calls.ReleaseMemory(tags=tags, mode=mode))

    def resume_memory_occupation(self, tags: list[str] | None = None, wait_for_memory_s: float = 0.0) -> dict[str, Any]:
        """Map `tags` (None: all) back. Raises `MemoryNotAvailable` (its `answer` says per tag the
        bytes needed and free) when the device had no room for some: those stay released, the
        others resumed, and a later call succeeds once the memory is free."""
        answer = self._answer(calls.ResumeMemory(tags=tags, wait_for_memory_s=wait_for_memory_s))
        if answer["refused"]:
            raise MemoryNotAvailable(answer)
        return answer

    def memory_occupation(self) -> dict[str, Any]:
        return self.call(calls.GetMemoryOccupation())

    # RL weight updates (engine/weights/updater.py); each answers {"success", "message",
    # "weight_version", "seconds", ...} and raises on a bad update, leaving the old weights in use.
    # Keyword arguments are the fields of the call (engine/core/calls.py).

    def update_weights_from_disk(self, model_path: str, **kwargs: Any) -> dict[str, Any]:
        return self._answer(calls.UpdateWeightsFromDisk(model_path=model_path, **kwargs))

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], **kwargs: Any) -> dict[str, Any]:
        return self._answer(calls.UpdateWeightsFromTensor(serialized_named_tensors=serialized_named_tensors, **kwargs))

    def init_weights_update_group(self, **kwargs: Any) -> dict[str, Any]:
        return self._answer(calls.InitWeightsUpdateGroup(**kwargs))

    def update_weights_from_distributed(self, **kwargs: Any) -> dict[str, Any]:
        return self._answer(calls.UpdateWeightsFromDistributed(**kwargs))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return self._answer(calls.DestroyWeightsUpdateGroup(group_name=group_name))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        return self._answer(calls.UpdateWeightVersion(new_version=new_version, abort_all_requests=abort_all_requests))

    def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        """SGLang's weights checker (engine/core/checks.py): snapshot, reset_tensors, compare, checksum."""
        return self.call(calls.CheckWeights(action=action))

    def get_server_info(self) -> dict[str, Any]:
        return self.call(calls.GetInfo())

    # ---- lifetime -------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The engine process's (named `siesta::engine`)."""
        return self._core.pid if self._core is not None else None

    def shutdown(self) -> None:
        if getattr(self, "_core", None) is not None:
            self._core.close()
            self._core = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
