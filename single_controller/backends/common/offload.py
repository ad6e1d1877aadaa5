"""Moving a trainer's state out of the device and back (`train.offload`, colocated turns).

`HostOffload.offload(tensors)` copies each tensor's storage to host memory (pinned on CUDA, so the
copy back is an asynchronous DMA) and shrinks the device storage to nothing: the tensor objects stay
where they are (the optimizer's state dict, the module's parameters), only their memory goes.
`onload()` gives every storage its size back and copies the bytes in, bit-exact. Storages shared by
several tensors (views) move once. On the CPU the "device" is host memory too: the round trip then
copies to a second buffer and frees the first, which is what the tests check.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from single_controller.types import OffloadRecord


def _allocated(device: torch.device | None) -> int:
    return torch.cuda.memory_allocated(device) if device is not None and device.type == "cuda" else 0


class HostOffload:
    """The host copies of the storages moved out (empty: everything is on the device)."""

    def __init__(self) -> None:
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (device storage, host bytes)
        self._device: torch.device | None = None

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> OffloadRecord:
        """Move the storages of `tensors` to host memory (those already moved are skipped)."""
        t0 = time.perf_counter()
        seen = {s.data_ptr() for s, _ in self._moved}
        moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard (FSDP): its own storage
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=t.is_cuda)
            host.untyped_storage().copy_(storage, non_blocking=t.is_cuda)
            moved.append((storage, host))
            self._device = t.device
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # the copies have landed before the storages go
        for storage, _ in moved:
            storage.resize_(0)
        self._moved += moved
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device, for the engine that takes the turn
        nbytes = sum(h.numel() for _, h in moved)
        return OffloadRecord("offload", nbytes, time.perf_counter() - t0, _allocated(self._device))

    @torch.no_grad()
    def onload(self) -> OffloadRecord:
        """Give every moved storage its memory back and copy its bytes in; the host copies go."""
        t0 = time.perf_counter()
        moved, self._moved = self._moved, []
        for storage, host in moved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=storage.device.type == "cuda")
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # before the host copies are freed
        nbytes = sum(h.numel() for _, h in moved)
        return OffloadRecord("onload", nbytes, time.perf_counter() - t0, _allocated(self._device))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (AdamW: step, exp_avg, exp_avg_sq)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
