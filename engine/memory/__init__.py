"""GPU memory the engine can give back, and the KV cache. Runs in the ENGINE process.

- `regions.py`: `MemoryRegions`, the tags `weights`, `kv_cache`, `cuda_graph` as torch_memory_saver
  regions (no-ops on a CPU): release, resume, their states.
- `poison.py`: what a lost region held, filled with NaN / 0xFF bytes (a CPU release; a GPU resume
  with `--debug-poison-on-resume`), so a read of lost memory shows.
- `vmm.py`: the CUDA driver's virtual memory calls the regions and the probes use.
- `kv_cache.py`: `BlockManager`, the paged KV blocks each request holds and the prefix cache.
- `kv_budget.py`: the KV tensor, and how many blocks fit (a pure function of the profiled memory).

Arrows: memory -> config, request only.
"""
