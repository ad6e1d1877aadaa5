"""vLLM's sleep mode behind `protocols.Sleepable` (an elastic shrink, `single_controller/elastic.py`).

GPU only (vLLM's sleep mode is CUDA/ROCm; the rule `vllm_sleeps_only_on_a_gpu` refuses a deeper
level on the CPU). Both run in the engine's thread under the worker's engine lock, nothing in the
engine. `sleep_engine(engine, level)`: level 1 offloads the weights and drops the KV cache, level 2
drops both; it returns a `SleepRecord` of the device memory freed. `wake_engine(engine)` wakes the
weights, then the KV cache, and checks the engine is awake.
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
