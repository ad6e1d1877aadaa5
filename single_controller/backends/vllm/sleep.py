"""vLLM's sleep mode behind `protocols.Sleepable` (an elastic shrink, `single_controller/elastic.py`).

Only on a GPU: vLLM's sleep mode is CUDA/ROCm only, and the engine must be started with
`enable_sleep_mode=True` (`worker.engine_args` does, with `vllm.device=cuda` and
`rollout.sleep_level` > 0; the config rule `vllm_sleeps_only_on_a_gpu` refuses a deeper level on the
CPU). Both functions run in the engine's own thread, under the worker's engine lock, with nothing in
the engine:

* `sleep_engine(engine, level)`: `LLMEngine.sleep(level)`. Level 1 offloads the weights to host
  memory and drops the KV cache; level 2 drops both (buffers such as RoPE tables are kept on the
  host), so every weight must be loaded again before the engine generates. Returns a `SleepRecord`:
  the device memory freed (`torch.cuda.mem_get_info` before and after, so another process's
  allocations in between count too) beside the engine's weights and KV cache on the device.
* `wake_engine(engine)`: `LLMEngine.wake_up`, the weights' memory first and then the KV cache's
  where the installed vLLM takes tags (what vLLM's docs advise against an OOM while weights are
  reloaded), then checks that the engine is awake (its scheduler runs again only then).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SleepRecord:
    level: int
    freed_bytes: int  # device memory free after the sleep minus before it
    weights_bytes: int  # the engine's parameters and buffers on the device, before it
    kv_cache_bytes: int  # the engine's KV cache on the device, before it
    seconds: float

    @property
    def engine_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def sleep_engine(engine: Any, level: int) -> SleepRecord:
    import torch

    t0 = time.perf_counter()
    (sizes,) = engine.collective_rpc("sc_device_bytes")  # `extension.WeightLoader`; one worker in this process
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    engine.sleep(level)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    return SleepRecord(level, free_after - free_before, sizes["weights"], sizes["kv_cache"], time.perf_counter() - t0)


def wake_engine(engine: Any) -> None:
    if "tags" in inspect.signature(engine.wake_up).parameters:
        engine.wake_up(tags=["weights"])
        engine.wake_up(tags=["kv_cache"])
    else:
        engine.wake_up()
    if engine.is_sleeping():
        raise RuntimeError("vLLM's wake_up left the engine asleep")
