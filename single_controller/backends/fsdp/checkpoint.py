"""What the FSDP2 trainer writes: its resumable state as a torch distributed checkpoint, and its policy
as Hugging Face safetensors, without ever holding the whole model on one rank.

* `save_distributed` / `load_distributed`: every rank writes its own shards
  (`torch.distributed.checkpoint`, directory `dcp/`) and a load reshards them onto however many ranks
  load them; rank 0 writes `fsdp.json` (the next step, the steps done, the world size it was saved
  with), every rank its RNG state (`rank{r}_rng.pt`; a rank that did not exist takes its own).
* `write_safetensors`: tensors arrive one at a time (gathered whole by every rank); rank 0 writes them
  in files of at most `shard_bytes` (`model.safetensors`, or past one file
  `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`), holding one file's
  tensors at most.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from single_controller.backends.common.weights import bucket_groups

DCP_DIR = "dcp"
META_FILE = "fsdp.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}_rng.pt")


def save_distributed(core: Any, directory: str, rank: int, world_size: int) -> None:
    """Every rank: `core`'s (an `FsdpTrainerCore`) shards, its RNG state, and (rank 0) the step counters."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(directory, exist_ok=True)
    dcp.save(core.distributed_state(), checkpoint_id=os.path.join(directory, DCP_DIR))
    torch.save({"rng": torch.get_rng_state()}, _rng_file(directory, rank))
    if rank == 0:
        meta = {"next_step": core.steps.next_step, "steps_done": core.steps.steps_done, "world_size": world_size}
        Path(directory, META_FILE).write_text(json.dumps(meta) + "\n")


def load_distributed(core: Any, directory: str, rank: int) -> int:
    """Every rank: what `save_distributed` wrote, on this world (any number of ranks); returns the next step."""
    import torch.distributed.checkpoint as dcp

    meta_path = Path(directory, META_FILE)
    if not meta_path.is_file():
        other = "a torch trainer's (trainer.pt)" if Path(directory, "trainer.pt").is_file() else "none"
        raise FileNotFoundError(
            f"{directory}: no {META_FILE}, so not a checkpoint of backend.trainer=fsdp (found: {other}); "
            "resume with the trainer that wrote it"
        )
    meta = json.loads(meta_path.read_text())
    state = core.distributed_state()  # this world's layout: the load reshards into it
    dcp.load(state, checkpoint_id=os.path.join(directory, DCP_DIR))
    core.load_distributed_state(state, meta["next_step"], meta["steps_done"])
    rng = _rng_file(directory, rank)
    if os.path.exists(rng):
        torch.set_rng_state(torch.load(rng)["rng"])
    return int(meta["next_step"])


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


def save_policy_dir(
    core: Any, directory: str | Path, *, shard_bytes: int, source: str | None, write: bool
) -> str | None:
    """Every rank: `core`'s (an `FsdpTrainerCore`) policy as a model directory loadable by
    `transformers` and vLLM: an HF model's config and the tokenizer files of `source` (its model
    directory), or a TinyGPT's own config; weights as safetensors (`write_safetensors`). The rank with
    `write` writes it and returns its path, the others None."""
    from single_controller.backends.torch.model import HFCausalLMPolicy, TinyGPT, state_module, write_tinygpt_config
    from single_controller.data.hf_model import copy_tokenizer_files

    named = state_tensors(state_module(core.policy))
    itemsize = named[0][1].element_size()
    write_safetensors(named, core.gathered(named), directory, shard_bytes=shard_bytes, itemsize=itemsize, write=write)
    if not write:
        return None
    if isinstance(core.policy, HFCausalLMPolicy):
        core.policy.model.config.save_pretrained(str(directory))
        assert source is not None  # an HF policy is built from its model directory
        copy_tokenizer_files(source, directory)
    else:
        assert isinstance(core.policy, TinyGPT)  # `build_policy`'s other kind
        write_tinygpt_config(core.policy, directory)
    return str(Path(directory))


def state_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's saved tensors (parameters and persistent buffers), a tied one once, under its
    first name (as `save_pretrained` writes them)."""
    seen: set[int] = set()
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out
