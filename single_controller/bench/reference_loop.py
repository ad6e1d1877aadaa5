"""Reference GRPO loop: the embedded torch backend's pieces in one process, no controller, no Ray.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from replay.storage import TRAIN_FIELDS, InMemoryRowStorage, row_keys
from single_controller.algorithm.advantages import grpo_advantages
from single_controller.backends.torch.generation import GenerationCore
from single_controller.backends.torch.model import TinyGPT
from single_controller.backends.torch.trainer import TrainerCore
from single_controller.config.schema import AdvantageConfig, ModelConfig, TrainConfig
from single_controller.data.tasks import TOKENIZER, load_task, positional_match_reward
from single_controller.types import GenerationRequest, GenerationResult, LossConfig, SamplingParams


@dataclass(frozen=True)
class ReferenceResult:
    seed: int
    reached: bool  # the moving average reached the target
    steps: int
    seconds: float  # wall time of the training loop
    setup_s: float  # building model, optimizer (its first use imports torch._dynamo once per process), data
    final_exact: float  # last moving average of the exact-match rate
    gen_ms: float  # mean per step: sampling + reward + storage put
    train_ms: float  # mean per step: advantages, storage round trip, begin/microbatch/finish


def group_advantages(rewards: Sequence[Sequence[float]], cfg: AdvantageConfig | None = None) -> torch.Tensor:
    """rewards [P][G] -> advantages [P, G]: the run's own computation (`grpo_advantages`), group by group."""
    cfg = cfg or AdvantageConfig()
    return torch.tensor([grpo_advantages(r, normalize_std=cfg.normalize_std, eps=cfg.eps) for r in rewards])


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
    loop = _ReferenceLoop(seed, task, num_digits, prompts_per_step, group_size, lr, num_prompts)
    recent: deque[float] = deque(maxlen=window)
    gen_s = train_s = 0.0
    step = 0
    started = time.perf_counter()
    while step < max_steps and time.perf_counter() - started < max_seconds:
        # Exits: the moving average reached the target, max_steps, or max_seconds.
        rewards, loss, step_gen_s, step_train_s = loop.step(step)
        step += 1
        gen_s, train_s = gen_s + step_gen_s, train_s + step_train_s
        recent.append(float((rewards >= 1.0).float().mean()))
        avg = sum(recent) / len(recent)
        if log is not None and (step % 20 == 0 or avg >= target):
            log(f"seed {seed} step {step}: reward {rewards.mean():.3f} exact(avg{window}) {avg:.3f} loss {loss:.4f}")
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


class _ReferenceLoop:
    """One process's model, trainer, storage and prompt order; `step(i)` runs step i of the loop."""

    def __init__(
        self, seed: int, task: str, num_digits: int, prompts_per_step: int, group_size: int, lr: float, num_prompts: int
    ):
        policy = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=seed)
        self.trainer = TrainerCore(policy, dataclasses.replace(TrainConfig(), lr=lr))
        self.storage = InMemoryRowStorage()
        self.gen = GenerationCore(policy, self.storage, positional_match_reward, seed=seed, version=0)
        self.prompts = load_task(task)(num_prompts, num_digits, seed)
        self.rng = random.Random(seed)
        self.order: list = []
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.loss_cfg = LossConfig(agg="token_mean")
        self.sampling = SamplingParams(n=group_size, max_new_tokens=num_digits)

    def step(self, step: int) -> tuple[torch.Tensor, float, float, float]:
        """Sample, score, train on one batch: (rewards [P, G], loss, generation s, training s)."""
        if len(self.order) < self.prompts_per_step:
            self.order.extend(self.rng.sample(self.prompts, len(self.prompts)))  # a fresh epoch
        batch, self.order = self.order[: self.prompts_per_step], self.order[self.prompts_per_step :]
        requests = [
            GenerationRequest(f"s{step}_q{i}", p, self.sampling, row_keys(f"s{step}_q{i}", self.group_size))
            for i, p in enumerate(batch)
        ]
        t0 = time.perf_counter()
        results = self.gen.generate(requests)
        t1 = time.perf_counter()
        done = [r for r in results if isinstance(r, GenerationResult)]
        # None: a request cancelled meanwhile (nothing cancels one here); RewardFailed: the reward
        # function raised or gave a non-finite reward (positional_match_reward never does)
        assert len(done) == len(results), results
        rewards = torch.tensor([r.rewards for r in done])  # [P, G]
        keys = [k for r in requests for k in r.row_keys]
        advantages = group_advantages([r.rewards for r in done])
        self.storage.put_rows_sync(keys, {"advantage": advantages.reshape(-1).float()})
        rows = self.storage.get_rows_sync(keys, TRAIN_FIELDS)
        self.trainer.begin_train_step(step, self.loss_cfg)
        self.trainer.train_microbatch(rows)
        metrics = self.trainer.finish_train_step(step)
        self.storage.clear_rows_sync(keys)
        self.gen.version = step + 1  # generation shares the trained module: its weights are now this version
        return rewards, metrics["train/loss"], t1 - t0, time.perf_counter() - t1


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
