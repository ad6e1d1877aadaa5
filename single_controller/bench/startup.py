"""`sc-grpo bench startup`: a run's start-up, split by phase and process, beside its floor.

Each round, in one invocation and in turn:
- **the run**: `sc-grpo run CONFIG run.max_steps=1` as a user runs it; its start-up is the time from
  launching the command to its `started in ...; training` line. Every process of the run marks its
  start-up into a trace (`single_controller.startup_trace`): when it was spawned, when its
  constructor ran (its imports done), and what the controller waited on;
- **the floor**: a fresh process's bare `ray.init()` (launch to connected) plus a fresh process
  importing torch (launch to exit): what any Ray run whose workers use torch pays at least. A bare
  `ray.init()` also starts Ray's dashboard, which a run does not: the stricter floor beside it
  starts Ray as a run does (`include_dashboard=False`), and the ratio is given against both.

It prints each round's figures and ratio, the median, and the split of the median round: each
process's marks in seconds from the launch, so what is waited on and what runs side by side can be
read off. Run it on a quiet machine: a parallel job distorts every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from single_controller.startup_trace import TRACE_ENV, read_marks

READY_LINE = "started in"
RAY_BARE = "import ray; ray.init(); print('connected', flush=True); ray.shutdown()"
RAY_AS_A_RUN = "import ray; ray.init(include_dashboard=False); print('connected', flush=True); ray.shutdown()"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sc-grpo bench startup", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/embedded.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the run")
    args = ap.parse_args(argv)
    print(f"start-up of `sc-grpo run {args.config}` beside the floor (bare ray.init() + a process importing torch)")
    rounds = [_round(i, args) for i in range(args.rounds)]
    median = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]
    figures = {k: statistics.median(r[k] for r in rounds) for k in ("run", "bare", "strict", "bare_ratio", "ratio")}
    print(
        "median: run {run:.2f} s | floor {bare:.2f} s with a bare ray.init(), ratio {bare_ratio:.2f} | "
        "floor {strict:.2f} s with ray.init as a run starts it, ratio {ratio:.2f} (target <= 1.5)".format(**figures)
    )
    print(f"\nthe split of the median round (ratio {median['ratio']:.2f}), seconds from the launch:")
    for line in split_lines(median["marks"]):
        print(line)
    return 0


def _round(i: int, args: argparse.Namespace) -> dict:
    run_s, marks = _run_startup(args.config, args.overrides)
    bare = _until_line([sys.executable, "-c", RAY_BARE], "connected")
    strict = _until_line([sys.executable, "-c", RAY_AS_A_RUN], "connected")
    torch_s = _whole([sys.executable, "-c", "import torch"])
    r: dict = {"run": run_s, "bare": bare + torch_s, "strict": strict + torch_s, "marks": marks}
    r["bare_ratio"], r["ratio"] = run_s / (bare + torch_s), run_s / (strict + torch_s)
    print(
        f"round {i + 1}: run {run_s:.2f} s | ray.init bare {bare:.2f} s, as a run {strict:.2f} s | torch import "
        f"{torch_s:.2f} s | ratio {r['bare_ratio']:.2f} to the bare floor, {r['ratio']:.2f} to the strict one",
        flush=True,
    )
    return r


def _run_startup(config: str, overrides: list[str]) -> tuple[float, list[dict]]:
    """The run's start-up (launch to its ready line) and its trace, launch first."""
    with tempfile.TemporaryDirectory() as out:
        trace = os.path.join(out, "startup.jsonl")
        cmd = [sys.executable, "-m", "single_controller", "run", config, "run.max_steps=1"]
        cmd += [f"run.output_dir={out}", "run.progress_bar=false", "run.plot=false", *overrides]
        t0 = time.time()
        env = {**os.environ, TRACE_ENV: trace}
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            ready = None
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if ready is None and READY_LINE in line:
                    ready = time.time() - t0
            code = proc.wait()
        if code != 0 or ready is None:
            raise SystemExit(f"the run failed (exit {code}):\n{''.join(lines)[-3000:]}")
        marks = read_marks(trace) if Path(trace).exists() else []
        return ready, [{"t": t0, "pid": 0, "role": "bench", "what": "launch"}, *marks]


def _until_line(cmd: list[str], line: str) -> float:
    """Seconds from launching `cmd` until it prints `line` (it then runs to its end)."""
    t0 = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        for out in proc.stdout:
            if line in out:
                seconds = time.time() - t0
                proc.wait()
                return seconds
    raise SystemExit(f"{cmd!r} never printed {line!r}")


def _whole(cmd: list[str]) -> float:
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - t0


def split_lines(marks: list[dict]) -> list[str]:
    """One line per process: its marks as `what @ seconds from the launch`, in order of its spawn."""
    if not marks:
        return ["(no trace: this run's processes wrote no marks)"]
    t0 = marks[0]["t"]
    by_process: dict[tuple[str, int], list[dict]] = {}
    for m in marks[1:]:
        by_process.setdefault((m["role"], m["pid"]), []).append(m)
    out = []
    for (role, pid), ms in sorted(by_process.items(), key=lambda kv: kv[1][0]["t"]):
        steps = " | ".join(f"{m['what']} {m['t'] - t0:.2f}" for m in ms)
        out.append(f"  {role:<15} pid {pid:<7} {steps}")
    return out
