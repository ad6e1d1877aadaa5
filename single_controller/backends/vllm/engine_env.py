"""Process environment for an in-process vLLM engine; must be applied before `import vllm`.

`VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process (no extra processes that
re-import vLLM and must be cleaned up), `TORCH_COMPILE_DISABLE=1` avoids compiling the sampler's
logprob op on the first call, and `VLLM_CPU_KVCACHE_SPACE` sizes the CPU KV cache. What each saves
on the CPU build: docs/performance.md.
"""

from __future__ import annotations

import os
import sys


def engine_env(device: str, kv_cache_gib: float) -> dict[str, str]:
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in this process
        "TORCH_COMPILE_DISABLE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",  # its per-update CPU thread-binding warnings flood the console
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{max(1, round(kv_cache_gib))}"  # whole GiB; 0 fails
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # share the cores with the other workers
    return env


def apply_engine_env(device: str, kv_cache_gib: float) -> None:
    """Set the environment for this process's engine; refuses once vllm is imported (too late)."""
    env = engine_env(device, kv_cache_gib)
    if "vllm" in sys.modules and any(os.environ.get(k) != v for k, v in env.items()):
        raise RuntimeError("vllm was imported before its engine environment was set (engine_env.apply_engine_env)")
    os.environ.update(env)
