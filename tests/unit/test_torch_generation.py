"""GenerationCore and the batching GenerationActor on a plain event loop (no Ray)."""

import asyncio
import dataclasses
import threading

import pytest
import torch

from replay.storage import GENERATION_FIELDS, InMemoryRowStorage, row_keys
from single_controller.algorithm.logprobs import token_logprobs
from single_controller.backends.common.weights import pack_weights
from single_controller.backends.torch.generation import GenerationActor, GenerationCore
from single_controller.backends.torch.model import TinyGPT
from single_controller.config.schema import ModelConfig
from single_controller.data.tasks import TOKENIZER, positional_match_reward, reverse_digits
from single_controller.protocols import GenerationFailed, RewardFailed
from single_controller.types import GenerationRequest, SamplingParams, WeightsHandle
from tests.helpers.torch_generation import PROMPTS, GatedCore, request

torch.set_num_threads(1)
REWARD = "single_controller.data.tasks:positional_match_reward"


def trained_like_model(seed=0) -> TinyGPT:
    return TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=seed)


def test_core_generates_scores_and_stores_a_batch_in_one_put():
    storage = InMemoryRowStorage()
    model = trained_like_model()
    core = GenerationCore(model, storage, REWARD, seed=0, version=3)
    four_digit = reverse_digits(1, 4, seed=1)[0]  # a longer prompt: a second sampling pass
    reqs = [
        request(0),
        request(1, n=3, temperature=0.8, top_p=0.9),
        request(2, n=2, prompt=four_digit, max_new_tokens=4),
        request(3, n=5, max_new_tokens=6, stop_token_ids=(TOKENIZER.eos_id,)),
    ]
    results = core.generate(reqs)
    assert storage.statistics().puts == 1 and storage.statistics().rows_put == 4 + 3 + 2 + 5
    for req, res in zip(reqs, results):
        assert res.group_id == req.group_id and (res.version_start, res.version_end) == (3, 3)
        assert res.prompt_length == len(req.prompt.token_ids)
        rows = storage.get_rows_sync(req.row_keys, GENERATION_FIELDS)
        assert [len(r) for r in rows["response_ids"]] == list(res.response_lengths)
        assert rows["reward"].tolist() == pytest.approx(list(res.rewards))
        for k, ids, lp, mask, prompt_ids in zip(
            req.row_keys, rows["response_ids"], rows["gen_logprobs"], rows["response_mask"], rows["prompt_ids"]
        ):
            assert prompt_ids.tolist() == list(req.prompt.token_ids)
            assert mask.all() and len(mask) == len(ids) == len(lp) <= req.sampling.max_new_tokens
            stop = req.sampling.stop_token_ids
            if stop and len(ids) < req.sampling.max_new_tokens:
                assert ids[-1] in stop and not any(t in stop for t in ids[:-1].tolist())
            text = TOKENIZER.decode(ids[:-1] if stop and ids[-1] in stop else ids)
            # cut short: stop tokens were asked for and the completion ends without one
            cut = res.truncated[req.row_keys.index(k)]
            assert cut == (bool(stop) and int(ids[-1]) not in stop)
            assert not cut or len(ids) == req.sampling.max_new_tokens
            assert storage.tags(k) == {}  # provenance is in the row itself: its key and token_versions
            assert (rows["token_versions"][req.row_keys.index(k)] == 3).all()
            assert positional_match_reward(req.prompt, text) == pytest.approx(
                rows["reward"][req.row_keys.index(k)].item()
            )
        # the stored logprobs are what the trainer computes for these tokens
        tlp, valid = token_logprobs(model, rows["prompt_ids"], rows["response_ids"], req.sampling.temperature)
        assert (tlp[valid] - torch.cat(rows["gen_logprobs"])).abs().max() < 1e-5
    assert core.statistics().batches == 1 and core.statistics().groups == 4
    assert not any(t for res in results[:3] for t in res.truncated)  # no stop token: a fixed length, never cut
    assert len(results[3].truncated) == 5


def test_a_completion_that_reaches_its_length_before_a_stop_token_is_reported_cut():
    """Two tokens for a three-digit answer and its stop token: every completion is cut; with room for
    more, those that stop are not (`GenerationResult.truncated`, the `rollout/truncated_rate` of a step)."""
    core = GenerationCore(trained_like_model(), InMemoryRowStorage(), REWARD, seed=0, version=0)
    short, room = core.generate(
        [
            request(0, n=4, max_new_tokens=2, stop_token_ids=(TOKENIZER.eos_id,)),
            request(1, n=4, max_new_tokens=6, stop_token_ids=(TOKENIZER.eos_id,)),
        ]
    )
    assert short.truncated == (True,) * 4 and short.response_lengths == (2,) * 4
    assert not all(room.truncated)  # some stopped with room left (the others ran to 6 tokens)
    assert all(n == 6 for n, cut in zip(room.response_lengths, room.truncated) if cut)


def _picky_reward(prompt, text):
    """positional_match_reward, but it raises on PROMPTS[1] and gives a NaN on PROMPTS[2]."""
    if prompt.prompt_id == PROMPTS[1].prompt_id:
        raise ValueError("cannot parse the answer")
    return float("nan") if prompt.prompt_id == PROMPTS[2].prompt_id else positional_match_reward(prompt, text)


def test_a_reward_that_raises_or_is_nan_fails_its_own_group_and_spares_its_batch_mates():
    storage = InMemoryRowStorage()
    core = GenerationCore(trained_like_model(), storage, _picky_reward, seed=0, version=1, name="gen-7")
    results = core.generate([request(i) for i in range(4)])
    raised, nan = results[1], results[2]
    assert isinstance(raised, RewardFailed) and isinstance(nan, RewardFailed)
    assert "gen-7: reward function failed on completion 0 of group grp1: ValueError: cannot parse" in str(raised)
    assert "gen-7: reward function gave nan for completion 0 of group grp2" in str(nan)
    # the batch-mates are answered and stored, in the batch's one put; nothing of the failed groups
    assert [r.group_id for r in (results[0], results[3])] == ["grp0", "grp3"]
    assert storage.statistics().puts == 1
    assert storage.statistics().resident_rows == 8  # the 4 + 4 rows of grp0 and grp3, read below
    for res, req in ((results[0], request(0)), (results[3], request(3))):
        assert storage.get_rows_sync(req.row_keys, ["reward"])["reward"].tolist() == pytest.approx(list(res.rewards))
    stats = core.statistics()
    assert (stats.groups, stats.reward_failures, stats.rows) == (2, 2, 8)


async def test_the_actor_answers_a_failed_reward_to_its_own_caller_only():
    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=4, reward=_picky_reward)
    await actor.update_weights(handle(0, seed=0))
    out = await actor.generate_many([request(i) for i in range(4)])  # one batch
    assert [type(r).__name__ for r in out] == ["GenerationResult", "RewardFailed", "RewardFailed", "GenerationResult"]
    with pytest.raises(RewardFailed, match="group grp1"):
        await actor.generate(request(1))
    assert (await actor.generate(request(5))).group_id == "grp5"  # the actor serves on
    await actor.close()


def test_core_refuses_without_weights_and_bad_requests():
    core = GenerationCore(trained_like_model(), InMemoryRowStorage(), REWARD)
    with pytest.raises(GenerationFailed, match="no weights"):
        core.generate([request(0)])
    core.version = 0
    bad = GenerationRequest("g", PROMPTS[0], SamplingParams(n=3), row_keys("g", 2))
    with pytest.raises(ValueError, match="2 row keys for n=3"):
        core.generate([bad])


def make_actor(storage, max_batch_groups=4, reward=REWARD) -> GenerationActor:
    return GenerationActor(
        "gen-test", ModelConfig(), lambda: storage, reward, seed=0, max_batch_groups=max_batch_groups
    )


def handle(version: int, seed: int) -> WeightsHandle:
    snap = pack_weights(trained_like_model(seed), version)
    return WeightsHandle(version, snap, snap.manifest.num_bytes)


async def test_actor_batches_concurrent_requests_and_applies_weights_between_batches():
    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=4)
    assert await actor.update_weights(handle(0, seed=0)) == 0
    src = trained_like_model(0)
    weights = await actor.get_weights()
    assert all(torch.equal(torch.from_numpy(weights[n]), p) for n, p in src.named_parameters())

    gate = GatedCore(actor._core)
    gate.release.set()
    results = await asyncio.gather(*(actor.generate(request(i)) for i in range(10)))
    assert gate.batches == [[f"grp{i}" for i in range(4)], [f"grp{i}" for i in range(4, 8)], ["grp8", "grp9"]]
    assert storage.statistics().puts == 3  # one put per batch
    assert [r.group_id for r in results] == [f"grp{i}" for i in range(10)]
    assert await actor.in_flight() == 0

    # A weight update waits for the batch being sampled; that batch keeps the old version.
    gate.release.clear()
    gate.started.clear()
    first = asyncio.create_task(actor.generate(request(10)))
    await asyncio.to_thread(gate.started.wait, 10)
    assert await actor.in_flight() == 1
    update = asyncio.create_task(actor.update_weights(handle(1, seed=1)))
    queued = asyncio.create_task(actor.generate(request(11)))
    for _ in range(20):
        await asyncio.sleep(0)  # give the update every chance to (wrongly) get through
    assert not update.done() and await actor.version() == 0
    assert await actor.in_flight() == 2
    gate.release.set()
    assert (await first).version_start == 0
    assert await update == 1
    r11 = await queued
    assert (r11.version_start, r11.version_end) == (1, 1)
    weights = await actor.get_weights()
    assert all(torch.equal(torch.from_numpy(weights[n]), p) for n, p in trained_like_model(1).named_parameters())
    with pytest.raises(ValueError, match="older"):
        await actor.update_weights(handle(0, seed=0))
    await actor.close()


async def test_actor_cancel_failure_and_close():
    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=1)
    with pytest.raises(GenerationFailed, match="no weights"):
        await actor.generate(request(0))  # refused before any update, delivered to the caller
    await actor.update_weights(handle(0, seed=0))
    gate = GatedCore(actor._core)
    busy = asyncio.create_task(actor.generate(request(1)))
    await asyncio.to_thread(gate.started.wait, 10)
    cancelled = asyncio.create_task(actor.generate(request(2)))
    later = asyncio.create_task(actor.generate(request(3)))
    await asyncio.sleep(0)
    cancelled.cancel()
    gate.release.set()
    await busy
    await later
    assert cancelled.cancelled()
    assert gate.batches == [["grp1"], ["grp3"]]  # the cancelled queued request never ran
    assert not (await storage.resident_keys()) & set(row_keys("grp2", 4))

    # A failing batch fails its callers and the loop goes on serving.
    def broken(requests):
        raise RuntimeError("reward server down")

    gate.inner = broken
    with pytest.raises(GenerationFailed, match="reward server down"):
        await actor.generate(request(4))
    gate.inner = actor._core.__class__.generate.__get__(actor._core)
    assert (await actor.generate(request(5))).group_id == "grp5"

    # close fails what is queued and refuses new work
    gate.release.clear()
    gate.started.clear()
    running = asyncio.create_task(actor.generate(request(6)))
    await asyncio.to_thread(gate.started.wait, 10)
    queued = asyncio.create_task(actor.generate(request(7)))
    await asyncio.sleep(0)
    await actor.close()
    with pytest.raises(GenerationFailed, match="stopped before serving group grp7"):
        await queued
    with pytest.raises(GenerationFailed, match="closed while sampling group grp6"):
        await running
    with pytest.raises(GenerationFailed, match="closed"):
        await actor.generate(request(8))
    gate.release.set()


async def test_cancel_of_a_group_being_sampled_means_its_rows_are_never_written():
    """Issue 9, defect 2: a group cancelled while its batch samples must not be stored afterwards
    (the controller clears its keys right after the cancel returns). Checked by listing every key."""

    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=4)
    await actor.update_weights(handle(0, seed=0))
    gate = GatedCore(actor._core)
    call = asyncio.create_task(actor.generate_many([request(1), request(2)]))
    await asyncio.to_thread(gate.started.wait, 10)  # grp1 and grp2 are being sampled
    assert await actor.cancel("grp1") is False  # nothing stored yet, and now nothing will be
    gate.release.set()
    results = await call
    assert isinstance(results[0], GenerationFailed) and results[1].group_id == "grp2"
    assert await storage.resident_keys() == set(row_keys("grp2", 4))
    await actor.close()


async def test_actor_pause_finishes_the_running_batch_then_holds_requests_until_resume():
    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=1)
    await actor.update_weights(handle(0, seed=0))
    gate = GatedCore(actor._core)
    running = asyncio.create_task(actor.generate(request(0)))
    await asyncio.to_thread(gate.started.wait, 10)
    pause = asyncio.create_task(actor.pause())
    queued = asyncio.create_task(actor.generate(request(1)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not pause.done(), "pause returned while a batch was still sampling"
    gate.release.set()
    assert (await running).group_id == "grp0"
    assert await pause == 1  # grp1 is queued, not served
    await asyncio.sleep(0.3)  # real time for a (wrongly) unpaused loop to sample grp1 on its thread
    assert not queued.done() and gate.batches == [["grp0"]]
    await actor.resume()
    assert (await asyncio.wait_for(queued, 10)).group_id == "grp1"
    assert gate.batches == [["grp0"], ["grp1"]]
    await actor.close()


async def test_actor_holds_a_request_until_it_has_the_weights_of_its_min_version():
    """`protocols.VersionGated`: a request for weights the actor does not have yet waits in its lane
    (whatever order it and the update arrive in), is then served with those weights, and can be
    cancelled while it waits; one for weights it has, or with no min_version, goes at once."""
    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=4)
    early = asyncio.create_task(actor.generate(dataclasses.replace(request(0), min_version=0)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not early.done() and await actor.in_flight() == 1  # held, not refused for lack of weights
    assert await actor.running() == {}  # held is not work: the rollout pump's deadline does not run for it
    assert await actor.update_weights(handle(0, seed=0)) == 0
    r0 = await asyncio.wait_for(early, 10)
    assert (r0.version_start, r0.version_end) == (0, 0)

    held = asyncio.create_task(actor.generate(dataclasses.replace(request(1), min_version=1)))
    behind = asyncio.create_task(actor.generate(dataclasses.replace(request(2), min_version=1)))
    dropped = asyncio.create_task(actor.generate(dataclasses.replace(request(3), min_version=1)))
    old_ok = await asyncio.wait_for(actor.generate(dataclasses.replace(request(4), min_version=0)), 10)
    assert old_ok.version_start == 0  # not held up behind the requests waiting for v1
    for _ in range(20):
        await asyncio.sleep(0)
    assert not held.done() and not behind.done() and storage.statistics().puts == 2
    assert await actor.running() == {}
    dropped.cancel()
    assert await actor.update_weights(handle(1, seed=1)) == 1
    r1, r2 = await asyncio.wait_for(asyncio.gather(held, behind), 10)
    assert (r1.version_start, r2.version_start) == (1, 1)
    assert dropped.cancelled()
    stats = storage.statistics()
    assert (stats.puts, stats.rows_put) == (3, 4 * 4)  # grp0, grp4, then grp1 + grp2 in one batch; grp3 never sampled
    assert await actor.in_flight() == 0
    await actor.close()


def _greedy(gid: str) -> GenerationRequest:
    return GenerationRequest(gid, PROMPTS[0], SamplingParams(n=2, temperature=0.0, max_new_tokens=4), row_keys(gid, 2))


@pytest.mark.parametrize("level", [1, 2])
async def test_a_sleeping_actor_frees_its_weights_and_after_wake_and_update_gives_identical_logprobs(level):
    storage = InMemoryRowStorage()
    actor = make_actor(storage)
    weights = handle(0, seed=0)
    await actor.update_weights(weights)
    before = await actor.generate(_greedy("before"))
    params = list(actor._core.policy.parameters())
    assert sum(p.untyped_storage().nbytes() for p in params) > 0

    await actor.sleep(level)
    await actor.sleep(level)  # idempotent
    assert sum(p.untyped_storage().nbytes() for p in params) == 0  # the weights' memory is given back
    assert await actor.policy_version() is None  # nothing that could be served stale
    with pytest.raises(GenerationFailed, match="while asleep"):
        await actor.update_weights(weights)
    held = asyncio.create_task(actor.generate(_greedy("held")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not held.done()  # asleep: no batch starts

    await actor.wake()
    await actor.wake()  # idempotent
    for _ in range(20):
        await asyncio.sleep(0)
    assert not held.done() and await actor.policy_version() is None  # woken, but with no weights yet
    assert await actor.update_weights(weights) == 0
    after = await held
    assert after.version_start == 0 and after.response_lengths == before.response_lengths
    rows = [storage.get_rows_sync(row_keys(g, 2), GENERATION_FIELDS) for g in ("before", "held")]
    for field in ("response_ids", "gen_logprobs"):
        assert all(torch.equal(a, b) for a, b in zip(rows[0][field], rows[1][field]))
    await actor.close()


def test_a_groups_tokens_depend_on_its_prompt_and_attempt_not_on_its_worker_or_batch():
    # Two workers of one run (different worker seeds): a group sampled alone on one and inside a batch
    # of other groups on the other draws the same tokens (the pool moves a run's groups between
    # workers; `sampling.row_uniforms`); another attempt of the same prompt draws other ones.
    model = trained_like_model()
    alone = GenerationCore(model, InMemoryRowStorage(), REWARD, seed=1000, version=0, sampling_seed=7)
    batched = GenerationCore(model, InMemoryRowStorage(), REWARD, seed=1001, version=0, sampling_seed=7)
    target = request(5, n=8, temperature=1.0, max_new_tokens=6)
    (one,) = alone.generate([target])
    many = batched.generate([request(1, n=4), target, request(2, n=3, top_p=0.9)])
    assert many[1].response_lengths == one.response_lengths
    stored = [core.storage.get_rows_sync(target.row_keys, GENERATION_FIELDS) for core in (alone, batched)]
    a, b = ([r.tolist() for r in s["response_ids"]] for s in stored)
    assert a == b
    retry = dataclasses.replace(target, group_id="grp5-a1", row_keys=row_keys("grp5-a1", 8))
    alone.generate([retry])
    c = [r.tolist() for r in alone.storage.get_rows_sync(retry.row_keys, GENERATION_FIELDS)["response_ids"]]
    assert c != a  # 8 rows x 6 tokens over 19 symbols: the same draws again would be a bug


def test_seeded_draws_follow_the_policy_distribution_and_respect_top_p():
    from single_controller.backends.torch.sampling import _draw, row_uniforms

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logp = probs.log().expand(10000, 4)
    u = row_uniforms(0, [("g", j) for j in range(10000)], 1)[:, 0]
    freq = torch.bincount(_draw(logp, 1.0, None, u), minlength=4).double() / 10000
    # binomial std at p=0.5, n=10000 is 0.005: 4 sigma
    assert torch.allclose(freq, probs.double(), atol=0.02), freq
    kept = torch.bincount(_draw(logp, 0.8, None, u), minlength=4)  # the nucleus of mass 0.8: tokens 0 and 1
    assert kept[2:].sum() == 0 and kept[0] > kept[1] > 0


async def test_actor_reports_the_groups_of_the_batch_being_sampled_with_how_long_they_have_run():
    """`protocols.ReportsRunning`: answered on the actor's loop while a batch samples in its thread;
    what is queued behind the batch is absent (the rollout pump's deadline measures only the work)."""
    storage = InMemoryRowStorage()
    actor = make_actor(storage, max_batch_groups=1)
    assert await actor.update_weights(handle(0, seed=0)) == 0
    gate = threading.Event()
    sample = actor._generate_in_turn
    actor._generate_in_turn = lambda reqs: (gate.wait(10), sample(reqs))[1]  # the batch's thread waits
    first = asyncio.create_task(actor.generate(request(0)))
    queued = asyncio.create_task(actor.generate(request(1)))
    while not await actor.running():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    running = await actor.running()
    assert list(running) == [request(0).group_id] and 0.05 <= running[request(0).group_id] < 10
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, queued), 10)
    assert await actor.running() == {}
    await actor.close()


async def test_a_cancel_that_runs_before_its_request_arrives_leaves_no_row_behind():
    """An async Ray actor does not start calls in the order they were sent: the controller's
    `cancel(g)` (after a shrink aborted g) can run before the `generate_many` carrying g. The group
    is then refused when it arrives, and no row of it is written after its keys were cleared (seen
    once as 16 rows left in storage after a pool run)."""
    storage = InMemoryRowStorage()
    actor = make_actor(storage)
    await actor.update_weights(handle(0, seed=0))
    assert await actor.cancel("grp1") is False  # not arrived yet
    results = await actor.generate_many([request(1), request(2)])
    assert isinstance(results[0], GenerationFailed) and "cancelled" in str(results[0])
    assert results[1].group_id == "grp2"
    stats = storage.statistics()
    assert (stats.puts, stats.resident_rows) == (1, len(request(2).row_keys))  # grp2's rows only
    await actor.close()
