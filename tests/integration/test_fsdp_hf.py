"""The FSDP2 trainer core (issue #52) on Hugging Face model directories, 2 gloo ranks, float64: a
Llama with `llama3` RoPE scaling (what the Megatron trainer refuses), a Qwen3 and a GPT-2 (tied
head): the split step, each chunk split across the ranks, equals the torch trainer's single-process
full-batch step (1e-10 relative), with the gradients reduced per microbatch or once at finish."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from single_controller.algorithm.dp_split import balanced_partition
from single_controller.backends.fsdp.trainer import FsdpTrainerCore
from single_controller.backends.torch.model import load_hf_policy
from single_controller.backends.torch.trainer import TrainerCore
from single_controller.data import hf_model
from single_controller.types import LossConfig
from tests.helpers.free_ports import free_port
from tests.helpers.trainer_rows import TRAIN, assert_close_rel, make_rows, seq_lengths, take

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

ARCHS = {"llama3-rope": dict(arch="llama"), "qwen3": dict(arch="qwen3"), "gpt2": dict(arch="gpt2", tie_embeddings=True)}
CHUNKING = [[0, 1, 2], [3], list(range(4, 10))]  # the single row: one rank's share is empty
REDUCES = ("microbatch", "finish")


def _write(directory, arch: str) -> str:
    path = hf_model.init_model(directory, hidden_size=64, head_dim=32, max_positions=64, seed=0, **ARCHS[arch])
    if arch == "llama3-rope":  # Llama 3.1/3.2's RoPE scaling
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["rope_scaling"] = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
        cfg_path.write_text(json.dumps(cfg))
    return str(path)


def _run(core, rows, world: int, rank: int) -> tuple:
    core.begin_train_step(0, LossConfig())
    for chunk in CHUNKING:
        sub = take(rows, chunk)
        core.train_microbatch(sub if world == 1 else take(sub, balanced_partition(seq_lengths(sub), world)[rank]))
    core.finish_train_step(0)
    full = [getattr(p, "full_tensor", lambda p=p: p)() for p in core.params]
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in core.params]
    return [g.detach().clone() for g in grads], [p.detach().clone() for p in full]


def _worker(rank: int, world: int, port: int, dirs: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for arch, path in dirs.items():
        for reduce in REDUCES:
            policy = load_hf_policy(path, dtype=torch.float64)
            core = FsdpTrainerCore(policy, TRAIN, process_group=dist.group.WORLD, reduce=reduce)
            results[(arch, reduce)] = _run(core, make_rows(10, 11), world, rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_hf")
    dirs = {arch: _write(root / arch, arch) for arch in ARCHS}
    mp.spawn(_worker, args=(2, free_port(), dirs, str(root)), nprocs=2, join=True)
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    want = {}
    for arch, path in dirs.items():  # the torch trainer, one process, the whole batch in one microbatch
        core = TrainerCore(load_hf_policy(path, dtype=torch.float64), TRAIN)
        core.begin_train_step(0, LossConfig())
        core.train_microbatch(make_rows(10, 11))
        core.finish_train_step(0)
        want[arch] = ([p.grad.clone() for p in core.params], [p.detach().clone() for p in core.params])
    return ranks, want


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fsdp_on_a_hugging_face_directory_equals_the_full_batch_step(hf_results, arch, reduce):
    ranks, want = hf_results
    for res in ranks:
        grads, params = res[(arch, reduce)]
        assert_close_rel(grads, want[arch][0], 1e-10)
        assert_close_rel(params, want[arch][1], 1e-10)
