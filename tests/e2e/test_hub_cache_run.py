"""A short `sc-grpo run` by Hub names alone (issue #54, acceptance 1): `model.path: org/tiny-chat` and
`data.train_files: [openai/gsm8k]` found in a Hugging Face cache laid out on disk (no network), GSM8K's
rows through `data.map: gsm8k`, scored by `math_verify`; and the refusal of a name the cache lacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="a Hugging Face model needs transformers (the `hf` extra)")
pytest.importorskip("pyarrow", reason="the cached dataset is parquet")

from single_controller.config.schema import ModelConfig  # noqa: E402
from single_controller.data import hf_model  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = [
    {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
    for a in range(1, 5)
    for b in range(1, 5)
]


def _lay_out_cache(hub: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = hub / "models--org--tiny-chat"
    snapshot = model / "snapshots" / COMMIT
    cfg = ModelConfig(path=str(snapshot), create=True, arch="qwen3", n_heads=2, max_seq_len=128)
    assert hf_model.prepare_model_dir(cfg, seed=0, data_files=True)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(COMMIT)
    data = hub / "datasets--openai--gsm8k"
    (data / "snapshots" / COMMIT / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), data / "snapshots" / COMMIT / "main" / "train-00000-of-00001.parquet")
    (data / "refs").mkdir()
    (data / "refs" / "main").write_text(COMMIT)


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    exe = shutil.which("sc-grpo") or str(Path(sys.executable).with_name("sc-grpo"))
    args = [
        "model.path=org/tiny-chat",
        "model.create=false",
        "data.train_files=[openai/gsm8k]",
        "data.subset=main",
        "data.map=gsm8k",
        "data.id_key=null",
        "train.groups_per_step=4",
        "run.max_steps=2",
        "run.stop_at_success_rate=null",
        f"run.output_dir={tmp_path / 'runs'}",
        "run.progress_bar=false",
        "run.plot=false",
        "metrics.port=0",
        *overrides,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [exe, "run", "examples/math_verify/config.yaml", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_by_hub_names_trains_from_the_local_cache_and_a_missing_name_says_how_to_get_it(tmp_path):
    _lay_out_cache(tmp_path / "hub")
    proc = _run(tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").glob("math_verify-*")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert [r["step"] for r in steps] == [0, 1] and all(r["train/tokens"] > 0 for r in steps)
    missing = _run(tmp_path, "model.path=org/not-cached")
    assert missing.returncode != 0
    text = " ".join((missing.stdout + missing.stderr).split())
    assert "huggingface-cli download org/not-cached" in text and "models--org--not-cached" in text
