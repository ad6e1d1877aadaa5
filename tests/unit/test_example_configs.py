"""Every example in examples/ is listed, loads and states only differences from the defaults; its `module:function`
names import from the current directory; the math_verify example's data scores its own solutions right. The examples'
runs, as a user runs them: tests/e2e/test_examples.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from single_controller.config import fields
from single_controller.config.schema import Config
from single_controller.preflight.loader import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NAMES = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def test_the_examples_are_there_and_listed():
    assert NAMES == [
        "chat_model",
        "custom_dataset",
        "custom_reward",
        "gpu",
        "gsm8k",
        "hf_model",
        "math_verify",
        "reasoning_gym",
    ]
    listed = (EXAMPLES / "README.md").read_text()
    for name in NAMES:
        config = EXAMPLES / name / "config.yaml"
        assert f"[`{name}/`]({name}/)" in listed, f"examples/README.md does not list {name}"
        assert config.read_text().startswith("# "), f"{config} has no comment saying what it shows"
        assert f"examples/{name}/config.yaml" in config.read_text(), f"{config} does not say how to run it"


@pytest.mark.parametrize("name", NAMES)
def test_every_example_config_loads_and_states_only_differences(name, monkeypatch):
    import yaml

    monkeypatch.chdir(ROOT)  # the module names import from the repository root
    path = EXAMPLES / name / "config.yaml"
    assert isinstance(load_config(str(path), []), Config)
    data = yaml.safe_load(path.read_text())
    same = [k for k, v in _leaves(data) if v == fields.get(Config(), k)]
    assert same == [], f"{name} restates defaults: {same}"


LEAF_PATHS = {path for path, _, _ in fields.leaf_fields()}


def _leaves(d: dict, prefix: str = ""):
    """(path, value) of every field a config file sets (a mapping-valued field is one leaf)."""
    for k, v in d.items():
        path = f"{prefix}{k}"
        yield from _leaves(v, f"{path}.") if isinstance(v, dict) and path not in LEAF_PATHS else [(path, v)]


def test_a_module_in_the_current_directory_is_found_by_the_sc_grpo_script(tmp_path, monkeypatch, capsys):
    """The console script's sys.path holds its own directory, not the current one: `main` adds it."""
    from single_controller.runtime.cli import main

    (tmp_path / "my_reward_mod_xyz.py").write_text("def score(prompt, text):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["config", str(ROOT / "configs/sim.yaml"), "task.reward_fn=my_reward_mod_xyz:score"]) == 0
    assert "reward_fn: my_reward_mod_xyz:score" in capsys.readouterr().out


def test_math_verify_example_data_scores_its_own_solutions_right_and_wrong_answers_wrong():
    pytest.importorskip("math_verify", reason="the verifiers extra")
    from single_controller.data.verifiers import math_verify

    rows = [json.loads(line) for line in (EXAMPLES / "math_verify/problems.jsonl").read_text().splitlines()]
    assert len(rows) == 300 and len({r["id"] for r in rows}) == 300
    gold = [r["answer"] for r in rows]
    assert math_verify([r["prompt"] for r in rows], [r["solution"] for r in rows], gold) == [1.0] * 300
    wrong = [f"\\boxed{{{a} + 1}}" for a in gold]  # another number
    assert math_verify([r["prompt"] for r in rows], wrong, gold) == [0.0] * 300


@pytest.mark.parametrize(
    "config, split",
    [
        ("config.yaml", "1 torch trainer rank(s) and 1 vLLM worker(s) need 1 GPU(s) (shared: colocated)"),
        ("two_gpu.yaml", "1 fsdp trainer rank(s) and 1 vLLM worker(s) need 2 GPU(s) (one each)"),
        ("eight_gpu.yaml", "6 fsdp trainer rank(s) and 2 vLLM worker(s) need 8 GPU(s) (one each)"),
    ],
)
def test_the_gsm8k_recipe_states_its_gpu_split_and_refuses_every_gpu_to_the_trainer(config, split, monkeypatch):
    """Issue #54 acceptance 3: `sc-grpo config` reports each recipe config's GPU split; on its GPUs it
    fits, and the 8-GPU config with every GPU given to the trainer is refused, naming the workers left out."""
    import torch

    from single_controller.preflight.environment import gpu_split, roles_fit_the_gpus

    path = str(EXAMPLES / "gsm8k" / config)
    cfg = load_config(path, [])
    assert gpu_split(cfg) == (split, int(split.split(" need ")[1].split()[0]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_split(cfg)[1])
    assert roles_fit_the_gpus(cfg) == []
    if config == "eight_gpu.yaml":
        (problem,) = roles_fit_the_gpus(load_config(path, ["backend.num_trainer_ranks=8"]))
        assert "leaves none to the generation workers" in problem.message
