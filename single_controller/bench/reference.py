"""Reference GRPO loop: the CPU backend's pieces in one process, no controller, no Ray.

Per step: P prompts x G completions are sampled and scored by `GenerationCore` (rows go to an
in-memory row storage, one put), advantages (r - mean) / (std + 1e-4) are computed per group and
written back, and `TrainerCore` trains on the rows it reads back (begin -> one microbatch -> finish,
token-level loss). Generation and training share one module, so every step is on-policy.
The run stops when the `window`-step moving average of the exact-match rate (reward >= 1) reaches
`target`. It is the yardstick the orchestrated runs are compared against (`sc-grpo bench reference`).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from replay.storage import TRAIN_FIELDS, InMemoryRowStorage, row_keys
from single_controller.backends.torch.generation import GenerationCore
from single_controller.backends.torch.model import TinyGPT
from single_controller.backends.torch.trainer import TrainerCore
from single_controller.config.schema import ModelConfig, TrainConfig
from single_controller.data.tasks import TOKENIZER, load_task, positional_match_reward
from single_controller.types import GenerationRequest, LossConfig, SamplingParams


@dataclass(frozen=True)
class ReferenceResult:
    seed: int
    reached: bool  # the moving average reached the target
    steps: int
    seconds: float  # wall time of the training loop
    setup_s: float  # building model, optimizer (its first use imports torch._dynamo: ~3 s once per process), data
    final_exact: float  # last moving average of the exact-match rate
    gen_ms: float  # mean per step: sampling + reward + storage put
    train_ms: float  # mean per step: advantages, storage round trip, begin/microbatch/finish


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] -> (r - mean) / (std + eps) within each group [P, G] (population std)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def run_reference(
    seed: int = 0,
    *,
    task: str = "reverse_digits",
    num_digits: int = 3,
    prompts_per_step: int = 16,
    group_size: int = 16,
    lr: float = 1e-3,
    target: float = 0.9,
    window: int = 5,
    max_steps: int = 600,
    max_seconds: float = 120.0,
    num_prompts: int = 1000,
    log: Callable[[str], None] | None = None,
) -> ReferenceResult:
    torch.set_num_threads(1)
    setup_started = time.perf_counter()
    policy = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=seed)
    trainer = TrainerCore(policy, dataclasses.replace(TrainConfig(), lr=lr))
    storage = InMemoryRowStorage()
    gen = GenerationCore(policy, storage, positional_match_reward, seed=seed, version=0)
    prompts = load_task(task)(num_prompts, num_digits, seed)
    rng = random.Random(seed)
    order: list = []
    loss_cfg = LossConfig(level="token")
    sampling = SamplingParams(n=group_size, max_new_tokens=num_digits)
    recent: deque[float] = deque(maxlen=window)
    gen_s = train_s = 0.0
    step = 0
    started = time.perf_counter()
    while step < max_steps and time.perf_counter() - started < max_seconds:
        # Exits: the moving average reached the target, max_steps, or max_seconds.
        if len(order) < prompts_per_step:
            order.extend(rng.sample(prompts, len(prompts)))  # a fresh epoch
        batch, order = order[:prompts_per_step], order[prompts_per_step:]
        requests = [
            GenerationRequest(f"s{step}_q{i}", p, sampling, row_keys(f"s{step}_q{i}", group_size)) for i, p in enumerate(batch)
        ]
        t0 = time.perf_counter()
        results = gen.generate(requests)
        t1 = time.perf_counter()
        rewards = torch.tensor([r.rewards for r in results])  # [P, G]
        keys = [k for r in requests for k in r.row_keys]
        storage.put_rows_sync(keys, {"advantage": group_advantages(rewards).reshape(-1).float()})
        rows = storage.get_rows_sync(keys, TRAIN_FIELDS)
        trainer.begin_train_step(step, loss_cfg)
        trainer.train_microbatch(rows)
        metrics = trainer.finish_train_step(step)
        storage.clear_rows_sync(keys)
        step += 1
        gen.version = step  # generation shares the trained module: its weights are now this version
        t2 = time.perf_counter()
        gen_s, train_s = gen_s + (t1 - t0), train_s + (t2 - t1)
        recent.append(float((rewards >= 1.0).float().mean()))
        avg = sum(recent) / len(recent)
        if log is not None and (step % 20 == 0 or avg >= target):
            log(f"seed {seed} step {step}: reward {rewards.mean():.3f} exact(avg{window}) {avg:.3f} loss {metrics['train/loss']:.4f}")
        if len(recent) == window and avg >= target:
            break
    return ReferenceResult(
        seed=seed,
        reached=len(recent) == window and sum(recent) / window >= target,
        steps=step,
        seconds=time.perf_counter() - started,
        setup_s=started - setup_started,
        final_exact=sum(recent) / max(len(recent), 1),
        gen_ms=1000 * gen_s / max(step, 1),
        train_ms=1000 * train_s / max(step, 1),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`sc-grpo bench reference`: one line per seed and a summary; exit 1 if any seed missed the target."""
    p = argparse.ArgumentParser(prog="sc-grpo bench reference", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--task", default="reverse_digits")
    p.add_argument("--num-digits", type=int, default=3)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--verbose", action="store_true", help="log every 20 steps")
    args = p.parse_args(argv)
    try:
        load_task(args.task)
    except (KeyError, ImportError, AttributeError, ValueError) as e:
        p.error(f"--task: {e.args[0] if isinstance(e, KeyError) else e}")
    results = []
    for seed in args.seeds:
        r = run_reference(
            seed,
            task=args.task,
            num_digits=args.num_digits,
            target=args.target,
            max_steps=args.max_steps,
            max_seconds=args.max_seconds,
            log=print if args.verbose else None,
        )
        results.append(r)
        print(
            f"bench/reference seed={r.seed} reached={r.reached} steps={r.steps} seconds={r.seconds:.2f} "
            f"setup_s={r.setup_s:.2f} exact_avg={r.final_exact:.3f} gen_ms={r.gen_ms:.1f} train_ms={r.train_ms:.1f}",
            flush=True,
        )
    secs = [r.seconds for r in results]
    print(
        f"bench/reference summary: {sum(r.reached for r in results)}/{len(results)} reached {args.target} | "
        f"steps mean {statistics.mean(r.steps for r in results):.0f} | seconds mean {statistics.mean(secs):.2f} "
        f"min {min(secs):.2f} max {max(secs):.2f}",
        flush=True,
    )
    return 0 if all(r.reached for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
