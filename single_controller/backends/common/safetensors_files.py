"""A policy's weights as Hugging Face safetensors files: `model.safetensors`, or past `shard_bytes`
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json` (the names `transformers` and
vLLM read). Tensors arrive one at a time, so a writer holds one file's tensors at most.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from single_controller.backends.common.weights import bucket_groups

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A source model directory's files that describe its own weights: never copied beside other weights.
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt", ".pth")


def safetensors_names(count: int) -> list[str]:
    """The file names Hugging Face gives `count` weight files."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_safetensors(
    planned: Sequence[tuple[str, torch.Tensor]],
    gathered: Iterable[tuple[str, torch.Tensor]],
    directory: str | Path,
    *,
    shard_bytes: int,
    itemsize: int,
    write: bool,
) -> list[str]:
    """Write `gathered` (the tensors of `planned`, whole, in its order, one at a time) into safetensors
    files of at most `shard_bytes` (`itemsize`: bytes an element). Every rank consumes `gathered` (its
    all-gathers are collectives); only the rank with `write` writes. Returns the file names."""
    from safetensors.torch import save_file

    plan = bucket_groups(planned, itemsize, shard_bytes)
    names = safetensors_names(len(plan))
    out = Path(directory)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
            stale.unlink(missing_ok=True)  # a policy written over: no file of the old one may be read with it
    it = iter(gathered)
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, group in zip(names, plan):
        tensors = {}
        for want, _ in group:
            name, t = next(it)
            assert name == want  # gathered in the planned order
            if write:
                tensors[name] = t.detach().cpu().contiguous()
                weight_map[name] = file_name
                total += t.numel() * t.element_size()
        if write:
            save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
    if write and len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names
