"""The CPU emulation of megatron-core (backends/megatron/cpu_emulation.py) still covers every call site.

megatron-core is pinned (the `megatron` extra) to the version the emulation was written for. Each
test below runs one Megatron code path that hard-codes CUDA, inside the emulation, in this process
as a 1-rank gloo world; after an upgrade a new CUDA call site makes one of them fail loudly, naming
the path. The call sites (megatron-core 0.16.1):
  * forward: `parallel_state._GLOBAL_MEMORY_BUFFER` allocates on torch.cuda.current_device();
    the RNG tracker (CPU-safe seeding: `manual_seed`)
  * `DistributedDataParallel`: param_and_grad_buffer allocates on torch.cuda.current_device()
  * `FP32Optimizer`: a loss-scale tensor on "cuda"; `clip_grads` asserts `torch.cuda.FloatTensor`
    grads and builds its norm buffers on "cuda"
  * `DistributedOptimizer`: shard buffers and the param all-gather on CUDA
  * `finalize_model_grads` with num_tokens; the pipeline schedule (`get_forward_backward_func`)
    creates `total_num_tokens` on "cuda"
  * activation recompute (`tensor_parallel.checkpoint`): the CUDA RNG state, and the layers'
    forward run again inside backward
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

from single_controller.backends.megatron import cpu_emulation as emu  # noqa: E402
from tests.helpers.megatron_fixtures import VOCAB, hf_config, make_rows

pytestmark = [pytest.mark.megatron]
ROOT = Path(__file__).resolve().parents[2]


def test_installed_megatron_core_is_the_pinned_version():
    assert emu.check_version() == emu.PINNED_VERSION
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^megatron = \[(.*?)\]", pyproject, re.M | re.S)
    assert extra, "pyproject.toml has no `megatron` extra"
    assert f'"megatron-core=={emu.PINNED_VERSION}"' in extra.group(1)


def test_a_different_version_is_refused(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.0")
    with pytest.raises(emu.CpuEmulationError, match="0.17.0 is installed but the CPU emulation was written for"):
        emu.check_version()


def test_never_active_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(emu.CpuEmulationError, match="CUDA is available"):
        with emu.cpu_emulation(True):
            pass
    with emu.cpu_emulation(False):  # the switch off: nothing is touched
        assert torch.Tensor.cuda is not None


def test_everything_is_restored_on_exit():
    before = (
        torch.Tensor.cuda,
        torch.Tensor.type,
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.cuda.Stream,
    )
    with emu.cpu_emulation():
        with emu.cpu_emulation():  # re-entrant
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.ones(1).cuda().device.type == "cpu"
            assert torch.ones(1).type() == "torch.cuda.FloatTensor"
            assert torch.ones(1).to(torch.cuda.current_device()).device.type == "cpu"
            assert torch.ones(1).to(torch.float64).dtype == torch.float64  # dtypes are not devices
        assert torch.zeros(2, device="cuda:0").device.type == "cpu"
    assert (
        torch.Tensor.cuda,
        torch.Tensor.type,
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.cuda.Stream,
    ) == before
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")


# --- every emulated call site, in a 1-rank world ---------------------------------------------


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    from tests.helpers.free_ports import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    with emu.cpu_emulation():
        mps.initialize_model_parallel(1)
    yield
    mps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_state():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(hf_config()).float().state_dict()


def _core(hf_state, train=None, **kw):
    from single_controller.backends.megatron.model import ModelSpec
    from single_controller.backends.megatron.trainer import MegatronTrainerCore
    from single_controller.config.schema import TrainConfig

    return MegatronTrainerCore(
        hf_state, ModelSpec.from_hf_config(hf_config().to_dict()), train or TrainConfig(), emulate_cpu=True, **kw
    )


def test_ddp_buffers_need_the_emulation(world, hf_state):
    """Without the emulation Megatron's DDP cannot even be built on CPU: the call site is real."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from single_controller.backends.megatron.model import ModelSpec, build_gpt

    with emu.cpu_emulation():
        model = build_gpt(ModelSpec.from_hf_config(hf_config().to_dict()), 1)
    with pytest.raises((AssertionError, RuntimeError)):
        DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)


@pytest.mark.parametrize("distributed", [False, True], ids=["fp32-optimizer", "distributed-optimizer"])
def test_forward_backward_finalize_clip_and_step_run_under_the_emulation(world, hf_state, distributed):
    from single_controller.types import LossConfig

    core = _core(hf_state, distributed_optimizer=distributed)
    before = {k: v.clone() for k, v in core.hf_state_dict().items()}
    core.begin_train_step(0, LossConfig())
    core.train_microbatch(make_rows(6, seed=2))
    metrics = core.finish_train_step(0)
    assert metrics["train/grad_norm"] > 0 and metrics["train/tokens"] > 0
    after = core.hf_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_activation_recompute_runs_under_the_emulation(world, hf_state):
    """`train.gradient_checkpointing`: `tensor_parallel.checkpoint` saves the CUDA RNG state and
    recomputes each layer inside the backward pass (where the emulation's function mode is off unless
    the recompute enters one): the same gradient norm as without it, and the patch is gone after."""
    from megatron.core.tensor_parallel import random as mrandom

    from single_controller.config.schema import TrainConfig
    from single_controller.types import LossConfig

    original = inspect.getattr_static(mrandom.CheckpointFunction, "backward")
    norms = []
    for recompute in (False, True):
        core = _core(hf_state, train=TrainConfig(gradient_checkpointing=recompute))
        assert core.model.module.config.recompute_granularity == ("full" if recompute else None)
        core.begin_train_step(0, LossConfig())
        core.train_microbatch(make_rows(6, seed=2))
        norms.append(core.finish_train_step(0)["train/grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    assert inspect.getattr_static(mrandom.CheckpointFunction, "backward") is original


def test_pipeline_schedule_runs_under_the_emulation(world, hf_state):
    """Megatron's own schedule (not used by the split API, which drives microbatches itself): its
    `total_num_tokens` buffer is created on "cuda"."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    core = _core(hf_state)
    ids = torch.randint(0, VOCAB, (2, 8))

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = core.policy(batch)

        def loss_func(out):
            loss = out.float().logsumexp(-1).sum()
            return loss, torch.tensor(batch.numel()), {"loss": loss.detach()}

        return logits, loss_func

    with emu.cpu_emulation():
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([ids, ids]),
            model=[core.model],
            num_microbatches=2,
            seq_length=8,
            micro_batch_size=2,
            forward_only=False,
        )
    assert len(losses) == 2
