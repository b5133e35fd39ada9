"""The model runner: one step's tensors, the forward, CUDA graphs and sampling. Runs in the ENGINE
process.

- `model_runner.py`: `ModelRunner`, startup as a recipe (model, weights, KV cache, attention
  backend, sampler, graphs); `launch` queues a step on the device without waiting.
- `model_builder.py`: the model and the draft model built on the meta device, in the engine's dtype.
- `kv_sizing.py`: how many KV blocks the cache gets (the profiling forward on CUDA).
- `graph_setup.py`: the attention backends, the persistent decode paths and the captured graphs
  (decode, piecewise, the draft's) on one pool, inside the `cuda_graph` region; the tensors it holds.
- `graph_sizes.py`: which graphs the engine captures (decode, verify, piecewise), by config,
  device and backend.
- `step_plan.py`: a scheduled batch planned as plain numbers (`StepPlan`: what every
  tensor-parallel rank runs); `step_inputs.py`: a plan sent to the device as the step's input
  tensors, in one copy.
- `sampling_plan.py`: the step's sampling inputs as plain numbers (`SamplingPlan`);
  `sampling_batch.py`: the same on the device (`SamplingBatch`), with the flags of the launches it needs.
- `launched_step.py`: a step in flight; its results are read back one step later (overlap).
- `sampler.py`: greedy and random sampling, logprobs (on CUDA through
  engine/kernels/lse_argmax.py: one read of the logits, or in a decode graph of up to 64 rows only
  the merge of the pieces the logits' epilogue wrote).
- `prompt_logprobs.py`: the logprobs of prompt tokens a prefill chunk scores, and their top
  alternatives, in slices of rows.
- `cuda_graph.py` (decode graphs per batch size, one static buffer set sliced per size),
  `piecewise_graph.py` (mixed prefill + decode steps: the layers between attention calls).
- `graph_io.py`: what a decode graph reads from and writes to pinned host memory itself (the
  step's inputs, the greedy samples), with no copy engine between steps.
- `pinned.py`: pinned host staging buffers for the step inputs.
- `grammar.py`: grammar-constrained decoding (xgrammar): a request's matcher and each step's token
  mask, applied by the sampler.
- `structural_tag.py`: a client's structural tag (SGLang's and vLLM's shapes) as xgrammar's
  format; pure Python, so the server checks it too.
- `draft_model.py`: speculative decoding's draft model: its weights ride in the target's as
  `draft.`, its KV cache shares the target's blocks; proposes each drafting request's tokens.
- `route_log.py`: the routed experts of every KV slot's token on the host, for RL routing replay
  (`return_routed_experts`), staged behind each step and read per request through its blocks.

Arrows: runner -> memory, weights, decode, models, attention, kernels.
"""
