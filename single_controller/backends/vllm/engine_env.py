"""Process environment for an in-process vLLM engine; must be applied before `import vllm`.

`VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process (no extra processes that
re-import vLLM and must be cleaned up); on the CPU `TORCH_COMPILE_DISABLE=1` avoids compiling the
sampler's logprob op on the first call, and `VLLM_CPU_KVCACHE_SPACE` sizes the CPU KV cache. What each saves
on the CPU build: docs/performance.md.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def engine_env(device: str, kv_cache_gib: float) -> dict[str, str]:
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in this process
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",  # its per-update CPU thread-binding warnings flood the console
    }
    if device == "cuda":
        env.update(gpu_sampler_env())
    if device == "cpu":
        env["TORCH_COMPILE_DISABLE"] = "1"  # on CUDA compiling is the engine's business (`vllm.enforce_eager`)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{max(1, round(kv_cache_gib))}"  # whole GiB; 0 fails
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # share the cores with the other workers
    return env


def gpu_sampler_env() -> dict[str, str]:
    """vLLM 0.25's GPU sampler asks FlashInfer whether it can sample and fails to import it when it is
    not installed (the lent GPU machine: docs/gpu.md); off, vLLM samples with torch."""
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if importlib.util.find_spec("flashinfer") is None else {}


def apply_engine_env(device: str, kv_cache_gib: float) -> None:
    """Set the environment for this process's engine; refuses once vllm is imported (too late)."""
    env = engine_env(device, kv_cache_gib)
    if "vllm" in sys.modules and any(os.environ.get(k) != v for k, v in env.items()):
        raise RuntimeError("vllm was imported before its engine environment was set (engine_env.apply_engine_env)")
    os.environ.update(env)
