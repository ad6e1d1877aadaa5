"""`sc-grpo bench trl`: sc-grpo against TRL's synchronous `GRPOTrainer` on the identical model,
prompts, reward and hyper-parameters, side by side in one invocation.

Per size (`tiny`, `small`: GPT-2 directories `sc-grpo init-model` writes, one per seed) and seed, TRL
(`single_controller.bench.trl_loop`) and `sc-grpo run` run one after the other, the order alternating;
`tiny` trains to the success target, `small` a fixed number of steps. Reported: steps, training,
start-up and whole-command seconds, seconds per step, busy cores; per size `speed` (TRL's s/step over
sc-grpo's) and `whole` (sc-grpo's command over TRL's), for each of `--modes` (`disaggregated`,
`colocated`). Both sides share every setting the harness prints. Needs `pip install 'sc-grpo[bench]'`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_layers=2, head_dim=32),  # ~0.1 M parameters
    "small": dict(hidden_size=256, num_layers=4, head_dim=64),  # ~3.2 M parameters
}

SHARED: dict[str, Any] = dict(
    task="reverse_digits",
    num_digits=3,
    num_prompts=1000,
    group_size=16,
    prompts_per_step=16,
    lr=1e-3,
    betas=(0.9, 0.99),
    clip_eps=0.2,
    grad_clip=1.0,
    target=0.9,
    window=5,
)

_LINE = re.compile(r"(?:TRL|sc-grpo): (\d+) steps in ([\d.]+)s of training \(\+([\d.]+)s startup\): (.*)")


@dataclass(frozen=True)
class Result:
    who: str
    size: str
    seed: int
    steps: int
    train_s: float
    startup_s: float
    whole_s: float
    cores: float  # busy CPU seconds / wall seconds, the whole machine
    outcome: str

    @property
    def step_s(self) -> float:
        return self.train_s / max(1, self.steps)


def _busy_jiffies() -> int:
    """Busy jiffies of all CPUs since boot (/proc/stat: user, nice, system, irq, softirq; idle and
    iowait are not busy, and steal, time the hypervisor gave to others, is not ours)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    return parts[0] + parts[1] + parts[2] + sum(parts[5:7])


def _timed(cmd: Sequence[str]) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """Run `cmd`: (its process, wall seconds, cores busy meanwhile)."""
    b0 = _busy_jiffies()
    t0 = time.perf_counter()
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    b1 = _busy_jiffies()
    hz = os.sysconf("SC_CLK_TCK")
    return proc, wall, (b1 - b0) / hz / wall


def write_model(directory: Path, size: str, seed: int) -> Path:
    from transformers.utils import logging as hf_logging

    from single_controller.data.hf_model import init_model

    hf_logging.disable_progress_bar()
    if not (directory / "config.json").exists():
        dims = SIZES[size]
        init_model(
            str(directory),
            arch="gpt2",
            tokenizer="char",
            seed=seed,
            max_positions=32,
            hidden_size=dims["hidden_size"],
            num_layers=dims["num_layers"],
            head_dim=dims["head_dim"],
        )
    return directory


def trl_command(model: Path, seed: int, steps: int | None, max_steps: int) -> list[str]:
    s = SHARED
    cmd = [sys.executable, "-m", "single_controller.bench.trl_loop", str(model), f"--seed={seed}"]
    cmd += [f"--task={s['task']}", f"--num-digits={s['num_digits']}", f"--num-prompts={s['num_prompts']}"]
    cmd += [f"--group-size={s['group_size']}", f"--prompts-per-step={s['prompts_per_step']}", f"--lr={s['lr']}"]
    cmd += ["--betas", *(str(b) for b in s["betas"]), f"--clip-eps={s['clip_eps']}", f"--grad-clip={s['grad_clip']}"]
    cmd += [f"--target={s['target']}", f"--window={s['window']}", f"--max-steps={max_steps}"]
    return cmd + ([f"--steps={steps}"] if steps else [])


def sc_grpo_overrides(model: Path, seed: int, steps: int | None, max_steps: int, out: str) -> list[str]:
    s = SHARED
    ov = [
        f"model.path={model}",
        f"seed={seed}",
        f"task.name={s['task']}",
        f"task.num_digits={s['num_digits']}",
        f"task.num_prompts={s['num_prompts']}",
        f"rollout.group_size={s['group_size']}",
        f"train.groups_per_step={s['prompts_per_step']}",
        f"train.lr={s['lr']}",
        f"train.betas=[{s['betas'][0]},{s['betas'][1]}]",
        "train.lr_schedule=constant",
        f"train.clip_eps={s['clip_eps']}",
        f"train.grad_clip={s['grad_clip']}",
        "train.loss_agg=token_mean",
        "train.kl_coef=0.0",
        "model.dtype=float32",
        "train.gradient_checkpointing=false",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.stop_at_eos=true",
        f"rollout.max_new_tokens={s['num_digits']}",
        f"run.success_window={s['window']}",
        f"run.output_dir={out}",
        "run.progress_bar=false",
        "run.plot=false",
    ]
    if steps:
        ov += [f"run.max_steps={steps}", "run.stop_at_success_rate=null"]
    else:
        ov += [f"run.max_steps={max_steps}", f"run.stop_at_success_rate={s['target']}"]
    return ov


def _parse(who: str, size: str, seed: int, proc: subprocess.CompletedProcess[str], wall: float, cores: float) -> Result:
    found = [m for m in map(_LINE.search, proc.stdout.splitlines()) if m]
    if proc.returncode != 0 or not found:
        tail = (proc.stdout[-1500:] + proc.stderr[-2500:]).strip()
        raise RuntimeError(f"{who} ({size}, seed {seed}) failed (exit {proc.returncode}):\n{tail}")
    m = found[-1]
    return Result(who, size, seed, int(m[1]), float(m[2]), float(m[3]), wall, cores, m[4].strip())


MODES = {"disaggregated": "backend.colocate=false", "colocated": "backend.colocate=true"}


def run_pair(size: str, seed: int, model: Path, args: argparse.Namespace) -> list[Result]:
    """TRL and sc-grpo in each of `args.modes` on one model; the order alternates with the seed."""
    steps = args.small_steps if size == "small" else None
    ours = [f"sc-grpo {m}" for m in args.modes]
    order = ["trl", *ours] if seed % 2 == 0 else [*ours, "trl"]
    rows: list[Result] = []
    for who in order:
        if who == "trl":
            proc, wall, cores = _timed(trl_command(model, seed, steps, args.max_steps))
        else:
            with tempfile.TemporaryDirectory() as out:
                ov = [*sc_grpo_overrides(model, seed, steps, args.max_steps, out), MODES[who.split()[1]]]
                cmd = [sys.executable, "-m", "single_controller", "run", args.config, *ov, *args.overrides]
                proc, wall, cores = _timed(cmd)
        rows.append(_parse(who, size, seed, proc, wall, cores))
        print(_row_line(rows[-1]), flush=True)
    return rows


def _row_line(r: Result) -> str:
    return (
        f"{r.size:<6} seed {r.seed} {r.who:<22} {r.steps:>4} steps  training {r.train_s:7.2f} s  "
        f"{r.step_s:6.3f} s/step  start-up {r.startup_s:5.1f} s  whole {r.whole_s:6.1f} s  "
        f"cores busy {r.cores:4.2f}  ({r.outcome})"
    )


def summarize(results: Sequence[Result]) -> list[str]:
    lines = []
    for size, who in dict.fromkeys((r.size, r.who) for r in results if r.who != "trl"):
        trl = [r for r in results if r.size == size and r.who == "trl"]
        ours = [r for r in results if r.size == size and r.who == who]
        speed = statistics.mean(t.step_s / o.step_s for t, o in zip(trl, ours))
        whole = statistics.mean(o.whole_s / t.whole_s for t, o in zip(trl, ours))
        to_target = ""
        if size != "small":
            ratios = [t.train_s / o.train_s for t, o in zip(trl, ours)]
            to_target = f", time to the target: TRL / sc-grpo {statistics.mean(ratios):.2f}x"
        lines.append(
            f"{size}, {who}: speed per step TRL / sc-grpo {speed:.2f}x (target >= 1.2){to_target}; "
            f"whole command sc-grpo / TRL {whole:.2f} (target <= 1.0); steps TRL "
            f"{statistics.mean(t.steps for t in trl):.0f}, sc-grpo {statistics.mean(o.steps for o in ours):.0f}"
        )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sc-grpo bench trl",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--small-steps", type=int, default=30, help="steps of each `small` run (fixed)")
    p.add_argument("--max-steps", type=int, default=400, help="`tiny`: give up after this many steps")
    p.add_argument("--config", default="configs/embedded.yaml", help="sc-grpo's config")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="sc-grpo's modes to run")
    p.add_argument("--models", default=None, help="where the model directories go (default: a temporary folder)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="sc-grpo overrides, e.g. a mode")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = p.parse_args([a for a in argv if a not in overrides])
    args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("sc-grpo bench trl needs TRL: pip install 'sc-grpo[bench]'", file=sys.stderr)
        return 2
    import trl as trl_module

    print(__doc__.splitlines()[0])
    shared = ", ".join(f"{k}={v}" for k, v in SHARED.items())
    print(f"shared: {shared}, float32, no gradient checkpointing, no KL, constant lr, stop at EOS")
    print(f"TRL {trl_module.__version__} GRPOTrainer; sc-grpo: {args.config} {' '.join(args.overrides)}".rstrip())
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.models or tmp)
        for size in args.sizes:
            for seed in args.seeds:
                model = write_model(root / f"gpt2-{size}-seed{seed}", size, seed)
                results += run_pair(size, seed, model, args)
    for line in summarize(results):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
