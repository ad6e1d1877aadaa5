"""Lint, format and types of the code, as part of the test command (CI runs them here).

`ruff check` and `ruff format --check` (rules in pyproject's `[tool.ruff]`) over the packages, the
tests and the examples; `mypy` (`[tool.mypy]`) over the four packages. Both tools are pinned in the
test extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINTED = ["single_controller", "pumps", "samplers", "replay", "tests", "examples"]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_check_is_clean():
    proc = _run("ruff", "check", "--no-cache", *LINTED, timeout=120)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    proc = _run("ruff", "format", "--check", "--no-cache", *LINTED, timeout=120)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


@pytest.mark.timeout(600)
def test_mypy_is_clean_over_the_packages():
    proc = _run("mypy", "--no-incremental", timeout=580)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
