"""Checks on what a whole run leaves behind and on the processes of a run under way, shared by the
end-to-end tests. Not a test module."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import psutil


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
