"""Running megatron-core on CPU, for tests only: the one switch is `megatron.cpu_emulation`.

megatron-core has no CPU mode (its DDP buffers, optimizer, clipping and scratch buffers hard-code
CUDA). `cpu_emulation()` is a context manager entered around everything a rank does with Megatron:
a `TorchFunctionMode` maps CUDA devices to CPU, `Tensor.cuda()` / `Tensor.type()` and the
`torch.cuda` stream and device calls are stubbed, and activation recompute runs its backward under a
mode of its own; everything is restored on exit. `manual_seed` is the CPU twin of Megatron's seeding.
Written against megatron-core == `PINNED_VERSION` (a test runs every emulated call site); it refuses
to start where CUDA is available, so the GPU path never runs through it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

PINNED_VERSION = "0.16.1"

_lock = threading.RLock()
_depth = 0
_saved: dict[tuple[Any, str], Any] = {}  # (owner, attribute) -> the original


class CpuEmulationError(RuntimeError):
    """The emulation was asked for where it must not run (CUDA present) or no longer fits megatron-core."""


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if (
            func is torch.Tensor.to
            and len(args) > 1
            and (_is_cuda_device(args[1]) and not isinstance(args[1], torch.dtype))
        ):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """Stands in for `torch.cuda.Stream`: everything runs in program order on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None


def _type(orig):
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any):
        if dtype is None:
            name = orig(self)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return orig(self, dtype, non_blocking, **kwargs)

    return type_


def _recompute_backward(orig):
    def backward(ctx: Any, *grads: Any) -> Any:
        with _CudaToCpu():  # the recomputed forward creates tensors on "cuda" like the first one
            return orig(ctx, *grads)

    return staticmethod(backward)


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, stand-in) of every patch. Applied with `setattr`: each stand-in has on
    purpose another type than the torch method, class or function it replaces."""
    from megatron.core.tensor_parallel import random as mrandom

    return [
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8)),
        (mrandom, "_set_cuda_rng_state", lambda *a, **k: None),
        (mrandom.CheckpointFunction, "backward", _recompute_backward(mrandom.CheckpointFunction.backward)),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (torch.Tensor, "type", _type(torch.Tensor.type)),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "Stream", _Stream),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "current_stream", lambda *a, **k: _Stream()),
        (torch.cuda, "default_stream", lambda *a, **k: _Stream()),
    ]


def _install() -> None:
    for owner, name, stand_in in _patches():  # built whole first: wraps the original Tensor.type
        _saved[(owner, name)] = inspect.getattr_static(owner, name)  # a staticmethod stays one
        setattr(owner, name, stand_in)


def _uninstall() -> None:
    for (owner, name), orig in _saved.items():
        setattr(owner, name, orig)
    _saved.clear()


def check_version() -> str:
    """The installed megatron-core version; raises if it is not the one this emulation was written for."""
    from importlib.metadata import version

    v = version("megatron-core")
    if v != PINNED_VERSION:
        raise CpuEmulationError(
            f"megatron-core {v} is installed but the CPU emulation was written for {PINNED_VERSION}; "
            f"install the pinned version (pip install -e '.[megatron]') or re-check every emulated call "
            f"site (tests/integration/test_megatron_emulation.py) and bump PINNED_VERSION"
        )
    return v


@contextlib.contextmanager
def cpu_emulation(enabled: bool = True) -> Iterator[None]:
    """Run megatron-core on CPU inside this block (re-entrant); `enabled=False` is a no-op."""
    global _depth
    if not enabled:
        yield
        return
    if torch.cuda.is_available():
        raise CpuEmulationError("megatron.cpu_emulation is for CPU-only test machines; CUDA is available here")
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()


def manual_seed(seed: int, emulated: bool) -> None:
    """Megatron's model-parallel seeding; on CPU with the inference RNG tracker (no CUDA RNG)."""
    from megatron.core import tensor_parallel

    if emulated:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
