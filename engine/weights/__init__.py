"""Weights: loading a checkpoint and every kind of update. Runs in the ENGINE process (the
trainer-side helpers of `payload.py` and `groups.py` run in the trainer's).

- `loader.py`: checkpoint and named tensors into the built model, in place, all or nothing.
- `targets.py`: `Target`, where each checkpoint name lands (packed parameters and experts, aliases).
- `store.py`: `WeightStore`, every parameter a view into one allocation of the `weights` region,
  in Hugging Face's parameter order; which pieces are stale after a release; when the host copy
  is kept, dropped (a level-2 release) and made again.
- `host_copy.py`: `HostCopy`, the host copy's memory and its device <-> host copies.
- `updater.py`: `WeightUpdater`, the three RL updates (from disk, from tensors, from a process group).
- `group_updates.py`: `GroupUpdates`, the process-group route of `WeightUpdater`: per tensor (in
  place, or a TP rank's slices through two scratch slots) or one flattened bucket.
- `checker.py`: `WeightChecker`, one rank's part of `/weights_checker` (snapshot, reset, compare, checksum).
- `payload.py`: the wire format of `update_weights_from_tensor` (CUDA IPC / shared memory pickles).
- `unpickler.py`: `PayloadUnpickler`, which reads those pickles with an allow list.
- `groups.py`: weight-update process groups (`init_weights_update_group`, NCCL or gloo broadcasts).
- `vllm_nccl.py`: the receiving side of vLLM's NCCL weight transfer (its store rendezvous, its
  pickled NCCL unique id, its communicator), a backend of `groups.py`.
- `nccl_lib.py`: the NCCL calls that communicator makes, through ctypes on torch's libnccl.
- `model_dir.py`: where `--model` points (a checkpoint directory or a Hugging Face repo id in the
  Hub cache); it runs in the process that starts the engine, before the engine process exists.

Arrows: weights -> memory, kernels.host_copy, models.
"""
