"""Assertions of the functional scripts on what a run leaves in its directory (one subcommand each).

    python tests/e2e/functional/check.py SUBCOMMAND RUN_DIR [options]

Each subcommand exits 0 when its property holds, else prints `check <name>: <what is wrong>` (one
readable paragraph, with the numbers) and exits 1. It reads only the run directory:
`config.yaml` (the resolved config), `metrics.jsonl`, `prompt_ledger.json`, `summary.json`,
`checkpoints/`. A script, not a module of a package: tests/ is not a Python package.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path


class CheckFailed(Exception):
    pass


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


def records(run: Path) -> list[dict]:
    """The per-step records of metrics.jsonl (eval records, which have no train keys, left out)."""
    out = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in out if "rollout/reward_mean" in r]


def config(run: Path):
    from single_controller.preflight.loader import load_config

    return load_config(str(run / "config.yaml"), [])


def ledger(run: Path) -> list[dict]:
    return json.loads((run / "prompt_ledger.json").read_text())["prompts"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def trained_by_step(prompts: list[dict]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for p in prompts:
        if p["fate"] == "trained":
            out[p["step"]].append(p["prompt_id"])
    return out


# --------------------------------------------------------------------------------------------
def check_finished(run: Path, a) -> str:
    """The run ended as asked: its stop reason, `steps` steps, no failure, no storage key left."""
    s = summary(run)
    require(s.get("failure") is None, f"the run failed: {s.get('failure')}")
    require(s["stop_reason"] == a.stop_reason, f"stop reason {s['stop_reason']!r}, expected {a.stop_reason!r}")
    require(s["steps"] == a.steps, f"summary.json says {s['steps']} steps, expected {a.steps}")
    require(
        s["storage_keys_left"] == 0,
        f"{s['storage_keys_left']} storage keys left after the run, e.g. {s.get('storage_keys_left_sample')}",
    )
    require(s.get("teardown_errors") == [], f"teardown errors: {s.get('teardown_errors')}")
    ck = s.get("checkpoint") or {}
    require(
        ck.get("step") == a.steps and Path(ck.get("path", "")).is_dir(), f"no final checkpoint of step {a.steps}: {ck}"
    )
    require((run / "checkpoint" / "config.json").is_file(), "no final policy (checkpoint/config.json)")
    return f"finished: {s['steps']} steps, '{s['stop_reason']}', 0 storage keys left, checkpoint of step {ck['step']}"


def check_exactly_once(run: Path, a) -> str:
    """Every prompt taken has exactly one fate; steps 0..N-1 each trained groups_per_step distinct
    prompts; nothing trained twice; nothing dropped or evicted except with an allowed reason, and
    only prompts taken after the first N x groups_per_step (the run's end drops those)."""
    cfg = config(run)
    p_per_step = cfg.train.groups_per_step
    prompts = ledger(run)
    ids = Counter(p["prompt_id"] for p in prompts)
    twice = [i for i, n in ids.items() if n > 1]
    require(not twice, f"{len(twice)} prompts appear more than once in the ledger, e.g. {twice[:5]}")
    fates = Counter(p["fate"] for p in prompts)
    unsettled = [p["prompt_id"] for p in prompts if p["fate"] not in ("trained", "dropped", "evicted")]
    require(not unsettled, f"{len(unsettled)} prompts have no fate (lost), e.g. {unsettled[:5]}; fates {dict(fates)}")
    allowed = set(a.allow_reason)
    bad = [
        (p["prompt_id"], p["fate"], p["reason"])
        for p in prompts
        if p["fate"] != "trained" and p["reason"] not in allowed
    ]
    require(not bad, f"{len(bad)} prompts dropped/evicted with a reason other than {sorted(allowed)}: {bad[:5]}")
    # The run's end may drop only what was taken for steps beyond the last one: a prompt taken
    # among the first steps x groups_per_step (dataloader order) must have been trained.
    n_early = a.steps * p_per_step
    early = sorted((p["order"], p["prompt_id"]) for p in prompts if p["fate"] != "trained" and p["order"] < n_early)
    require(
        not early,
        f"{len(early)} prompts taken for the first {a.steps} steps (dataloader order < {n_early}) were never trained "
        f"(dropped/evicted instead): (order, id) {early[:8]}",
    )
    per_step = trained_by_step(prompts)
    counts = {k: len(v) for k, v in sorted(per_step.items())}
    want = {k: p_per_step for k in range(a.steps)}
    require(
        counts == want, f"trained prompts per step {counts}, expected {p_per_step} in each of steps 0..{a.steps - 1}"
    )
    steps = [r["step"] for r in records(run)]
    require(steps == list(range(a.steps)), f"metrics.jsonl steps are not 0..{a.steps - 1} once each: {steps}")
    s = summary(run)["prompts"]
    require(
        s["taken"] == len(prompts) == s["settled"],
        f"summary says taken {s['taken']}, settled {s['settled']}; the ledger has {len(prompts)}",
    )
    return (
        f"exactly once: {len(prompts)} prompts, {a.steps} steps x {p_per_step} trained once each, fates {dict(fates)}"
    )


def check_learning(run: Path, a) -> str:
    """Mean reward of the last `window` steps exceeds that of the first `window` by `margin`."""
    r = [x["rollout/reward_mean"] for x in records(run)]
    require(len(r) >= 2 * a.window, f"{len(r)} steps: too few for two windows of {a.window}")
    first, last = sum(r[: a.window]) / a.window, sum(r[-a.window :]) / a.window
    require(
        last - first >= a.margin,
        f"reward did not rise by {a.margin}: mean of the first {a.window} steps {first:.3f}, of the last {a.window} "
        f"{last:.3f} (rise {last - first:+.3f}); curve {[round(x, 3) for x in r]}",
    )
    return f"learning: reward {first:.3f} -> {last:.3f} (rise {last - first:+.3f} >= {a.margin})"


def check_staleness(run: Path, a) -> str:
    """No step trained a group staler than sampler.max_staleness_versions; with --reaches, some step
    actually trained groups that stale (the pipeline overlapped)."""
    cfg = config(run)
    bound = cfg.sampler.max_staleness_versions
    st = [(x["step"], x["train/staleness_max"]) for x in records(run)]
    above = [(s, v) for s, v in st if v > bound]
    require(not above, f"steps trained groups staler than the bound {bound}: (step, staleness) {above[:10]}")
    top = max(v for _, v in st)
    if a.reaches is not None:
        require(
            top >= a.reaches, f"the largest staleness trained is {top}, expected it to reach {a.reaches} (no overlap?)"
        )
    return f"staleness: max {top} <= bound {bound} over {len(st)} steps"


def check_mismatch(run: Path, a) -> str:
    """The training-inference mismatch was measured (some step trained tokens sampled with its own
    weights) and stayed below metrics.mismatch_kl_bound on every step that measured it."""
    cfg = config(run)
    bound = cfg.metrics.mismatch_kl_bound
    rec = records(run)
    measured = [
        (x["step"], x["train/mismatch_kl"], x["train/mismatch_tokens"])
        for x in rec
        if x.get("train/mismatch_tokens", 0) > 0
    ]
    require(
        measured,
        f"no step measured the training-inference mismatch "
        f"(train/mismatch_tokens is 0 or missing in all {len(rec)} steps)",
    )
    above = [(s, kl) for s, kl, _ in measured if not (kl <= bound)]
    require(not above, f"train/mismatch_kl above its bound {bound}: (step, kl) {above[:10]}")
    worst = max(kl for _, kl, _ in measured)
    return f"mismatch: max train/mismatch_kl {worst:.2e} <= {bound} over {len(measured)} measured steps"


def check_sync_equivalent(run: Path, a) -> str:
    """Lookahead 0 trained what a synchronous loop would: step k trained the k-th block of
    groups_per_step prompts of the dataloader, every token of it sampled with the weights of step k
    (train/mismatch_tokens == train/tokens) and staleness 0, no more than one step's groups resident
    at any step's end; nothing was taken beyond one more block."""
    from single_controller.runtime.actor_host import make_dataloader

    cfg = config(run)
    require(
        cfg.sampler.max_lookahead_versions == 0, f"the run has lookahead {cfg.sampler.max_lookahead_versions}, not 0"
    )
    p = cfg.train.groups_per_step
    loader = make_dataloader(cfg)
    expected = [[next(loader).prompt_id for _ in range(p)] for _ in range(a.steps)]
    got = trained_by_step(ledger(run))
    for k in range(a.steps):
        require(
            sorted(got.get(k, [])) == sorted(expected[k]),
            f"step {k} trained {sorted(got.get(k, []))}, a synchronous loop trains the dataloader's prompts "
            f"{k * p}..{(k + 1) * p - 1}: {sorted(expected[k])}",
        )
    extra = sorted(set(got) - set(range(a.steps)))
    require(not extra, f"steps {extra} trained beyond the {a.steps} asked for")
    taken = summary(run)["prompts"]["taken"]
    require(
        taken <= (a.steps + 1) * p,
        f"{taken} prompts taken from the dataloader; a synchronous "
        f"loop of {a.steps} steps takes at most {(a.steps + 1) * p}",
    )
    for x in records(run):
        require(
            x["replay/resident_groups"] <= p,
            f"step {x['step']} ended with {x['replay/resident_groups']} "
            f"groups resident; a synchronous loop holds at most "
            f"one step's {p} (rollouts for the next step started before this one's weights were synced)",
        )
        require(
            x["train/staleness_max"] == 0,
            f"step {x['step']} trained a group {x['train/staleness_max']} versions stale (synchronous: 0)",
        )
        require(
            x["train/mismatch_tokens"] == x["train/tokens"],
            f"step {x['step']}: only {x['train/mismatch_tokens']:.0f} of "
            f"its {x['train/tokens']:.0f} trained tokens were sampled with "
            f"the weights of step {x['step']} (synchronous: all of them)",
        )
    return f"synchronous: {a.steps} steps trained the dataloader's blocks of {p}, all on-policy"


def check_worker_killed(run: Path, a) -> str:
    """One generation worker died (and was counted) while the run went on."""
    rec = records(run)
    deaths = rec[-1]["rollout/worker_deaths"]
    require(deaths == a.deaths, f"rollout/worker_deaths is {deaths} at the end, expected {a.deaths}")
    low = min(x["rollout/workers_routable"] for x in rec)
    require(low < a.workers, f"rollout/workers_routable never dropped below {a.workers}: the kill was not seen")
    again = sum(1 for p in ledger(run) if p["uncharged"] > 0)  # in flight on the dead worker
    require(
        again >= a.min_redispatched,
        f"{again} prompts were re-dispatched uncharged, expected at "
        f"least {a.min_redispatched} (the dead worker's in-flight groups)",
    )
    restarts = rec[-1]["rollout/worker_restarts"]
    return (
        f"worker death: {deaths} counted, routable workers dipped to {low}, "
        f"{again} prompts re-dispatched uncharged, restarts {restarts}"
    )


def check_resumed(run: Path, a) -> str:
    """summary.json says the run resumed from the checkpoint of step `from_step`."""
    s = summary(run)
    got = s.get("resumed_from")
    step = got.get("step") if isinstance(got, dict) else got
    require(step == a.from_step, f"summary.json resumed_from is {got!r}, expected the checkpoint of step {a.from_step}")
    return f"resumed from step {a.from_step}"


def check_latest_checkpoint(run: Path, a) -> str:
    """Print the step of checkpoints/latest (for a script to read), e.g. `5`."""
    name = (run / "checkpoints" / "latest").read_text().strip()
    require(name.startswith("step_"), f"checkpoints/latest names {name!r}")
    print(int(name.split("_")[1]))
    return ""


CHECKS = {
    "finished": check_finished,
    "exactly-once": check_exactly_once,
    "learning": check_learning,
    "staleness": check_staleness,
    "mismatch": check_mismatch,
    "sync-equivalent": check_sync_equivalent,
    "worker-killed": check_worker_killed,
    "resumed": check_resumed,
    "latest-checkpoint": check_latest_checkpoint,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=sorted(CHECKS))
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, help="steps the run trained (0..steps-1)")
    ap.add_argument("--stop-reason", default="training finished")
    ap.add_argument(
        "--allow-reason", action="append", default=["run_ended"], help="drop/evict reasons that are allowed"
    )
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--margin", type=float)
    ap.add_argument("--reaches", type=int)
    ap.add_argument("--deaths", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--min-redispatched", type=int, default=0)
    ap.add_argument("--from-step", type=int)
    a = ap.parse_args(argv)
    try:
        msg = CHECKS[a.check](a.run_dir, a)
    except CheckFailed as e:
        print(f"check {a.check}: {e}", file=sys.stderr)
        return 1
    except (OSError, KeyError, ValueError) as e:  # a missing file or key is a failed check too
        print(f"check {a.check}: cannot read {a.run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if msg:
        print(f"ok {msg}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
