"""Shared prompt prefixes in training (`train.share_prompt_prefix`, `token_logprobs(share_prefixes=True)`):
each distinct prompt of a pass runs once and the rows continuing it attend to its keys and values.
That must be the same function of the parameters as the forward of whole rows: logprobs and
gradients equal in float64 for the embedded TinyGPT and every HF architecture `init-model` writes,
with prompts of several lengths, groups of repeated prompts, single prompts, responses of lengths
0, 1 and more; and the whole split-API step equal with sharing on and off."""

from __future__ import annotations

import pytest
import torch

from single_controller.algorithm.logprobs import shared_prefix_module, token_logprobs
from single_controller.backends.torch.model import TinyGPT, build_policy, enable_gradient_checkpointing
from single_controller.config.schema import ModelConfig, TrainConfig
from single_controller.data.tokenizer import load_tokenizer


def _rows(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Groups of 4 rows with one prompt each (prompt lengths 3, 5, 5, 7), two single rows; responses of
    lengths 0 to 6."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for length in (3, 5, 5, 7):
        p = torch.randint(3, 13, (length,), generator=g)
        for _ in range(4):
            prompts.append(p.clone())
            responses.append(torch.randint(3, 13, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g))
    for length in (4, 5):
        prompts.append(torch.randint(3, 13, (length,), generator=g))
        responses.append(torch.randint(3, 13, (1,), generator=g))
    responses[1] = torch.randint(3, 13, (6,), generator=g)  # every group has a long response
    order = torch.randperm(len(prompts), generator=g).tolist()  # groups interleaved, as a pass may hold them
    return [prompts[i] for i in order], [responses[i] for i in order]


def _policies(tmp_path) -> dict[str, torch.nn.Module]:
    pytest.importorskip("transformers")
    from single_controller.data.hf_model import init_model

    out: dict[str, torch.nn.Module] = {"tinygpt": TinyGPT(ModelConfig(), vocab_size=19, seed=0)}
    for arch in ("llama", "qwen2", "qwen3", "gpt2"):
        path = init_model(tmp_path / arch, hidden_size=64, num_layers=2, arch=arch, seed=0)
        cfg = ModelConfig(path=str(path))
        out[arch] = build_policy(cfg, load_tokenizer(str(path)).vocab_size, seed=0)
    return out


def _logprobs_and_grads(policy, prompts, responses, share: bool):
    policy.zero_grad(set_to_none=True)
    logp, valid = token_logprobs(policy, prompts, responses, temperature=0.7, share_prefixes=share)
    weights = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)
    (logp * weights * valid).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logp.detach(), valid, grads


# HF's rotary models (Llama, Qwen2, Qwen3) compute their cos/sin tables in float32 even in a float64
# model: their gradients then differ by up to ~7e-7 (of ~10) between two exact forms of the same
# forward (HF's own sdpa and eager attention, whole rows, differ by that much). Learned positions
# (TinyGPT, GPT-2) agree to rounding.
GRAD_ATOL = {"tinygpt": 1e-12, "gpt2": 1e-12, "llama": 2e-6, "qwen2": 2e-6, "qwen3": 2e-6}


def test_shared_prefixes_give_the_whole_rows_logprobs_and_gradients_in_float64(tmp_path):
    prompts, responses = _rows()
    for name, policy in _policies(tmp_path).items():
        policy = policy.double()
        assert shared_prefix_module(policy) is policy, name
        whole, valid, g_whole = _logprobs_and_grads(policy, prompts, responses, share=False)
        shared, valid_s, g_shared = _logprobs_and_grads(policy, prompts, responses, share=True)
        assert torch.equal(valid, valid_s), name
        assert torch.allclose(whole, shared, atol=1e-12, rtol=0), (name, (whole - shared).abs().max())
        assert g_whole.keys() == g_shared.keys() and g_whole, name
        for n in g_whole:
            assert torch.allclose(g_whole[n], g_shared[n], atol=GRAD_ATOL[name], rtol=0), (name, n)


def test_shared_prefixes_are_not_used_with_gradient_checkpointing_nor_by_a_plain_module(tmp_path):
    policy = TinyGPT(ModelConfig(), vocab_size=19, seed=0)
    enable_gradient_checkpointing(policy)
    assert shared_prefix_module(policy) is None
    plain = torch.nn.Sequential(torch.nn.Embedding(19, 8), torch.nn.Linear(8, 19))
    assert shared_prefix_module(plain) is None
    prompts, responses = _rows()
    logp, _ = token_logprobs(plain, prompts, responses, share_prefixes=True)  # falls back to whole rows
    assert logp.shape == (len(prompts), max(len(r) for r in responses))


def test_the_split_step_is_the_same_with_shared_prefixes_on_and_off():
    from single_controller.backends.torch.trainer import TrainerCore
    from single_controller.types import LossConfig

    prompts, responses = _rows(1)
    g = torch.Generator().manual_seed(2)
    rows = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "gen_logprobs": [-torch.rand(len(r), generator=g, dtype=torch.float64) for r in responses],
        "response_mask": [torch.ones(len(r), dtype=torch.bool) for r in responses],
        "advantage": torch.randn(len(prompts), generator=g, dtype=torch.float64).tolist(),
    }
    params = {}
    for share in (False, True):
        policy = TinyGPT(ModelConfig(), vocab_size=19, seed=0).double()
        core = TrainerCore(policy, TrainConfig(share_prompt_prefix=share, micro_batch_tokens=40), max_steps=4)
        core.begin_train_step(0, LossConfig())
        core.train_microbatch(rows)
        core.finish_train_step(0)
        params[share] = {n: p.detach().clone() for n, p in policy.named_parameters()}
    for n, p in params[False].items():
        assert torch.allclose(p, params[True][n], atol=1e-12, rtol=0), n
    # the step moved the weights (a test of two no-ops would pass too)
    fresh = dict(TinyGPT(ModelConfig(), vocab_size=19, seed=0).double().named_parameters())
    assert any(not torch.allclose(p, fresh[n].detach()) for n, p in params[True].items())


def test_sampling_prefills_each_distinct_prompt_once_and_draws_the_same_tokens(tmp_path, monkeypatch):
    from single_controller.backends.torch.sampling import sample

    g = torch.Generator().manual_seed(3)
    groups = torch.randint(3, 13, (3, 5), generator=g)
    prompts = groups.repeat_interleave(4, dim=0)[torch.randperm(12, generator=g)]  # 3 prompts x 4 rows, mixed
    for name, policy in _policies(tmp_path).items():
        policy = policy.double().eval()
        prefilled: list[int] = []
        forward_cached = policy.forward_cached

        def counting(ids, cache, _f=forward_cached, _seen=prefilled):
            _seen.append(ids.shape[0])
            return _f(ids, cache)

        monkeypatch.setattr(policy, "forward_cached", counting)
        out = {}
        for share in (False, True):
            prefilled.clear()
            out[share] = sample(
                policy,
                prompts,
                max_new_tokens=4,
                temperature=0.9,
                generator=torch.Generator().manual_seed(0),
                share_prompts=share,
            )
            assert prefilled[0] == (3 if share else 12), name  # the prefill's rows
            assert set(prefilled[1:]) == {12}, name  # every decode step has every row
        assert torch.equal(out[False].tokens, out[True].tokens), name
        assert torch.allclose(out[False].logprobs, out[True].logprobs, atol=1e-6, rtol=0), name
