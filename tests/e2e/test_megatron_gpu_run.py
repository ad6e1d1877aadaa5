"""A short `sc-grpo run` of configs/megatron_gpu.yaml (the Megatron trainer on CUDA, NCCL, no CPU emulation). Skipped
without CUDA. The trainer's conversion and a step on the GPU: tests/integration/test_megatron_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs the megatron extra")


ROOT = Path(__file__).resolve().parents[2]


def test_gpu_config_runs(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "single_controller",
            "run",
            str(ROOT / "configs/megatron_gpu.yaml"),
            "run.max_steps=3",
            "run.stop_at_success_rate=null",
            f"run.output_dir={tmp_path}",
            f"model.path={tmp_path}/model",
            "run.progress_bar=false",
            "run.plot=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "3 steps" in out.stdout + out.stderr
