"""Checks on what a whole run leaves behind and on the processes of a run under way, shared by the
end-to-end tests; pool files and the pool timeline's one-run-per-slot check (the pool tests). Not a test module."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import psutil
import yaml


def check_exactly_once(run_dir: Path, steps: int, per_step: int) -> None:
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    assert len({p["prompt_id"] for p in ledger}) == len(ledger), "a prompt appears twice in the ledger"
    assert all(p["fate"] in ("trained", "dropped", "evicted") for p in ledger), "a prompt has no fate (lost)"
    trained = Counter(p["step"] for p in ledger if p["fate"] == "trained")
    assert trained == {s: per_step for s in range(steps)}, trained
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps)), "metrics steps are not 0..N-1 once each"


def session_procs(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return out


def actor_pids(session: int, cls: str) -> list[int]:
    out = []
    for p in session_procs(session):
        try:
            if " ".join(p.cmdline()).startswith(f"ray::{cls}") or p.name().startswith(f"ray::{cls}"[:15]):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def pool_file(tmp_path: Path, runs: list[dict], **top) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "pools"), **top, "runs": runs}), encoding="utf-8")
    return path


def resident_runs(timeline: list[list]) -> dict[int, list[tuple[float, str, str | None]]]:
    by_slot: dict[int, list[tuple[float, str, str | None]]] = {}
    for t, slot, state, run in timeline:
        by_slot.setdefault(int(slot), []).append((t, state, run))
    return by_slot


def check_one_run_per_slot(timeline: list[list]) -> None:
    """A slot goes from one run to another only through a state that holds nobody (idle) or the
    train state: never from run A's worker straight to run B's."""
    for slot, events in resident_runs(timeline).items():
        holder = None
        for t, state, run in events:
            if state in ("gen", "switching"):
                assert holder in (None, run), f"slot {slot} at {t:.3f}s: {run} moved in while {holder} was there"
                holder = run
            else:  # idle or train: the generation worker that was there has left
                holder = None
