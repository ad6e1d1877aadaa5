"""TinyGPT, the KV cache, sampling, save/load, and generation-vs-trainer logprobs (acceptance 3)."""

import dataclasses

import pytest
import torch

from single_controller.algorithm.logprobs import pad_right, token_logprobs
from single_controller.backends.torch.model import (
    HFCausalLMPolicy,
    TinyGPT,
    build_tinygpt,
    load_tinygpt,
    save_tinygpt,
    state_module,
)
from single_controller.backends.torch.sampling import sample
from single_controller.config.schema import ModelConfig
from single_controller.data.tasks import TOKENIZER, reverse_digits

torch.set_num_threads(1)
V = TOKENIZER.vocab_size


def _prompts(n=8, seed=0):
    return torch.tensor([p.token_ids for p in reverse_digits(n, 3, seed)])  # [n, 5]


def test_parameter_count_and_seeded_init():
    m = TinyGPT(ModelConfig(), V, seed=0)
    # per block: 2 LN (2*128) + qkv 64*192+192 + proj 64*64+64 + fc 64*256+256 + fc_out 256*64+64 = 49984
    # 2 blocks 99968 + ln_f 128 + tok_emb 19*64 + pos_emb 32*64 = 103360 (the head is tied: no extra)
    assert sum(p.numel() for p in m.parameters()) == 103360
    same, other = TinyGPT(ModelConfig(), V, seed=0), TinyGPT(ModelConfig(), V, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), same.parameters()))
    assert not torch.equal(m.tok_emb.weight, other.tok_emb.weight)
    assert abs(float(m.blocks[0].fc.weight.detach().std()) - 0.02) < 0.001  # std-0.02 init (16k samples)


def test_kv_cache_matches_full_forward():
    m = TinyGPT(ModelConfig(), V, seed=3)
    ids = torch.randint(0, V, (4, 12))
    full = m(ids)  # [4, 12, V]
    cache = m.new_cache(4)
    parts = [m.forward_cached(ids[:, :5], cache), m.forward_cached(ids[:, 5:9], cache)]  # prefill, chunk after a prefix
    parts += [m.forward_cached(ids[:, t : t + 1], cache) for t in range(9, 12)]  # one token at a time
    cached = torch.cat(parts, dim=1)
    # float32, different matmul shapes: logits of size ~1 agree to ~1e-6
    assert (cached - full).abs().max() < 1e-5
    with pytest.raises(ValueError, match="max_seq_len"):
        m.forward_cached(torch.zeros(4, 30, dtype=torch.long), cache)


@pytest.mark.parametrize("temperature, top_p, stop", [(1.0, 1.0, None), (0.7, 0.9, TOKENIZER.eos_id)])
def test_generation_logprobs_equal_trainer_logprobs(temperature, top_p, stop):
    """Acceptance 3: same weights, same tokens -> the logprobs sampling reported equal the ones the
    trainer computes (full forward, no cache) within 1e-5 (float32 rounding of two matmul orders)."""
    m = TinyGPT(ModelConfig(init_std=0.2), V, seed=1)  # a wide init: peaked, far-from-uniform distributions
    prompts = _prompts(32).repeat(4, 1)  # [128, 5]
    out = sample(
        m,
        prompts,
        max_new_tokens=6,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=() if stop is None else (stop,),
        generator=torch.Generator().manual_seed(0),
    )
    rows = [out.row(i) for i in range(len(prompts))]
    trainer_lp, valid = token_logprobs(m, list(prompts), [ids for ids, _ in rows], temperature)
    assert torch.equal(valid, out.mask)
    gen_lp = out.logprobs[out.mask]
    assert gen_lp.min() < -3.0 and gen_lp.max() > -0.5  # a wide range of logprobs, not a near-uniform policy
    assert (trainer_lp[valid] - gen_lp).abs().max() < 1e-5
    if stop is not None:
        assert (out.lengths < 6).any() and (out.lengths == 6).any()  # some rows stopped early


def test_stop_token_masks_the_rest_of_the_row():
    m = TinyGPT(ModelConfig(), V, seed=0)
    with torch.no_grad():  # make EOS the overwhelming choice after the prompt
        m.tok_emb.weight.zero_()
        m.tok_emb.weight[TOKENIZER.eos_id] = 1.0
        m.ln_f.weight.zero_()
        m.ln_f.bias.copy_(m.tok_emb.weight[TOKENIZER.eos_id] * 30)
    out = sample(m, _prompts(4), max_new_tokens=5, stop_token_ids=(TOKENIZER.eos_id,), pad_id=TOKENIZER.pad_id)
    assert out.lengths.tolist() == [1, 1, 1, 1]
    assert out.mask.tolist() == [[True] + [False] * 4] * 4
    assert out.tokens[:, 1:].eq(TOKENIZER.pad_id).all() and out.logprobs[:, 1:].eq(0).all()
    ids, lp = out.row(2)
    assert ids.tolist() == [TOKENIZER.eos_id] and lp.shape == (1,)
    # Without a stop token the same policy keeps going to max_new_tokens.
    assert sample(m, _prompts(4), max_new_tokens=5).lengths.tolist() == [5] * 4


def test_tiny_top_p_is_greedy():
    m = TinyGPT(ModelConfig(), V, seed=5)
    p = _prompts(16)
    greedy = sample(m, p, max_new_tokens=4, greedy=True)
    nucleus = sample(m, p, max_new_tokens=4, top_p=1e-6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy.tokens, nucleus.tokens)
    assert torch.equal(greedy.logprobs, nucleus.logprobs)


def test_save_load_round_trip(tmp_path):
    m = TinyGPT(ModelConfig(d_model=32, n_heads=2), V, seed=9)
    save_tinygpt(m, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists() and (tmp_path / "ckpt" / "config.json").exists()
    back = load_tinygpt(tmp_path / "ckpt")
    assert back.cfg == m.cfg
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), back.state_dict().values()))
    cfg = ModelConfig(d_model=32, n_heads=2, checkpoint=str(tmp_path / "ckpt"))
    built = build_tinygpt(cfg, V, seed=0)  # the seed is ignored when a checkpoint is given
    assert torch.equal(built.tok_emb.weight, m.tok_emb.weight)
    with pytest.raises(ValueError, match="config asks for"):
        build_tinygpt(dataclasses.replace(cfg, d_model=64), V, seed=0)


def test_hf_causal_lm_adapter():
    """An HF causal LM behind the same contract: cache == full forward, and the same logprob identity."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    policy = HFCausalLMPolicy(transformers.LlamaForCausalLM(cfg)).eval()
    assert policy.vocab_size == V and policy.max_seq_len == 32
    out = sample(policy, _prompts(16), max_new_tokens=4, temperature=0.8, generator=torch.Generator().manual_seed(0))
    rows = [out.row(i) for i in range(16)]
    lp, valid = token_logprobs(policy, list(_prompts(16)), [ids for ids, _ in rows], 0.8)
    assert valid.all()
    assert (lp - out.logprobs).abs().max() < 1e-5

    # The same worker contract end to end: generate + store, train one step, sync the weights.
    from replay.storage import TRAIN_FIELDS, InMemoryRowStorage, row_keys
    from single_controller.backends.common.weights import load_snapshot, pack_weights
    from single_controller.backends.torch.generation import GenerationCore
    from single_controller.backends.torch.trainer import TrainerCore
    from single_controller.config.schema import TrainConfig
    from single_controller.types import GenerationRequest, LossConfig, SamplingParams

    storage = InMemoryRowStorage()
    gen = GenerationCore(policy, storage, "single_controller.data.tasks:positional_match_reward", version=0)
    prompts = reverse_digits(4, 3, seed=0)
    reqs = [GenerationRequest(f"h{i}", p, SamplingParams(n=4), row_keys(f"h{i}", 4)) for i, p in enumerate(prompts)]
    gen.generate(reqs)
    keys = [k for r in reqs for k in r.row_keys]
    storage.put_rows_sync(keys, {"advantage": torch.randn(16)})
    torch.manual_seed(0)
    trainer = TrainerCore(HFCausalLMPolicy(transformers.LlamaForCausalLM(cfg)), TrainConfig())
    trainer.load_weights(pack_weights(state_module(policy), 0))  # snapshots carry the HF checkpoint names
    trainer.begin_train_step(0, LossConfig())
    trainer.train_microbatch(storage.get_rows_sync(keys, TRAIN_FIELDS))
    metrics = trainer.finish_train_step(0)
    assert metrics["train/tokens"] == 48 and metrics["train/gen_logprob_gap"] < 1e-5  # same weights: on-policy
    load_snapshot(state_module(policy), trainer.publish_weights(1))
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), trainer.policy.parameters()))


def test_pad_right_equals_padding_row_by_row():
    """`pad_right` writes all rows at once; it must give exactly what padding each row does, for
    every dtype (bool included), cast, padding value, empty rows and an empty batch."""
    from torch.nn.utils.rnn import pad_sequence

    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        lengths = torch.randint(0, 7, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
        for dtype, value in [(torch.float32, 0.0), (torch.long, -1), (torch.bool, False), (torch.float64, 1.5)]:
            rows = [(torch.rand(n, generator=g) * 10).to(dtype) for n in lengths]
            width = max(lengths, default=0)
            want = (
                torch.stack([torch.cat([r, torch.full((width - len(r),), value, dtype=dtype)]) for r in rows])
                if rows
                else None
            )
            if rows and dtype is not torch.bool:
                assert torch.equal(want, pad_sequence(rows, batch_first=True, padding_value=value))
            for cast in (None, torch.float64, torch.long):
                got = pad_right(rows, value, cast)
                if not rows:
                    assert got.shape == (0, 0) and got.dtype == (cast or torch.float32)
                    continue
                assert got.dtype == (cast or dtype) and torch.equal(got, want if cast is None else want.to(cast)), (
                    lengths,
                    dtype,
                    cast,
                )
