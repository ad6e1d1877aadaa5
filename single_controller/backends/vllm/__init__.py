"""The vLLM generation backend: the real engine behind the `GenerationWorker` contract.

* `engine_env` sets the process environment vLLM reads at import (in-process engine, CPU KV cache,
  no torch.compile): the one place engine-specific settings for running on a CPU live.
* `extension.WeightLoader` is injected into vLLM's worker (`worker_extension_cls`): it streams a
  trainer's weight snapshot, bucket by bucket, into the worker's own `reload_weights`.
* `worker.VllmGenerationActor` owns one in-process `LLMEngine` and steps it from its own asyncio
  loop: concurrent groups share the engine (n = G per group), rows are scored and stored next to
  the engine, cancel aborts in the engine, weights swap between engine steps.
* `ray_workers` runs the actor on Ray (CPU, or one GPU) and is the starter named in
  `backends.registry`.

Importing this package does not import vllm; `worker` does.
"""
