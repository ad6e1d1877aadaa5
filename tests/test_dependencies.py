"""Install hygiene: every third-party import of the package is a declared dependency, checked by deptry
(https://deptry.com, configured under `[tool.deptry]` in pyproject.toml), and every declared
dependency is imported somewhere. That the default install needs none of the extras is checked by
`.ci/run`'s readme1 phase (README command 1 in a fresh virtual environment; see tests/test_ci.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def deptry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deptry", ".", "--no-ansi", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_every_import_of_the_package_is_a_declared_dependency():
    result = deptry()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No dependency issues found" in result.stdout + result.stderr


def test_an_undeclared_import_fails_the_check(tmp_path):
    """The check can fail: with tqdm (imported by run_output) left out of the dependencies, deptry
    names the import (DEP001 where tqdm is not installed, DEP003 where something else brought it)."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines(keepends=True)
    without = [line for line in lines if not line.strip().startswith('"tqdm"')]
    assert len(without) == len(lines) - 1, "pyproject.toml should declare tqdm on a line of its own"
    (tmp_path / "pyproject.toml").write_text("".join(without))
    result = deptry("--config", str(tmp_path / "pyproject.toml"))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "single_controller/run_output.py" in out and "'tqdm' imported but" in out, out
