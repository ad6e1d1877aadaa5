"""What the FSDP2 trainer writes: its resumable state as a torch distributed checkpoint, and its policy
as Hugging Face safetensors, without ever holding the whole model on one rank.

* `save_distributed` / `load_distributed`: every rank writes its own shards
  (`torch.distributed.checkpoint`, directory `dcp/`) and a load reshards them onto however many ranks
  load them; rank 0 writes `fsdp.json` (the next step, the steps done, the world size it was saved
  with), every rank its RNG state (`rank{r}_rng.pt`; a rank that did not exist takes its own).
* `save_policy_dir`: tensors arrive one at a time (gathered whole by every rank); rank 0 writes them
  (`common.safetensors_files.write_safetensors`) holding one file's tensors at most.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from single_controller.backends.common.safetensors_files import INDEX_FILE, write_safetensors

__all__ = ["INDEX_FILE", "load_distributed", "save_distributed", "save_policy_dir", "write_safetensors"]

DCP_DIR = "dcp"
META_FILE = "fsdp.json"


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
