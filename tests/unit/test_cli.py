"""The `sc-grpo` command line: dispatch, exit codes, and no tracebacks for user errors."""

from __future__ import annotations

import sys
import tomllib
import types
from pathlib import Path

import pytest

from single_controller.config.schema import Config
from single_controller.preflight.loader import load_config
from single_controller.runtime import cli

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = str(ROOT / "configs/embedded.yaml")


def fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_console_script_points_at_main():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["sc-grpo"] == "single_controller.runtime.cli:main"


def test_help_describes_every_command_with_an_example(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "config", "bench", "status"):
        assert f"sc-grpo {command} " in out
    assert "configs/embedded.yaml" in out


@pytest.mark.parametrize("command", ["run", "config", "bench", "status"])
def test_each_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert "example" in capsys.readouterr().out


def test_config_prints_the_resolved_yaml(capsys, tmp_path):
    assert cli.main(["config", EMBEDDED, "train.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(out)
    assert load_config(str(dumped), []) == load_config(EMBEDDED, ["train.lr=3e-4"])


def test_config_lists_what_this_machine_lacks_on_stderr_and_still_succeeds(capsys, tmp_path):
    # the hf_model example promises that `sc-grpo config` reports what a model directory lacks
    empty = tmp_path / "model"
    empty.mkdir()
    assert cli.main(["config", str(ROOT / "examples/hf_model/config.yaml"), f"model.path={empty}"]) == 0
    out, err = capsys.readouterr()
    assert f"path: {empty}" in out  # the resolved config, as always
    assert "`sc-grpo run` would refuse it" in err and "has no config.json" in err and "no tokenizer" in err
    assert cli.main(["config", EMBEDDED]) == 0
    assert capsys.readouterr().err == ""  # nothing lacking: nothing said


def test_config_reference(capsys):
    assert cli.main(["config", "--reference"]) == 0
    assert "### `train`" in capsys.readouterr().out


def test_invalid_config_exits_2_with_every_problem_and_no_traceback(capsys):
    assert cli.main(["config", EMBEDDED, "train.lrr=1", "sampler.order=x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "2 problems" in captured.err
    assert "did you mean 'train.lr'?" in " ".join(captured.err.split())
    assert "sampler.order" in captured.err
    assert "Traceback" not in captured.err


def test_config_without_a_file_is_a_usage_error(capsys):
    assert cli.main(["config"]) == 2
    assert "usage: sc-grpo config" in capsys.readouterr().err


def test_run_hands_the_validated_config_to_the_launcher(monkeypatch):
    received: list[Config] = []

    def run_from_config(cfg):
        received.append(cfg)
        return 3

    fake_module(monkeypatch, "single_controller.runtime.driver", run_from_config=run_from_config)
    assert cli.main(["run", EMBEDDED, "run.max_steps=5"]) == 3
    assert received == [load_config(EMBEDDED, ["run.max_steps=5"])]


def test_run_with_an_invalid_config_never_launches(monkeypatch, capsys):
    fake_module(
        monkeypatch,
        "single_controller.runtime.driver",
        run_from_config=lambda cfg: pytest.fail("launched an invalid config"),
    )
    assert cli.main(["run", EMBEDDED, "rollout.group_size=1"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


def test_run_without_a_launcher_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "single_controller.runtime.driver", None)  # import fails: not installed
    assert cli.main(["run", EMBEDDED]) == 1
    err = capsys.readouterr().err
    assert "single_controller.runtime.driver:run_from_config is not available" in err
    assert "Traceback" not in err


def test_ctrl_c_during_run_exits_130(monkeypatch, capsys):
    def run_from_config(cfg):
        raise KeyboardInterrupt

    fake_module(monkeypatch, "single_controller.runtime.driver", run_from_config=run_from_config)
    assert cli.main(["run", EMBEDDED]) == 130
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, module, attr",
    [
        ("overlap", "single_controller.bench.runner", "main_overlap"),
        ("reference", "single_controller.bench.reference_loop", "main"),
        ("storage", "single_controller.bench.tq", "main"),
    ],
)
def test_bench_dispatches_with_the_remaining_arguments(monkeypatch, name, module, attr):
    calls = []
    fake_module(monkeypatch, module, **{attr: lambda argv: calls.append(argv) or 7})
    assert cli.main(["bench", name, "--steps", "3", "extra"]) == 7
    assert calls == [["--steps", "3", "extra"]]


def test_bench_with_a_missing_entry_point_says_which(monkeypatch, capsys):
    fake_module(monkeypatch, "single_controller.bench.tq")  # the module exists, its main does not
    assert cli.main(["bench", "storage"]) == 1
    err = capsys.readouterr().err
    assert "single_controller.bench.tq:main is not available" in err and "has no 'main'" in err


def test_unknown_benchmark_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "nope"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_broken_import_inside_an_existing_module_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "broken_bench_mod.py").write_text("import a_dependency_that_is_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed_xyz"):
        cli._load_entry_point("broken_bench_mod:main")


def test_status_forwards_the_url(monkeypatch):
    calls = []
    fake_module(monkeypatch, "single_controller.runtime.status", main=lambda argv: calls.append(argv) or 0)
    assert cli.main(["status", "--url", "http://127.0.0.1:1234"]) == 0
    assert cli.main(["status"]) == 0
    assert calls == [["--url", "http://127.0.0.1:1234"], []]


def test_status_forwards_watch_and_timeout_as_the_docs_use_them(monkeypatch):
    calls = []
    fake_module(monkeypatch, "single_controller.runtime.status", main=lambda argv: calls.append(argv) or 0)
    assert cli.main(["status", "--url", "10.0.0.1:9464", "--watch", "2", "--timeout", "0.5"]) == 0
    assert calls == [["--url", "10.0.0.1:9464", "--watch", "2.0", "--timeout", "0.5"]]


def test_status_through_the_cli_reaches_the_real_tool(capsys):
    # nothing listens on port 1: the real status tool answers with its own message, after the
    # timeout given on the `sc-grpo status` command line
    assert cli.main(["status", "--url", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "127.0.0.1:1" in err and "Traceback" not in err


def test_argument_mistakes_in_reference_and_init_model_are_usage_errors_not_tracebacks(tmp_path, capsys):
    from single_controller.bench import reference_loop as reference
    from single_controller.data.hf_model import main_init_model

    with pytest.raises(SystemExit) as info:
        reference.main(["--task", "sort_digits", "--seeds", "0"])
    assert info.value.code == 2 and "unknown task 'sort_digits'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main_init_model([str(tmp_path / "m"), "--hidden-size", "48"])
    assert info.value.code == 2 and "--hidden-size 48 is not a multiple of --head-dim 32" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before writing anything


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "usage: sc-grpo bench [-h] NAME [ARGS ...]" in err
    assert (
        "give a benchmark NAME: overlap, reference, storage, scale, embedded, startup, sync, trl, eval" in err
        and "ARGS" not in err.splitlines()[-1]
    )


def test_config_reports_the_gpu_split_of_a_gpu_config(capsys):
    """Issue #54 acceptance 3: `sc-grpo config` says how the roles take GPUs (nothing for a CPU run)."""
    megatron = str(ROOT / "configs/megatron_cpu.yaml")
    gpu = ["megatron.cpu_emulation=false", "backend.generation=vllm", "vllm.device=cuda", "model.path=/m"]
    split = ["backend.num_trainer_ranks=7", "megatron.data_parallel_size=7", "megatron.tensor_parallel_size=1"]
    assert cli.main(["config", megatron, *gpu, *split]) == 0
    err = capsys.readouterr().err
    assert "GPUs: 7 megatron trainer rank(s) and 1 vLLM worker(s) need 8 GPU(s) (one each)" in err
