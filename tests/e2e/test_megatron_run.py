"""`sc-grpo run configs/megatron_cpu.yaml` as a user runs it (issue 11, acceptance 8): two Megatron
ranks over gloo train a few steps of the tiny GPT-2; the run exits 0 with its records, and no process
of the run (Ray's, the rank actors', the generation worker's) outlives it.

The full acceptance run (to a 0.9 success rate, beside the torch trainer) is measured by hand, not
here: see docs/megatron.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.process_tree import ProcessTree

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]
ROOT = Path(__file__).resolve().parents[2]


def test_megatron_cpu_run_trains_and_no_process_outlives_it(tmp_path):
    from single_controller.data import hf_model

    model_dir = hf_model.init_model(tmp_path / "tiny-gpt2", arch="gpt2", seed=0)  # as the config's model.create
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "single_controller",
            "run",
            str(ROOT / "configs/megatron_cpu.yaml"),
            f"run.output_dir={tmp_path}",
            "run.progress_bar=false",
            "run.plot=false",
            "metrics.port=0",
            f"model.path={model_dir}",
            "model.create=false",
            "run.max_steps=4",
            "run.stop_at_success_rate=null",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    tree, out = ProcessTree.follow(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    assert sum("MegatronRankActor" in c for c in tree.seen.values()) == 2, tree.seen  # both ranks ran
    (run_dir,) = list(tmp_path.glob("megatron_cpu-*"))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["storage"]["resident_rows"] == 0, "rows left in TransferQueue"
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    leaked = tree.alive(20)
    assert not leaked, f"processes of the run left behind: {leaked}"
