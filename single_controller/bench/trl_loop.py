"""TRL's `GRPOTrainer` on a model directory and a built-in digit task, for `sc-grpo bench trl`.

`python -m single_controller.bench.trl_loop MODEL_DIR --seed S ...` (the `bench` extra) trains to
`--target` or for exactly `--steps` steps with the settings `bench.trl.SHARED` gives both sides, and
prints the one line the harness reads:

    TRL: N steps in T s of training (+S s startup): success X
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The harness passes every setting; the defaults are its shared ones (`bench.trl.SHARED`)."""
    from single_controller.bench.trl import SHARED as s

    p = argparse.ArgumentParser(prog="python -m single_controller.bench.trl_loop")
    p.add_argument("model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default=s["task"])
    p.add_argument("--num-digits", type=int, default=s["num_digits"])
    p.add_argument("--num-prompts", type=int, default=s["num_prompts"])
    p.add_argument("--group-size", type=int, default=s["group_size"])
    p.add_argument("--prompts-per-step", type=int, default=s["prompts_per_step"])
    p.add_argument("--lr", type=float, default=s["lr"])
    p.add_argument("--betas", type=float, nargs=2, default=s["betas"])
    p.add_argument("--clip-eps", type=float, default=s["clip_eps"])
    p.add_argument("--grad-clip", type=float, default=s["grad_clip"])
    p.add_argument("--target", type=float, default=s["target"])
    p.add_argument("--window", type=int, default=s["window"])
    p.add_argument("--steps", type=int, help="train exactly this many steps (no success target)")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return p.parse_args(argv)


def grpo_config(args: argparse.Namespace, out: str) -> Any:
    """TRL's settings, each one sc-grpo's (`bench.trl.SHARED`)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,  # TRL's defaults are bf16 and gradient checkpointing; sc-grpo's float32 and none
        gradient_checkpointing=False,
        disable_dropout=True,
        seed=args.seed,
        data_seed=args.seed,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group_size,
        num_iterations=1,
        max_completion_length=args.num_digits,
        temperature=1.0,
        top_p=1.0,
        learning_rate=args.lr,
        adam_beta1=args.betas[0],
        adam_beta2=args.betas[1],
        weight_decay=0.0,
        max_grad_norm=args.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        epsilon=args.clip_eps,
        loss_type="dapo",  # token-level: the sum over the batch's tokens / their count (sc-grpo's loss_agg=token_mean)
        scale_rewards="group",
        max_steps=args.steps or args.max_steps,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)

    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    from single_controller.data.tasks import TOKENIZER, load_task, positional_match_reward
    from single_controller.types import Prompt

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    prompts = load_task(args.task)(args.num_prompts, args.num_digits, args.seed)
    texts = [q.raw_prompt if isinstance(q.raw_prompt, str) else TOKENIZER.decode(q.token_ids) for q in prompts]
    data = Dataset.from_dict({"prompt": texts, "answer": [q.answer for q in prompts]})
    successes: list[float] = []

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float | None]:
        scores: list[float | None] = [
            positional_match_reward(Prompt(prompt_id="", token_ids=(), answer=a), c)
            for c, a in zip(completions, answer)
        ]
        successes.append(sum(s is not None and s >= 1.0 for s in scores) / len(scores))
        return scores

    recent: deque[float] = deque(maxlen=args.window)
    cli = args

    class StopAtSuccess(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if successes:
                recent.append(successes[-1])
            if cli.steps is None and len(recent) == cli.window and sum(recent) / cli.window >= cli.target:
                control.should_training_stop = True
            return control

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        config = grpo_config(args, out)
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer
        )
        trainer.add_callback(StopAtSuccess())
        setup_s = time.perf_counter() - started
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    steps = len(successes)
    final = sum(recent) / max(1, len(recent))
    print(
        f"TRL: {steps} steps in {train_s:.2f}s of training (+{setup_s:.2f}s startup): success {final:.3f}", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
