"""Injected into vLLM's worker class (`worker_extension_cls`); its methods run on the worker through
`collective_rpc` (in-process, so arguments arrive by reference).

`sc_load_snapshot(manifest, buckets)` hands vLLM's own `reload_weights` one iterator over the
snapshot, a bucket at a time (no buffer of the whole model), so the backend's weight processing runs
again (`reprocess_tied_layers` for a tied head). Buckets are numpy arrays or tensors received over a
weight-sync group. `sc_device_bytes()` reports the engine's weights and KV cache on its device.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch


def snapshot_tensors(manifest: Any, buckets: Sequence[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every entry, bucket by bucket; each bucket is released before
    the next one is fetched. A bfloat16 manifest's buckets are int16 bit patterns (numpy has no
    bfloat16: `backends.common.weights.CARRIERS`), reinterpreted here as `torch.bfloat16`."""
    by_bucket: dict[int, list] = {}
    for e in manifest.entries:
        by_bucket.setdefault(e.bucket, []).append(e)
    target = getattr(torch, manifest.dtype)  # the torch dtype the manifest names
    carrier = manifest.carrier  # the buckets' numpy dtype
    for b in sorted(by_bucket):
        # numpy (the object store's, in the carrier dtype) or torch (a broadcast's, in the manifest's)
        flat = buckets[b] if isinstance(buckets[b], torch.Tensor) else np.asarray(buckets[b])
        expect = f"torch.{manifest.dtype}" if isinstance(flat, torch.Tensor) else carrier
        if flat.ndim != 1 or len(flat) != manifest.bucket_numels[b] or str(flat.dtype) != expect:
            raise ValueError(
                f"bucket {b} is {flat.dtype}{list(flat.shape)}, "
                f"manifest says {expect}[{manifest.bucket_numels[b]}] ({manifest.dtype})"
            )
        with warnings.catch_warnings():  # object-store arrays are read-only; they are only copied from
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = flat if isinstance(flat, torch.Tensor) else torch.from_numpy(flat)
        if t.dtype != target:
            t = t.view(target)  # same width: reinterpret the carrier's bits, no copy
        for e in by_bucket[b]:
            yield e.name, t[e.offset : e.offset + e.numel].view(e.shape)
        del flat, t


class _ModelRunner(Protocol):
    """What `WeightLoader` uses of the vLLM worker's model runner."""

    def reload_weights(
        self, *, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None, is_checkpoint_format: bool
    ) -> None: ...

    def get_model(self) -> torch.nn.Module: ...


class WeightLoader:
    """Mixed into vLLM's worker; `self.model_runner` is the worker's."""

    model_runner: _ModelRunner  # declared only: the worker class this is mixed into sets it

    def sc_load_snapshot(self, manifest: Any, buckets: Sequence[Any]) -> int:
        """Load every tensor of the snapshot in place; returns how many were loaded."""
        count = 0

        def tensors():
            nonlocal count
            for item in snapshot_tensors(manifest, buckets):
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        reprocess_tied_layers(self.model_runner.get_model())
        return count

    def sc_device_bytes(self) -> dict[str, int]:
        """Bytes the engine holds on its device (each storage once): its parameters and buffers, and
        its KV cache (an elastic sleep compares what it freed with them: `sleep.sleep_engine`)."""
        model = self.model_runner.get_model()
        kv_caches = getattr(self.model_runner, "kv_caches", ())
        return {"weights": device_bytes([*model.parameters(), *model.buffers()]), "kv_cache": device_bytes(kv_caches)}

    def sc_named_parameters(self) -> dict[str, np.ndarray]:
        """Copies of the engine's parameters as float32 numpy arrays, by vLLM's names (fused ones
        such as `qkv_proj` included), for checks."""
        return {n: p.detach().float().cpu().numpy().copy() for n, p in self.model_runner.get_model().named_parameters()}


def device_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors` that are not on the host, each counted once."""
    storages = {}
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Re-run the weight processing of every layer whose weight is another layer's (a tied `lm_head`).

    `reload_weights` processes a layer when its own checkpoint names arrive. A tied head has none (the
    checkpoint holds the embedding alone), so its processed form is left as it was: on the CPU backend
    that is a prepacked copy of the *old* embedding (`cpu_linear`), and the engine would sample from the
    old head while the embedding moved. Processing is idempotent (the CPU backend re-packs; elsewhere it
    is a no-op for unquantized layers). Returns the number of layers re-processed."""
    owners: dict[int, list[tuple[torch.nn.Module, Any]]] = {}
    for module in model.modules():
        weight, method = module._parameters.get("weight"), getattr(module, "quant_method", None)
        if weight is not None and method is not None:
            owners.setdefault(weight.data_ptr(), []).append((module, method))
    count = 0
    for layers in owners.values():
        if len(layers) > 1:
            for module, method in layers:
                method.process_weights_after_loading(module)
                count += 1
    return count
