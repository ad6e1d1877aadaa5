"""`python -m tests.helpers.saved_policy_logprobs MODEL_DIR`: the token logprobs of a few fixed token
sequences under a saved policy, by `transformers` (float32) and by vLLM's engine (its CPU build, the
engine arguments a run uses), and their largest difference, as one JSON line. A process of its own:
vLLM's engine environment is set before vLLM is imported. Not a test module."""

from __future__ import annotations

import json
import sys

import torch


def sequences(vocab: int, n: int = 8, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def hf_logprobs(model_dir: str, seqs: list[list[int]]) -> list[list[float]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def vllm_logprobs(model_dir: str, seqs: list[list[int]]) -> list[list[float]]:
    from single_controller.backends.vllm.engine_env import apply_engine_env
    from single_controller.preflight.loader import load_config

    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}"])
    apply_engine_env(cfg.vllm.device, cfg.vllm.kv_cache_gib)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from single_controller.backends.vllm.worker import engine_args

    llm = LLM(**{k: v for k, v in engine_args(cfg, 0).items() if k != "worker_extension_cls"})
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
    return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)]


def main(model_dir: str) -> None:
    vocab = json.loads(open(f"{model_dir}/config.json").read())["vocab_size"]
    seqs = sequences(vocab)
    hf, engine = hf_logprobs(model_dir, seqs), vllm_logprobs(model_dir, seqs)
    diff = max(abs(a - b) for x, y in zip(hf, engine) for a, b in zip(x, y))
    print(json.dumps({"max_abs_diff": diff, "tokens": sum(len(x) for x in hf), "hf": hf}))


if __name__ == "__main__":
    main(sys.argv[1])
