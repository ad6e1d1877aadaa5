"""The FSDP2 trainer's checkpoints, weight export and saved policy (issue #52), on a Hugging Face Llama
directory with `llama3` RoPE scaling, float64, gloo ranks in processes of their own (no Ray):

* a torch distributed checkpoint written by 2 ranks loads on 1 rank, and one written by 1 rank on 2:
  parameters and AdamW state come back bit-exact, and the next step (under a warmup + cosine lr
  schedule) equals the step of the run that never stopped (1e-10 relative) at the same lr;
* a weight export gathers one tensor at a time into one bucket at a time: measured, no rank ever holds
  more than one bucket and one gathered tensor of the policy, and the snapshot is the policy;
* the saved policy, in several safetensors files with an index, loads in `transformers` and equals
  the trainer's parameters;
* `train.offload: all` moves each rank's shards (parameters and AdamW state) to host memory and back
  bit-exact: the step after it is the step the other runs take without one.
"""

import dataclasses
import json
import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from single_controller.algorithm.dp_split import balanced_partition
from single_controller.backends.common.weights import load_snapshot
from single_controller.backends.fsdp import checkpoint as fsdp_checkpoint
from single_controller.backends.fsdp.trainer import FsdpTrainerCore
from single_controller.backends.torch.model import load_hf_policy, state_module
from single_controller.types import LossConfig
from tests.helpers.free_ports import free_port
from tests.helpers.trainer_rows import TRAIN, assert_close_rel, make_rows, seq_lengths, take
from tests.integration.test_fsdp_hf import _write

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

CFG = dataclasses.replace(TRAIN, lr_schedule="cosine", warmup_steps=1)
MAX_STEPS = 6
BUCKET_BYTES = 40_000  # a few tensors a bucket (float64)
SHARD_BYTES = 200_000  # several safetensors files
SAVES = {"first": "ckpt2", "ckpt2": "ckpt1", "ckpt1": "ckpt2-again"}  # each phase's checkpoint: the next one loads it


def _core(path: str) -> FsdpTrainerCore:
    policy = load_hf_policy(path, dtype=torch.float64)
    return FsdpTrainerCore(policy, CFG, process_group=dist.group.WORLD, max_steps=MAX_STEPS, bucket_bytes=BUCKET_BYTES)


def _step(core: FsdpTrainerCore, step: int, world: int, rank: int) -> float:
    rows = make_rows(8, 100 + step)
    core.begin_train_step(step, LossConfig())
    core.train_microbatch(take(rows, balanced_partition(seq_lengths(rows), world)[rank]))
    return core.finish_train_step(step)["train/lr"]


def _state(core: FsdpTrainerCore) -> dict:
    """Whole parameters and AdamW moments (gathered on every rank)."""
    out = {}
    for name, p in core.policy.named_parameters():
        out[name] = p.full_tensor().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{k}"] = core.optimizer.state[p][k].full_tensor().clone()
    return out


class _Peak:
    """Bytes of gathered tensors and packed buckets alive at once: weak references, by address (a
    bucket that is its gathered tensor's memory counts once; memory counts until all holders are gone)."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # address -> [holders, bytes]
        self.peak = 0

    def track(self, obj, address: int, nbytes: int):
        held = self.live.setdefault(address, [0, nbytes])
        held[0] += 1
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        weakref.finalize(obj, self._gone, address)
        return obj

    def _gone(self, address: int) -> None:
        self.live[address][0] -= 1
        if not self.live[address][0]:
            del self.live[address]


def _measured_export(core: FsdpTrainerCore, lead: bool) -> tuple:
    from torch.distributed.tensor import DTensor

    peak, full_tensor = _Peak(), DTensor.full_tensor

    def tracked(self, *args, **kwargs):
        t = full_tensor(self, *args, **kwargs)
        return peak.track(t, t.data_ptr(), t.numel() * t.element_size())

    DTensor.full_tensor = tracked
    try:
        snap = core.publish_buckets(0, lead=lead, put=lambda b: peak.track(b, b.ctypes.data, b.nbytes).copy())
    finally:
        DTensor.full_tensor = full_tensor
    return snap, peak.peak


def _worker(rank: int, world: int, port: int, path: str, out: str, phase: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    core = _core(path)
    res: dict = {}
    if phase == "first":  # export, 2 steps, a checkpoint, the saved policy, then the step after
        res["export"] = _measured_export(core, rank == 0)
        res["lrs"] = [_step(core, s, world, rank) for s in range(2)]
        fsdp_checkpoint.save_distributed(core, os.path.join(out, SAVES[phase]), rank, world)
        fsdp_checkpoint.save_policy_dir(
            core, os.path.join(out, "policy"), shard_bytes=SHARD_BYTES, source=path, write=rank == 0
        )
        res["saved"] = _state(core)
        res["offload"] = _offload_round_trip(core)
    else:  # load what the other world saved, save it again from here, then the step after
        res["next_step"] = fsdp_checkpoint.load_distributed(core, os.path.join(out, phase), rank)
        res["loaded"] = _state(core)
        fsdp_checkpoint.save_distributed(core, os.path.join(out, SAVES[phase]), rank, world)
    res["lrs_after"] = [_step(core, 2, world, rank)]
    res["after"] = _state(core)
    torch.save(res, os.path.join(out, f"{phase}-{world}-rank{rank}.pt"))
    dist.destroy_process_group()


def _offload_round_trip(core: FsdpTrainerCore) -> tuple:
    """`offload("all")` then `onload()`: (bytes moved, local shard bytes left on the device while
    offloaded, whether the state came back bit-exact)."""
    from single_controller.backends.fsdp.trainer import local

    before = _state(core)
    moved = core.offload("all").num_bytes
    shards = [local(p) for p in core.params] + [local(t) for s in core.optimizer.state.values() for t in s.values()]
    left = sum(t.untyped_storage().nbytes() for t in shards)
    core.onload()
    after = _state(core)
    return moved, left, all(torch.equal(after[k], v) for k, v in before.items())


def _spawn(world: int, path: str, out: str, phase: str) -> dict:
    mp.spawn(_worker, args=(world, free_port(), path, out, phase), nprocs=world, join=True)
    return torch.load(os.path.join(out, f"{phase}-{world}-rank0.pt"), weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    path = _write(root / "llama", "llama3-rope")
    out = str(root)
    first = _spawn(2, path, out, "first")  # 2 ranks: steps 0, 1, checkpoint `ckpt2`, step 2
    two_to_one = _spawn(1, path, out, "ckpt2")  # 1 rank loads ckpt2, saves `ckpt1`, step 2
    one_to_two = _spawn(2, path, out, "ckpt1")  # 2 ranks load ckpt1 (written by 1 rank), step 2
    return path, root, first, two_to_one, one_to_two


@pytest.mark.parametrize("resume", ["2 -> 1 ranks", "1 -> 2 ranks"])
def test_a_checkpoint_reshards_and_the_next_step_is_the_uninterrupted_runs(runs, resume):
    _, _, first, two_to_one, one_to_two = runs
    resumed = two_to_one if resume.startswith("2") else one_to_two
    assert resumed["next_step"] == 2
    assert resumed["loaded"].keys() == first["saved"].keys()
    for k, saved in first["saved"].items():  # parameters and AdamW moments, bit-exact
        assert torch.equal(resumed["loaded"][k], saved), k
    assert resumed["lrs_after"] == first["lrs_after"]  # the lr schedule goes on where it was
    assert first["lrs_after"][0] < first["lrs"][1]  # the schedule decays: resuming at another step would show
    for k, after in first["after"].items():
        assert_close_rel(resumed["after"][k], after, 1e-10)


def test_a_weight_export_holds_one_bucket_and_one_gathered_tensor_at_most(runs):
    path, _, first, _, _ = runs
    snap, peak = first["export"]
    policy = load_hf_policy(path, dtype=torch.float64)  # the init the first run started from
    named = dict(state_module(policy).named_parameters())
    largest = max(p.numel() * p.element_size() for p in named.values())
    total = sum(p.numel() * p.element_size() for p in named.values())
    assert len(snap.buckets) >= 4 and max(snap.manifest.bucket_numels) * 8 <= max(BUCKET_BYTES, largest)
    assert largest <= peak <= BUCKET_BYTES + largest < total / 2, (peak, BUCKET_BYTES, largest, total)
    fresh = load_hf_policy(path, dtype=torch.float64)
    for p in fresh.parameters():
        p.data.zero_()
    load_snapshot(state_module(fresh), snap)
    for name, p in state_module(fresh).named_parameters():
        assert torch.equal(p, named[name]), name


def test_the_saved_policy_is_sharded_safetensors_with_an_index_that_transformers_loads(runs):
    import transformers

    path, root, first, _, _ = runs
    out = root / "policy"
    index = json.loads((out / fsdp_checkpoint.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == sorted(f.name for f in out.glob("model-*.safetensors"))
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64)
    loaded = dict(model.named_parameters())
    assert loaded.keys() == {k.removeprefix("model.") for k in first["saved"] if "/" not in k}
    for name, p in loaded.items():
        assert torch.equal(p, first["saved"][f"model.{name}"]), name


def test_offload_moves_each_ranks_shards_out_and_back_bit_exact(runs):
    """The step after the round trip is the resumed runs' step (the test above compares them)."""
    _, _, first, _, _ = runs
    moved, left, exact = first["offload"]
    params = sum(v.numel() * v.element_size() for k, v in first["saved"].items() if "/" not in k)
    assert left == 0 and exact, (left, exact)
    assert moved >= 1.5 * params  # this rank's shards of the parameters and both AdamW moments (2 ranks: 1/2 each)
