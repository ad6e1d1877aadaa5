"""`sc-grpo bench logprob-memory`: the trainer's peak memory for the response tokens' log-probabilities
(forward, entropy and backward) at a large vocabulary (default Qwen2.5's 151,936), chunked
(`algorithm.logprobs.picked_logprobs`) beside the whole-tensor formula it replaced, side by side.

Each side runs in a fresh process: a stand-in policy (an embedding and an LM head, the head's logits
[rows, tokens, vocab] in `--dtype` under autocast as a trainer computes them), rows of `--prompt`
prompt and `--response` response tokens, then `token_logprobs_entropy` and the backward of the
logprobs' sum. The figure is how far the process's resident memory rose above where it stood before
(Linux `VmHWM` after resetting it). Both sides hold the logits and their gradient; the difference is
the float32 [response tokens, vocab] tensors the whole formula made (the picked logits upcast, their
log-softmax kept for backward, the entropy's temporaries, the gradient of each). CPU only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from single_controller.bench.fsdp_memory import MIB, _settle, _status


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sc-grpo bench logprob-memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens a row")
    p.add_argument("--response", type=int, default=384, help="response tokens a row")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the logits' dtype")
    p.add_argument("--one", choices=("whole", "chunked"), help=argparse.SUPPRESS)  # a side, in its own process
    p.add_argument("--out", default="bench_out/logprob_memory")
    return p.parse_args(argv)


def _whole(policy, prompts, responses, temperature: float = 1.0):
    """The formula before chunking (kept here as the baseline): gather the response positions, their
    whole float32 log-distribution, its entropy, the targets."""
    import torch

    from single_controller.algorithm.logprobs import log_softmax_tempered

    B, P, R = len(prompts), prompts[0].shape[0], responses[0].shape[0]
    ids = torch.cat([torch.stack(prompts), torch.stack(responses)], dim=1)  # [B, P + R]
    logits = policy(ids)
    pos = (P - 1 + torch.arange(R))[None].expand(B, -1)
    picked = torch.gather(logits, 1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))
    logp = log_softmax_tempered(picked, temperature)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return torch.gather(logp, 2, ids[:, P:, None]).squeeze(2), entropy


def _one(args: argparse.Namespace) -> dict:
    import torch

    from single_controller.algorithm.logprobs import token_logprobs_entropy

    torch.manual_seed(0)
    hidden = 64
    policy = torch.nn.Sequential(torch.nn.Embedding(args.vocab, hidden), torch.nn.Linear(hidden, args.vocab))
    prompts = [torch.randint(0, args.vocab, (args.prompt,)) for _ in range(args.rows)]
    responses = [torch.randint(0, args.vocab, (args.response,)) for _ in range(args.rows)]
    dtype = getattr(torch, args.dtype)
    before = _settle()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        if args.one == "whole":
            logp, _ = _whole(policy, prompts, responses)
        else:
            logp, _, _ = token_logprobs_entropy(policy, prompts, responses)
    logp.float().sum().backward()
    return {"side": args.one, "peak_mib": (_status("VmHWM") - before) / MIB, "sum": float(logp.float().sum())}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(_one(args)))
        return 0
    results = {}
    for side in ("whole", "chunked"):
        cmd = [sys.executable, "-m", "single_controller.bench.logprob_memory", *(argv or sys.argv[1:]), "--one", side]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = args.rows * args.response
    whole, chunked = results["whole"]["peak_mib"], results["chunked"]["peak_mib"]
    logits_mib = args.rows * (args.prompt + args.response) * args.vocab * (2 if args.dtype == "bfloat16" else 4) / MIB
    text = "\n".join(
        [
            f"## bench logprob-memory: vocab {args.vocab:,}, {args.rows} rows x ({args.prompt} + {args.response}) "
            f"tokens, {args.dtype} logits ({logits_mib:,.0f} MiB)",
            "",
            "| formula | peak above the start (MiB) |",
            "|---|---|",
            f"| whole [{tokens} x vocab] float32 tensors (before) | {whole:,.0f} |",
            f"| chunked (`picked_logprobs`) | {chunked:,.0f} |",
            f"| ratio chunked / whole | {chunked / whole:.2f} |",
            "",
            f"logprob sums: whole {results['whole']['sum']:.6g}, chunked {results['chunked']['sum']:.6g}",
        ]
    )
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logprob_memory.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
