"""Install hygiene: every third-party import of the package is a declared dependency, checked by deptry
(https://deptry.com, configured under `[tool.deptry]` in pyproject.toml), and every declared
dependency is imported somewhere. That the default install needs none of the extras is checked by
`.ci/run`'s readme1 phase (README command 1 in a fresh virtual environment; see tests/integration/test_ci.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def deptry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deptry", ".", "--no-ansi", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_every_import_of_the_package_is_a_declared_dependency():
    result = deptry()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No dependency issues found" in result.stdout + result.stderr


def test_an_undeclared_import_fails_the_check(tmp_path):
    """The check can fail: with tqdm (imported by runtime/console.py) left out of the dependencies, deptry
    names the import (DEP001 where tqdm is not installed, DEP003 where something else brought it)."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines(keepends=True)
    without = [line for line in lines if not line.strip().startswith('"tqdm"')]
    assert len(without) == len(lines) - 1, "pyproject.toml should declare tqdm on a line of its own"
    (tmp_path / "pyproject.toml").write_text("".join(without))
    result = deptry("--config", str(tmp_path / "pyproject.toml"))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "single_controller/runtime/console.py" in out and "'tqdm' imported but" in out, out


# The extras' packages (pyproject.toml's optional dependencies beyond the defaults), as imported.
EXTRA_MODULES = (
    "transformers",
    "tokenizers",
    "vllm",
    "megatron",
    "tensorboard",
    "wandb",
    "math_verify",
    "reasoning_gym",
)  # not pyarrow (the `data` extra): the default install's TransferQueue probes for it with find_spec
IMPORT_ALL_WITHOUT_EXTRAS = f"""
import importlib, json, pkgutil, sys

class BlockExtras:  # as if no extra were installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRA_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, BlockExtras())
imported, failed = [], []
for pkg in ("single_controller", "pumps", "samplers", "replay"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if info.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except ImportError as e:
            failed.append(f"{{info.name}}: {{e}}")
print(json.dumps({{"imported": imported, "failed": failed}}))
"""


def test_every_module_imports_without_the_extras():
    """deptry knows no extra from another; this does: an extra's package is imported only where it
    is used (inside the backend that needs it), so every module of the default install imports, and
    a config that needs a missing extra is refused naming it (config_loader.environment_problems)."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL_WITHOUT_EXTRAS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["failed"] == [], "modules importing an extra's package at import time:\n" + "\n".join(out["failed"])
    assert {
        "single_controller.backends.vllm.worker",
        "single_controller.backends.megatron.trainer",
        "single_controller.data.hf_model",
        "single_controller.runtime.cli",
    } <= set(out["imported"])
