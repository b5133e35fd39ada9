"""The wire format of `update_weights_from_tensor`, as SGLang's HTTP API and its RL clients (verl,
slime) send it.

Rules:
- `serialized_named_tensors` holds one payload per tensor-parallel rank (or one that every rank
  reads); each holds full tensors, which every rank slices; a payload is the base64
  (utf-8 str) of a `multiprocessing.reduction.ForkingPickler` pickle. Tensors in it travel by
  reference: CUDA tensors as CUDA IPC handles, CPU tensors as shared memory. Nothing is copied
  until the engine copies the tensors into its parameters (engine.weights.loader.load_named_tensors).
- load_format None or "direct": the payload is a list of (name, tensor). A tensor may be an SGLang
  `LocalSerializedTensor` (verl does this): `values[tp_rank]` is itself a raw ForkingPickler
  pickle of this rank's tensor.
- load_format "flattened_bucket" (slime): the payload is SGLang's
  `{"flattened_tensor": Tensor, "metadata": [FlattenedTensorMetadata]}`
  (sglang/srt/weight_sync/tensor_bucket.py). Current SGLang flattens every tensor to uint8 bytes,
  so one bucket holds mixed dtypes and start_idx/end_idx are byte offsets; older SGLang
  concatenated tensors of one dtype (slime then sent one bucket per dtype) and the offsets count
  elements. Both are read.
- load_format "vllm_ipc" (vLLM's CUDA-IPC weight transfer, its `update_info` over HTTP): the
  payload is a pickle of {"names": [...], "ipc_handles": bytes}, where the bytes are vLLM's
  `ipc_handles_pickled` decoded from base64: per tensor a {GPU UUID: (rebuild_cuda_tensor, args)}
  dict. Each rank rebuilds the tensor its own GPU's UUID names, on its own device
  (vllm/distributed/weight_transfer/ipc_engine.py, `receive_weights`).
- CPU tensors are shared through torch's `file_system` strategy by default: a named shared-memory
  segment that any process of the same user can open. torch's Linux default, `file_descriptor`,
  passes descriptors through the sender's resource-sharer thread and authenticates with the
  multiprocessing authkey, which only processes of one multiprocessing family share; it does not
  work between a trainer and an engine started separately. Either way the sender must keep its
  tensors alive until the engine has answered the request.
- CUDA tensors pickled after SGLang's `monkey_patch_torch_reductions` name their device by UUID
  through `sglang...._rebuild_cuda_tensor_modified`; that global is mapped to a local rebuild.

SECURITY: unpickling untrusted bytes can execute code. The unpickler (unpickler.py) only resolves
an allow list of torch rebuild functions and the SGLang classes above, which blocks the usual
gadgets but is no sandbox: a payload can still make the engine open shared memory or CUDA handles
it names. The HTTP route that feeds this module must only be reachable by the trainer (an admin
key: a later issue), as in SGLang.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp  # registers torch's tensor reductions with ForkingPickler
from torch.multiprocessing import reductions

from engine.weights.loader import WeightLoadError
from engine.weights.unpickler import PayloadUnpickler, rebuild_cuda_tensor_by_uuid

LOAD_FORMATS: tuple[str | None, ...] = (None, "direct", "flattened_bucket", "vllm_ipc")
BUCKET_ALIGN = 16  # bytes; each tensor of a bucket we build starts on this boundary

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightPayloadError(WeightLoadError):
    """A `serialized_named_tensors` payload that cannot be decoded; the message says why."""


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket; the fields and their meaning are SGLang's."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int  # offset into the flat tensor, in its elements (bytes when it is uint8)
    end_idx: int
    numel: int  # end_idx - start_idx


@dataclass
class LocalSerializedTensor:
    """SGLang's per-rank tensor wrapper: values[rank] is a raw ForkingPickler pickle of a tensor."""

    values: list[bytes]


# ---- serializing (the trainer side) --------------------------------------------------------

_SHARING_LOCK = threading.Lock()


def serialize_payload(obj: Any, cpu_sharing: str = "file_system") -> str:
    """base64 of a ForkingPickler pickle of `obj`. CPU tensors move into shared memory in place
    (torch's `share_memory_()`), shared by `cpu_sharing` ("file_system" or "file_descriptor");
    torch's process-wide sharing strategy is switched for the dump only."""
    if cpu_sharing not in torch_mp.get_all_sharing_strategies():
        raise ValueError(f"unknown sharing strategy {cpu_sharing!r}")
    buf = io.BytesIO()
    with _SHARING_LOCK:
        previous = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy(cpu_sharing)
        try:
            ForkingPickler(buf).dump(obj)
        finally:
            torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def serialize_named_tensors(pairs: list[tuple[str, torch.Tensor]], cpu_sharing: str = "file_system") -> str:
    """One payload of `serialized_named_tensors` for load_format None or "direct"."""
    return serialize_payload(_as_pairs(list(pairs), "pairs"), cpu_sharing)


def flatten_bucket(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's flattened bucket of `pairs`: one 1-D uint8 tensor on the tensors' device holding
    every tensor's bytes (mixed dtypes allowed), and byte offsets. Each tensor starts on a
    BUCKET_ALIGN boundary (SGLang packs them back to back; its reader only uses the offsets)."""
    pairs = _as_pairs(list(pairs), "pairs")
    if not pairs:
        raise ValueError("cannot build an empty bucket")
    device = pairs[0][1].device
    metadata: list[FlattenedTensorMetadata] = []
    offset = 0
    for name, tensor in pairs:
        if tensor.device != device:
            raise ValueError(f"bucket mixes devices: {name!r} is on {tensor.device}, not {device}")
        start = -(-offset // BUCKET_ALIGN) * BUCKET_ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, start + nbytes, nbytes))
        offset = start + nbytes
    flat = torch.zeros(offset, dtype=torch.uint8, device=device)
    for (_, tensor), meta in zip(pairs, metadata, strict=True):
        flat[meta.start_idx : meta.end_idx].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    return {"flattened_tensor": flat, "metadata": metadata}


# ---- deserializing (the engine side) -------------------------------------------------------


# Classes that SGLang pickles under its own module paths (which moved between releases).
_SGLANG_NAMES: dict[str, Any] = {
    "FlattenedTensorMetadata": FlattenedTensorMetadata,
    "LocalSerializedTensor": LocalSerializedTensor,
    "_rebuild_cuda_tensor_modified": rebuild_cuda_tensor_by_uuid,
}
_SGLANG_MODULES = (__name__, "sglang.")


def deserialize_payload(payload: str | bytes, again: bool = False) -> Any:
    """The object of one payload: base64 str (or raw pickle bytes) -> unpickled object. `again`:
    another process reads the same payload first (a tensor-parallel rank after rank 0)."""
    if isinstance(payload, str):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise WeightPayloadError(f"payload is not valid base64: {e}") from e
    elif isinstance(payload, (bytes, bytearray)):
        data = bytes(payload)
    else:
        raise WeightPayloadError(f"payload must be a base64 string, got {type(payload).__name__}")
    try:
        return PayloadUnpickler(io.BytesIO(data), _SGLANG_NAMES, _SGLANG_MODULES, again).load()
    except Exception as e:  # any failure of an untrusted pickle is a bad payload
        raise WeightPayloadError(f"payload is not a readable tensor pickle: {type(e).__name__}: {e}") from e


def _as_pairs(obj: Any, what: str, tp_rank: int = 0) -> NamedTensors:
    """Check `obj` is a list of (str, Tensor | LocalSerializedTensor); unwrap the latter."""
    if not isinstance(obj, (list, tuple)):
        raise WeightPayloadError(f"{what} must be a list of (name, tensor), got {type(obj).__name__}")
    pairs: NamedTensors = []
    for i, item in enumerate(obj):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightPayloadError(f"{what}[{i}] must be a (name, tensor) pair")
        name, tensor = item
        if isinstance(tensor, LocalSerializedTensor):
            values = tensor.values
            if not isinstance(values, (list, tuple)) or not 0 <= tp_rank < len(values):
                raise WeightPayloadError(f"tensor {name!r} has no value for tp rank {tp_rank}")
            tensor = deserialize_payload(values[tp_rank])
        if not isinstance(tensor, torch.Tensor):
            raise WeightPayloadError(f"{what}[{i}] ({name!r}) is a {type(tensor).__name__}, not a tensor")
        pairs.append((name, tensor))
    return pairs


def deserialize_named_tensors(payload: str, tp_rank: int = 0) -> NamedTensors:
    """The (name, tensor) pairs of one load_format None / "direct" payload."""
    return _as_pairs(deserialize_payload(payload), "payload", tp_rank)


def _field(meta: Any, key: str) -> Any:
    return meta[key] if isinstance(meta, dict) else getattr(meta, key)


def unflatten_bucket(obj: Any) -> NamedTensors:
    """The (name, tensor) pairs of a flattened bucket: views into its flat tensor, reshaped, in
    their own dtypes. A flat tensor of the tensor's dtype is sliced in elements; a uint8 one in
    bytes and reinterpreted (copied first when the offset is misaligned for the dtype); another
    dtype (old SGLang's promoted concat) is sliced in elements and cast."""
    if not (isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor)
            and isinstance(obj.get("metadata"), (list, tuple))):
        raise WeightPayloadError("a flattened bucket must be {'flattened_tensor': Tensor, 'metadata': [...]}")
    flat: torch.Tensor = obj["flattened_tensor"]
    if flat.dim() != 1:
        raise WeightPayloadError(f"flattened_tensor must be 1-D, got shape {list(flat.shape)}")
    pairs: NamedTensors = []
    for i, meta in enumerate(obj["metadata"]):
        try:
            name, shape, dtype = _field(meta, "name"), torch.Size(_field(meta, "shape")), _field(meta, "dtype")
            start, end = int(_field(meta, "start_idx")), int(_field(meta, "end_idx"))
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise WeightPayloadError(f"bucket metadata[{i}] is malformed: {e}") from e
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise WeightPayloadError(f"bucket metadata[{i}] needs a str name and a torch.dtype")
        byte_format = flat.dtype == torch.uint8 and dtype != torch.uint8
        width = dtype.itemsize if byte_format else 1
        if not 0 <= start <= end <= flat.numel() or end - start != shape.numel() * width:
            raise WeightPayloadError(
                f"bucket tensor {name!r}: [{start}, {end}) does not fit shape {list(shape)} of {dtype} "
                f"in a flat tensor of {flat.numel()} {flat.dtype} elements"
            )
        piece = flat[start:end]
        if byte_format:
            if (flat.storage_offset() + start) % dtype.itemsize:
                piece = piece.clone()
            piece = piece.view(dtype)
        elif flat.dtype != dtype:
            piece = piece.to(dtype)
        pairs.append((name, piece.reshape(shape)))
    return pairs


def decode_update(serialized_named_tensors: list[str], load_format: str | None, tp_rank: int = 0) -> NamedTensors:
    """The (name, tensor) pairs that `update_weights_from_tensor` carries for `tp_rank`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: null, 'direct', 'flattened_bucket', 'vllm_ipc'")
    payloads = serialized_named_tensors
    if not isinstance(payloads, (list, tuple)) or not payloads or (len(payloads) > 1 and not 0 <= tp_rank < len(payloads)):
        raise WeightPayloadError(
            f"serialized_named_tensors must be a list with one payload per tp rank, or one for all (need rank {tp_rank})"
        )
    # One payload serves every rank; each rank keeps its slice of the full tensors in it.
    shared = len(payloads) == 1
    obj = deserialize_payload(payloads[0 if shared else tp_rank], again=shared and tp_rank > 0)
    if load_format == "flattened_bucket":
        return unflatten_bucket(obj)
    if load_format == "vllm_ipc":
        return _vllm_ipc_pairs(obj)
    return _as_pairs(obj, "payload", tp_rank)


def vllm_ipc_payload(names: list[str], ipc_handles_pickled: str) -> str:
    """The one payload of a "vllm_ipc" update (what the HTTP route builds from vLLM's update_info)."""
    try:
        handles = base64.b64decode(ipc_handles_pickled, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WeightPayloadError(f"ipc_handles_pickled is not valid base64: {e}") from e
    return base64.b64encode(pickle.dumps({"names": list(names), "ipc_handles": handles})).decode()


def _vllm_ipc_pairs(obj: Any) -> NamedTensors:
    if not isinstance(obj, dict) or not isinstance(obj.get("names"), list) or not isinstance(obj.get("ipc_handles"), bytes):
        raise WeightPayloadError("a vllm_ipc payload is {'names': [...], 'ipc_handles': bytes}")
    handles = deserialize_payload(obj["ipc_handles"])
    names = obj["names"]
    if not isinstance(handles, list) or len(handles) != len(names):
        raise WeightPayloadError(f"ipc_handles must be a list of one handle per name ({len(names)} names)")
    if not torch.cuda.is_available():
        raise WeightPayloadError("CUDA-IPC handles need a CUDA device")
    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    pairs: NamedTensors = []
    for name, handle in zip(names, handles, strict=True):
        if not isinstance(handle, dict) or uuid not in handle:
            seen = list(handle) if isinstance(handle, dict) else type(handle).__name__
            raise WeightPayloadError(f"{name}: no IPC handle for this GPU (UUID {uuid}); the handle names {seen}")
        func, args = handle[uuid]
        if func is not reductions.rebuild_cuda_tensor or not isinstance(args, tuple) or len(args) < 7:
            raise WeightPayloadError(f"{name}: an IPC handle must be (rebuild_cuda_tensor, args)")
        args = list(args)
        args[6] = device  # the sender's device index means nothing here
        pairs.append((name, func(*args)))
    return pairs
