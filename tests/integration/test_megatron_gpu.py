"""The Megatron trainer on a CUDA GPU (NCCL, no CPU emulation): conversion and logits against HF,
one split-API step (a short `sc-grpo run` of configs/megatron_gpu.yaml: tests/e2e/test_megatron_gpu_run.py).
Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs the megatron extra")

from tests.helpers.megatron_fixtures import VOCAB, load_hf, make_hf_dir, make_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_gpu_rank_converts_exactly_and_trains(tmp_path, arch):
    from single_controller.backends.megatron.ray_workers import MegatronRankActor
    from single_controller.config.schema import TrainConfig
    from single_controller.types import LossConfig
    from tests.helpers.free_ports import free_port

    torch.backends.cuda.matmul.allow_tf32 = False
    d = make_hf_dir(tmp_path / "m", arch=arch)
    hf = load_hf(d)
    rank = MegatronRankActor(0, 1)
    rank.join("127.0.0.1", free_port(), 120, backend="nccl")
    try:
        info = rank.build(str(d), TrainConfig(), tensor_parallel_size=1, emulate_cpu=False)
        assert info["params"] > 0 and rank.core.device.type == "cuda"
        back = rank.hf_weights()
        assert all(torch.equal(torch.from_numpy(back[k]), v) for k, v in hf.state_dict().items())
        ids = torch.randint(0, VOCAB, (3, 9))
        with torch.no_grad():
            want = hf(input_ids=ids).logits
        assert (rank.logits(ids) - want).abs().max().item() <= 1e-4
        rank.begin_train_step(0, LossConfig())
        rank.train_microbatch_rows(make_rows(8, seed=3))
        metrics = rank.finish_train_step(0)
        assert metrics["train/tokens"] > 0 and metrics["train/grad_norm"] > 0
    finally:
        rank.close()
