"""Every example in examples/ runs briefly as a user runs it: the `sc-grpo` command from the repository root
(the examples' `module:function` names import from there). That each is listed and loads:
tests/unit/test_example_configs.py.

Cost: two real runs on a local Ray (custom reward, HF model directory; ~25 s start-up each on 2
cores), the custom dataset on the in-process sim backend (the dataset is read by the controller, so
the backend does not change what the example shows), the GPU example's config on the CPU and, on a
machine with 2 CUDA GPUs and the `gpu` extra, a real run of it (marker `gpu`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from single_controller.data.tasks import TOKENIZER

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# quick runs: a few steps, no plot, no progress bar, any free metrics port
QUICK = [
    "run.max_steps=3",
    "run.stop_at_success_rate=null",
    "run.progress_bar=false",
    "run.plot=false",
    "metrics.port=0",
]


def sc_grpo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `sc-grpo` console script (what users type), run from the repository root."""
    exe = shutil.which("sc-grpo") or str(Path(sys.executable).with_name("sc-grpo"))
    return subprocess.run(
        [exe, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]


@pytest.mark.slow
@pytest.mark.ray
def test_custom_reward_example_runs_with_its_reward(tmp_path):
    ok(sc_grpo("run", "examples/custom_reward/config.yaml", f"run.output_dir={tmp_path}", *QUICK))
    (run_dir,) = tmp_path.glob("custom_reward-*")
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    # The generation worker scored with the example's reward: the random policy's mean is below 0
    # there (non-digit penalty), which the built-in positional reward (in [0, 1]) can never be.
    assert records[0]["rollout/reward_mean"] < 0, records[0]["rollout/reward_mean"]


def test_custom_dataset_example_trains_the_files_prompts(tmp_path):
    sim = ["backend.generation=sim", "backend.trainer=sim", "storage.kind=memory"]
    ok(sc_grpo("run", "examples/custom_dataset/config.yaml", f"run.output_dir={tmp_path}", *QUICK, *sim, timeout=120))
    (run_dir,) = tmp_path.glob("custom_dataset-*")
    assert len(metrics(run_dir)) == 3
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    in_file = {
        json.loads(line)["id"]: json.loads(line)
        for line in (EXAMPLES / "custom_dataset/prompts.jsonl").read_text().splitlines()
    }
    trained = [p for p in ledger if p["fate"] == "trained"]
    assert len(trained) == 3 * 16  # 3 steps of train.groups_per_step prompts
    for p in trained:
        rec = in_file[p["prompt_id"].split("-", 1)[1]]  # ids are e<epoch>-<the file's id>
        assert p["answer"] == rec["answer"]
        assert TOKENIZER.decode(p["token_ids"]) == "^" + rec["prompt"]


@pytest.mark.slow
@pytest.mark.ray
def test_hf_model_example_trains_a_directory_written_by_init_model(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra")
    model = tmp_path / "model"
    init = ("init-model", str(model), "--arch", "gpt2", "--hidden-size", "64", "--head-dim", "32")
    init += ("--tokenizer", "char")
    ok(sc_grpo(*init, timeout=120))
    ok(sc_grpo("run", "examples/hf_model/config.yaml", f"model.path={model}", f"run.output_dir={tmp_path}", *QUICK))
    (run_dir,) = tmp_path.glob("hf_model-*")
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]
    saved = json.loads((run_dir / "checkpoint" / "config.json").read_text())
    assert saved["model_type"] == "gpt2" and (run_dir / "checkpoint" / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.ray
def test_chat_model_example_trains_chat_prompts_of_a_bpe_model_it_writes(tmp_path):
    model = tmp_path / "model"
    ok(sc_grpo("run", "examples/chat_model/config.yaml", f"model.path={model}", f"run.output_dir={tmp_path}", *QUICK))
    (run_dir,) = tmp_path.glob("chat_model-*")
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]
    from single_controller.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model))
    assert tok.has_chat_template and tok.eos_ids == (tok.tok.convert_tokens_to_ids("<|im_end|>"),)
    rows = {
        json.loads(line)["id"]: json.loads(line)
        for line in (EXAMPLES / "chat_model/train.jsonl").read_text().splitlines()
    }
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    for p in ledger[:20]:
        row = rows[p["prompt_id"].split("-", 1)[1]]
        assert p["token_ids"] == tok.render_chat(row["prompt"]) and p["answer"] == row["answer"]
    saved = json.loads((run_dir / "checkpoint" / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in saved["chat_template"]  # the trained model keeps its template


@pytest.mark.slow
@pytest.mark.ray
def test_reasoning_gym_example_scores_with_the_tasks_own_scorer(tmp_path):
    pytest.importorskip("reasoning_gym", reason="the verifiers extra")
    model = f"model.path={tmp_path / 'model'}"
    ok(sc_grpo("run", "examples/reasoning_gym/config.yaml", model, f"run.output_dir={tmp_path}", *QUICK))
    (run_dir,) = tmp_path.glob("reasoning_gym-*")
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all({"reward/reasoning_gym/mean", "reward/letters_in_place/mean"} <= set(r) for r in records)
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    assert all(p["prompt_id"].split("-", 1)[1].startswith("rg-spell_backward-train-") for p in ledger)


@pytest.mark.slow
@pytest.mark.ray
def test_math_verify_example_runs_end_to_end(tmp_path):
    pytest.importorskip("math_verify", reason="the verifiers extra")
    model = f"model.path={tmp_path / 'model'}"
    ok(sc_grpo("run", "examples/math_verify/config.yaml", model, f"run.output_dir={tmp_path}", *QUICK))
    (run_dir,) = tmp_path.glob("math_verify-*")
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0.0 <= r["reward/math_verify/mean"] <= 1.0 and r["rollout/reward_failed"] == 0 for r in records)


def _two_gpus() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("megatron") is None:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs and the gpu extra (vllm, megatron-core)")
def test_gpu_example_runs(tmp_path):
    model = tmp_path / "model"
    ok(
        sc_grpo(
            "run", "examples/gpu/config.yaml", f"model.path={model}", f"run.output_dir={tmp_path}", *QUICK, timeout=600
        )
    )
    (run_dir,) = tmp_path.glob("gpu-*")
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]
