"""Peak RSS of torch-trainer steps on an 83 M-parameter Llama as `train.micro_batch_tokens` shrinks, with
and without `train.gradient_checkpointing` (not a timing: one process per setting, peak RSS only).

The model: hidden 512, 12 layers, 8 heads, MLP 2048, vocabulary 32000 (untied head), float32, built
from its config in this process (`init_model` writes a vocabulary only as large as its tokenizer's).
One microbatch of 16 rows x (32 prompt + 96 response) tokens = 2048 tokens a step. Each setting runs
in a fresh process: two steps (the first allocates Adam's state), then the process's peak RSS and the
RSS before the first step (weights, rows) are printed. Run from the repository root with it on
PYTHONPATH: `python docs/measure/trainer_memory_budget.py`.
"""

import dataclasses
import json
import resource
import subprocess
import sys

ROWS, PROMPT, RESPONSE, VOCAB = 16, 32, 96, 32000
BUDGETS = (None, 1024, 512, 256, 128)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def one(budget: int | None, checkpointing: bool) -> dict:
    import torch
    import transformers

    from single_controller.backends.torch.model import HFCausalLMPolicy
    from single_controller.backends.torch.trainer import TrainerCore
    from single_controller.config.schema import TrainConfig
    from single_controller.types import LossConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=PROMPT + RESPONSE,
        tie_word_embeddings=False,
    )
    policy = HFCausalLMPolicy(transformers.LlamaForCausalLM(cfg).float().eval())
    params = sum(p.numel() for p in policy.parameters())
    train = dataclasses.replace(TrainConfig(), micro_batch_tokens=budget, gradient_checkpointing=checkpointing)
    trainer = TrainerCore(policy, train)
    g = torch.Generator().manual_seed(1)
    rows = {
        "prompt_ids": [torch.randint(0, VOCAB, (PROMPT,), generator=g) for _ in range(ROWS)],
        "response_ids": [torch.randint(0, VOCAB, (RESPONSE,), generator=g) for _ in range(ROWS)],
        "gen_logprobs": [-torch.rand(RESPONSE, generator=g) * 3 - 8 for _ in range(ROWS)],
        "response_mask": [torch.ones(RESPONSE, dtype=torch.bool) for _ in range(ROWS)],
        "advantage": torch.randn(ROWS, generator=g),
    }
    before = _rss_mib()
    for step in range(2):
        trainer.begin_train_step(step, LossConfig())
        trainer.train_microbatch(rows)
        passes = trainer.finish_train_step(step)["train/passes"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"params_m": params / 1e6, "passes": passes, "before_mib": before, "peak_mib": peak}


def main() -> None:
    print(f"{ROWS} rows x {PROMPT + RESPONSE} tokens = {ROWS * (PROMPT + RESPONSE)} tokens a microbatch")
    print("| micro_batch_tokens | passes | gradient_checkpointing | RSS before | peak RSS | peak - before |")
    print("|---|---|---|---|---|---|")
    for checkpointing in (False, True):
        for budget in BUDGETS:
            out = subprocess.run(
                [sys.executable, __file__, "--one", json.dumps([budget, checkpointing])],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {budget} | {r['passes']:.0f} | {checkpointing} | {r['before_mib']:.0f} MiB | "
                f"{r['peak_mib']:.0f} MiB | {r['peak_mib'] - r['before_mib']:.0f} MiB |",
                flush=True,
            )
    print(f"model: {r['params_m']:.1f} M parameters")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(one(*json.loads(sys.argv[2]))))
    else:
        main()
