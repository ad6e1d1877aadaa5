"""The embedded run with evaluation on, as a user runs it: accuracy rises from zero, a point at the start, every
10 versions and at the end (issue 14)."""

from __future__ import annotations

import sys

import pytest

from single_controller.data.tasks import EVAL_DATASETS


@pytest.mark.slow
@pytest.mark.ray
def test_embedded_run_with_eval_reports_accuracy_rising_from_zero(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(root / "configs/embedded_eval.yaml"),
        f"run.output_dir={tmp_path}",
        "run.progress_bar=false",
        "metrics.port=0",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("embedded_eval-*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/policy_version" in r]
    steps = [r for r in records if "step" in r]
    versions = [r["eval/policy_version"] for r in evals]
    # the start, every 10 versions (a round that met a weight update lands a version later), the end
    assert versions[0] == 0 and versions[-1] == len(steps), versions
    assert all(b > a for a, b in zip(versions, versions[1:])) and len(evals) >= len(steps) // 10
    # random init answers no held-out prompt exactly; the trained policy (stopped at a 0.9 training
    # success rate, sampled at temperature 1) answers >= 0.9 of them greedily (measured 1.0)
    assert evals[0]["eval/accuracy"] <= 0.05, evals[0]
    assert evals[-1]["eval/accuracy"] >= 0.9, evals[-1]
    for r in evals:
        assert r["eval/prompts"] == 64 and r["eval/tokens"] == 64 * 3 and r["eval/seconds"] > 0
        assert r["eval/pass@1"] == r["eval/accuracy"]  # one greedy sample per prompt
    assert f"eval v{versions[-1]} | accuracy" in proc.stdout
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    held_out = {tuple(p.token_ids) for p in EVAL_DATASETS["reverse_digits.held_out"](64, 3, 0)}
    assert ledger and not any(tuple(p["token_ids"]) in held_out for p in ledger)  # never trained on
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["storage"]["resident_rows"] == 0
    assert summary["eval"]["eval/policy_version"] == versions[-1]
    assert (run_dir / "curves.png").exists()
