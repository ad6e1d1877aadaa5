"""The vLLM generation backend: the real engine behind the `GenerationWorker` contract.

`engine_env` sets the environment vLLM reads at import; `extension.WeightLoader` streams a snapshot
into vLLM's own `reload_weights`; `worker.VllmGenerationActor` owns one in-process `LLMEngine`
stepped from its asyncio loop; `ray_workers` runs it on Ray (the starter `backends.registry` names).
Importing this package does not import vllm; `worker` does.
"""
