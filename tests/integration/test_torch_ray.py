"""The CPU backend through Ray actors and TransferQueue: weight sync (acceptance 4), generation
through the client, the split train API over 2 gloo ranks, abort, checkpoint, shutdown.

One module-scoped Ray (num_cpus=4) + TQ (1 storage unit) and one set of workers: 2 trainer ranks
and 1 generation worker (ray.init ~5 s, TQ ~7 s, actors ~8 s on an idle machine). Their weights go
over the collective transport (`sync.transport: collective`, a gloo group per generation worker);
the object-store path is the default every run elsewhere uses, and the bfloat16 test runs both.
"""

import asyncio
import dataclasses
import functools
import os
import uuid
from fractions import Fraction
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["TQ_NUM_THREADS"] = "2"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from replay.storage import TRAIN_FIELDS, TRAIN_ROW_FIELDS, row_keys  # noqa: E402
from single_controller.backends.torch.model import TinyGPT, load_tinygpt  # noqa: E402
from single_controller.backends.torch.trainer import TrainerCore  # noqa: E402
from single_controller.config.schema import BackendConfig, Config, SyncConfig  # noqa: E402
from single_controller.data.tasks import TOKENIZER, reverse_digits  # noqa: E402
from single_controller.protocols import (  # noqa: E402
    GenerationWorker,
    TrainerFailed,
    TrainerGroup,
    TrainerStateLost,
    TrainStepStateError,
)
from single_controller.types import GenerationRequest, LossConfig, SamplingParams, TrainChunk  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.tq]
REPO = str(Path(__file__).resolve().parents[2])
CFG = dataclasses.replace(
    Config(seed=3),
    backend=BackendConfig(num_generation_workers=1, num_trainer_ranks=2),
    sync=SyncConfig(transport="collective"),
)


@pytest.fixture(scope="module")
def cluster():
    import ray

    from replay.transferqueue.runtime import start_tq, stop_tq

    # Workers import the repo's packages (the repo is not pip-installed in tests).
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}},
    )
    try:
        start_tq(num_storage_units=1)
        yield
    finally:
        stop_tq()
        ray.shutdown()


@pytest.fixture(scope="module")
def workers(cluster, loop):
    from replay.transferqueue.storage import TQRowStorage
    from single_controller.backends.torch.ray_workers import create_cpu_workers, shutdown_cpu_workers

    partition = f"cpu-{uuid.uuid4().hex[:8]}"
    storage = TQRowStorage(partition, timeout_s=30.0)
    factory = functools.partial(TQRowStorage.attach, partition, timeout_s=30.0)
    gens, group = loop.run_until_complete(asyncio.wait_for(create_cpu_workers(CFG, factory), 120))
    yield storage, gens, group
    loop.run_until_complete(asyncio.wait_for(shutdown_cpu_workers(gens, group), 60))


def run(loop, coro, timeout=60):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def gather(*aws):
    return await asyncio.gather(*aws)


async def rank_weights(group, rank: int) -> dict:
    return await group.ranks[rank].get_weights.remote()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k  # bit-identical


def test_workers_satisfy_the_protocols_and_start_at_version_0(workers, loop):
    storage, gens, group = workers
    assert isinstance(group, TrainerGroup) and all(isinstance(g, GenerationWorker) for g in gens)
    w0 = run(loop, rank_weights(group, 0))
    assert_same_weights(w0, run(loop, rank_weights(group, 1)))
    expected = TinyGPT(CFG.model, TOKENIZER.vocab_size, seed=CFG.seed)  # rank 0's seeded init
    assert all(np.array_equal(w0[n], p.detach().numpy()) for n, p in expected.named_parameters())
    for g in gens:
        assert run(loop, g.actor.version.remote()) == 0
        assert_same_weights(run(loop, g.actor.get_weights.remote()), w0)


def test_generate_train_sync_abort(workers, loop):
    """Generate through the clients (rows land in TQ), train one step from TQ over 2 ranks in two
    chunks, publish and load the weights (acceptance 4: bit-identical, new version), then abort."""
    storage, gens, group = workers
    prompts = reverse_digits(8, 3, seed=0)
    sampling = SamplingParams(n=4, max_new_tokens=3)
    reqs = [GenerationRequest(f"r{i}", p, sampling, row_keys(f"r{i}", 4)) for i, p in enumerate(prompts)]

    async def generate_all():
        return await asyncio.gather(*(gens[0].generate(r) for i, r in enumerate(reqs)))

    results = run(loop, generate_all())
    assert all((r.version_start, r.version_end) == (0, 0) for r in results)
    assert all(run(loop, g.in_flight()) == 0 for g in gens)
    stats = [run(loop, g.statistics()) for g in gens]
    assert sum(s.groups for s in stats) == 8 and sum(s.batches for s in stats) < 8  # concurrent calls were batched

    keys = [k for r in reqs for k in r.row_keys]
    rewards = torch.tensor([r.rewards for r in results])  # [8, 4]
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True, unbiased=False) + 1e-4)
    run(loop, storage.put_rows(keys, {"advantage": adv.reshape(-1).float()}))
    rows = run(loop, storage.get_rows(keys, list(TRAIN_FIELDS)))
    lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]

    async def train_step(step, chunks):
        await group.begin_train_step(step, LossConfig())
        flat_adv = adv.reshape(-1).tolist()
        for ci, (a, b) in enumerate(chunks):
            if ci % 2 == 0:  # advantages read from storage with the rows
                chunk = TrainChunk(step, ci, tuple(keys[a:b]), tuple(lengths[a:b]), TRAIN_FIELDS)
            else:  # carried by the chunk, as the train pump sends them: each rank gets its keys' share
                chunk = TrainChunk(
                    step, ci, tuple(keys[a:b]), tuple(lengths[a:b]), TRAIN_ROW_FIELDS, tuple(flat_adv[a:b])
                )
            await group.train_microbatch(chunk)
        return await group.finish_train_step(step)

    before = run(loop, rank_weights(group, 0))
    result = run(loop, train_step(0, [(0, 12), (12, 32)]))
    assert result.step == 0 and result.metrics["train/tokens"] == 32 * 3 and result.metrics["train/sequences"] == 32
    assert result.metrics["train/bytes_read"] > 0

    # Same step in-process on one rank from the same rows: same applied gradient (float32 rounding of
    # 2-rank vs 1-rank sums ~1e-6 relative).
    ref = TrainerCore(TinyGPT(CFG.model, TOKENIZER.vocab_size, seed=CFG.seed), CFG.train)
    ref.begin_train_step(0, LossConfig())
    ref.train_microbatch(rows)
    ref_metrics = ref.finish_train_step(0)
    assert result.metrics["train/loss"] == pytest.approx(ref_metrics["train/loss"], rel=1e-5, abs=1e-7)
    grads = [run(loop, r.get_grads.remote()) for r in group.ranks]
    for name, p in ref.policy.named_parameters():
        want = p.grad.numpy()
        for g in grads:
            assert np.linalg.norm(g[name] - want) <= 1e-5 * np.linalg.norm(want) + 1e-9, name

    after = run(loop, rank_weights(group, 0))
    assert_same_weights(after, run(loop, rank_weights(group, 1)))
    assert any(not np.array_equal(after[k], before[k]) for k in after)

    # Weight sync: publish v1 from rank 0, load into both generation workers.
    handle = run(loop, group.export_weights(1))
    assert handle.version == 1 and handle.num_bytes == 4 * sum(v.size for v in after.values())
    run(loop, gather(*(g.update_weights(handle) for g in gens)))
    for g in gens:
        assert run(loop, g.actor.version.remote()) == 1
        assert_same_weights(run(loop, g.actor.get_weights.remote()), after)
    assert (
        run(loop, gens[0].generate(GenerationRequest("v1", prompts[0], sampling, row_keys("v1", 4)))).version_start == 1
    )

    # Abort after a microbatch leaves both ranks exactly where they were; out-of-order calls raise.
    async def begin_and_abort():
        await group.begin_train_step(1, LossConfig())
        await group.train_microbatch(TrainChunk(1, 0, tuple(keys[:16]), tuple(lengths[:16]), TRAIN_FIELDS))
        with pytest.raises(TrainStepStateError):
            await group.begin_train_step(2, LossConfig())
        # a rank refuses rows meant for another step (a late or early call never mixes steps)
        with pytest.raises(TrainStepStateError, match="the open step is 1"):
            await group.ranks[0].train_microbatch_keys.remote(2, keys[:4], list(TRAIN_FIELDS))
        assert (await group.ranks[0].statistics.remote()).open_microbatches == 1
        await group.abort_train_step(1)

    run(loop, begin_and_abort())
    st = group.statistics()
    assert (st.open_step, st.steps_finished, st.steps_aborted, st.num_ranks) == (None, 1, 1, 2)
    assert st.bytes_read_total > result.metrics["train/bytes_read"]  # step 0 plus the aborted chunk
    rank_stats = run(loop, group.ranks[1].statistics.remote())
    assert (rank_stats.rank, rank_stats.steps_done, rank_stats.aborts, rank_stats.open_step) == (1, 1, 1, None)
    for rank in range(2):
        assert_same_weights(run(loop, rank_weights(group, rank)), after)
    with pytest.raises(TrainStepStateError):
        run(loop, group.train_microbatch(TrainChunk(1, 0, tuple(keys[:4]), tuple(lengths[:4]), TRAIN_FIELDS)))
    with pytest.raises(TrainStepStateError):
        run(loop, group.ranks[0].finish_train_step.remote(1))

    # Pipelined calls: the finish goes out before the microbatch's answer is back. A rank whose rows
    # cannot be read fails its microbatch; the finish behind it applies nothing on either rank, the
    # error names the microbatch, and the step stays open until it is aborted.
    # The next step's begin and first chunk sent behind that finish (`begin_behind_finish`) are
    # refused there, and step 2 is not left open.
    async def failing_microbatch_then_finish():
        await group.begin_train_step(1, LossConfig())
        missing = ("never-put/0",) + tuple(keys[:7])
        await group.train_microbatch(TrainChunk(1, 0, missing, (8,) + tuple(lengths[:7]), TRAIN_FIELDS))
        finish = asyncio.ensure_future(group.finish_train_step(1))
        await asyncio.sleep(0)  # the finish is sent
        assert await group.begin_behind_finish(
            2, LossConfig(), TrainChunk(2, 0, tuple(keys[8:16]), tuple(lengths[8:16]), TRAIN_FIELDS)
        )
        with pytest.raises(TrainerFailed, match=r"train_microbatch\(step=1, chunk=0\) failed"):
            await finish
        assert (await group.train_status()).open_step == 1
        await group.abort_train_step(1)

    run(loop, failing_microbatch_then_finish())
    assert run(loop, group.train_status()).open_step is None
    for rank in range(2):
        assert_same_weights(run(loop, rank_weights(group, rank)), after)

    # A finish that succeeds with the next step behind it: that step is open with its chunk sent,
    # and trains what the same calls made one by one would (the weights match an in-process core).
    async def two_steps_back_to_back(chunks):
        await group.begin_train_step(1, LossConfig())
        await group.train_microbatch(chunks[0])
        finish = asyncio.ensure_future(group.finish_train_step(1))
        await asyncio.sleep(0)
        assert await group.begin_behind_finish(2, LossConfig(), chunks[1])
        first = await finish
        assert group.statistics().open_step == 2 and (await group.train_status()).open_step == 2
        return first, await group.finish_train_step(2)

    halves = [
        TrainChunk(s, 0, tuple(keys[a:b]), tuple(lengths[a:b]), TRAIN_FIELDS)
        for s, (a, b) in ((1, (0, 16)), (2, (16, 32)))
    ]
    r1, r2 = run(loop, two_steps_back_to_back(halves))
    assert (r1.step, r2.step) == (1, 2) and r1.metrics["train/sequences"] == r2.metrics["train/sequences"] == 16
    for rows_slice, step in (((0, 16), 1), ((16, 32), 2)):
        ref.begin_train_step(step, LossConfig())
        ref.train_microbatch({k: (v[slice(*rows_slice)]) for k, v in rows.items()})
        ref.finish_train_step(step)
    got = run(loop, rank_weights(group, 0))
    for name, p in ref.policy.named_parameters():
        want = p.detach().numpy()
        assert np.linalg.norm(got[name] - want) <= 1e-3 * np.linalg.norm(want) + 1e-7, (
            name
        )  # float32, 2 ranks vs 1, Adam
    assert run(loop, group.export_weights(3)).version == 3
    run(loop, storage.clear_rows(keys + list(row_keys("v1", 4))))


def test_checkpoint_round_trip(workers, loop, tmp_path):
    _, _, group = workers
    path = run(loop, group.save_checkpoint(str(tmp_path / "ckpt")))
    model = load_tinygpt(path)
    w = run(loop, rank_weights(group, 0))
    assert all(np.array_equal(w[n], p.detach().numpy()) for n, p in model.named_parameters())
    assert model.cfg == dataclasses.replace(CFG.model, checkpoint=None)


def test_dead_generation_actor_fails_typed_and_restarts_with_the_given_weights(workers, loop):
    """Issue 9: a killed generation actor is reported as GenerationWorkerDied (not a Ray traceback);
    restart() brings a new process up with the weights it is given, and it serves again."""
    import ray

    from single_controller.protocols import GenerationWorkerDied

    storage, gens, group = workers
    gen = gens[-1]
    handle = run(loop, group.export_weights(7))
    old_group = gen._group
    assert old_group is not None and gen.sync_fallback is None  # v0 and v1 went over the collective
    ray.kill(gen.actor)
    req = GenerationRequest(
        "dead0", reverse_digits(1, 3, seed=5)[0], SamplingParams(n=4, max_new_tokens=3), row_keys("dead0", 4)
    )
    with pytest.raises(GenerationWorkerDied, match=gen.name):
        run(loop, gen.generate(req))
    with pytest.raises(GenerationWorkerDied):
        run(loop, gen.update_weights(handle))
    run(loop, gen.restart(handle), timeout=120)
    assert run(loop, gen.actor.version.remote()) == 7
    assert_same_weights(run(loop, gen.actor.get_weights.remote()), run(loop, rank_weights(group, 0)))
    assert gen._group is not None and gen._group[1] != old_group[1]  # the new process got a group of its own
    res = run(loop, gen.generate(dataclasses.replace(req, group_id="alive0", row_keys=row_keys("alive0", 4))))
    assert (res.version_start, res.version_end) == (7, 7)
    run(loop, storage.clear_rows(list(row_keys("alive0", 4))))


def test_trainer_state_round_trip_resumes_the_same_step(workers, loop, tmp_path):
    """Checkpoint state of every rank: policy, optimizer, next step; load_state restores it exactly."""
    _, _, group = workers
    status = run(loop, group.train_status())
    run(loop, group.save_state(str(tmp_path / "trainer")))
    before = run(loop, rank_weights(group, 0))
    assert (tmp_path / "trainer" / "trainer.pt").exists() and (tmp_path / "trainer" / "rank1_rng.pt").exists()
    assert (tmp_path / "trainer" / "policy" / "model.safetensors").exists()
    assert run(loop, group.load_state(str(tmp_path / "trainer"))) == status.next_step
    for rank in range(2):
        assert_same_weights(run(loop, rank_weights(group, rank)), before)
    after = run(loop, group.train_status())
    assert after.next_step == status.next_step and after.open_step is None


def test_a_rank_takes_read_ahead_hints_while_a_microbatch_runs(cluster, loop, tmp_path):
    """A prefetch hint reaches the rank while it is busy with a microbatch and its read starts then
    (its own thread, `rank_calls.PREFETCH_GROUP`), not after the microbatch, finish and export
    queued on the rank. Here the microbatch's own read takes 3 s (then fails); the hint is sent
    during it and its read must begin and be logged before that read ends."""
    import json
    import time

    import ray

    from replay.storage import ROLLOUT_SCHEMA, StorageReadError
    from single_controller.backends.torch.ray_workers import start_torch_trainer

    log = tmp_path / "reads.jsonl"

    class SlowReads:  # defined here: pickled by value into the rank's process
        schema = ROLLOUT_SCHEMA

        def __init__(self, path: str):
            self.path = path

        def get_rows_sync(self, keys, fields):
            t0 = time.time()
            if keys[0].startswith("slow"):
                time.sleep(3.0)
            with open(self.path, "a") as f:
                f.write(json.dumps({"keys": list(keys), "start": t0, "end": time.time()}) + "\n")
            raise StorageReadError(f"{keys}: not stored (test)")

    cfg = dataclasses.replace(CFG, backend=BackendConfig(num_generation_workers=1, num_trainer_ranks=1))
    group = run(loop, start_torch_trainer(cfg, functools.partial(SlowReads, str(log))), timeout=120)
    try:
        run(loop, group.begin_train_step(0, LossConfig()))
        busy = group.ranks[0].train_microbatch_keys.remote(0, ["slow-0"], list(TRAIN_ROW_FIELDS), [0.0])
        time.sleep(0.5)  # the microbatch is reading
        hint = TrainChunk(1, -1, ("hint-0",), (5,), TRAIN_ROW_FIELDS)
        run(loop, group.prefetch(hint), timeout=2.5)  # queued behind the microbatch, it would take >= 2.5 s
        assert not ray.wait([busy], timeout=0)[0], "the hint was answered only after the microbatch"
        with pytest.raises(ray.exceptions.RayTaskError, match="not stored"):
            ray.get(busy, timeout=30)
        reads = {r["keys"][0]: r for r in map(json.loads, log.read_text().splitlines())}
        assert set(reads) == {"slow-0", "hint-0"}, reads
        assert reads["hint-0"]["start"] < reads["slow-0"]["end"], reads  # read during the microbatch
        run(loop, group.abort_train_step(0))
    finally:
        run(loop, group.shutdown())


def test_a_type_error_in_a_ranks_loss_fails_at_once_and_is_not_retried(workers, loop):
    """A bug in the loss (here a `Fraction`, which passes the settings' checks, where the loss clamps
    the ratio to `1 + clip_high`) raises its own error
    on every call that reports it, with the rank's traceback: never the `TrainerFailed` the train pump
    aborts and retries (`rank_calls.RETRYABLE`). The step stays open until it is aborted."""
    storage, gens, group = workers
    req = GenerationRequest(
        "bug0", reverse_digits(1, 3, seed=7)[0], SamplingParams(n=4, max_new_tokens=3), row_keys("bug0", 4)
    )
    run(loop, gens[0].generate(req))
    keys = list(req.row_keys)
    rows = run(loop, storage.get_rows(keys, list(TRAIN_ROW_FIELDS)))
    lengths = tuple(len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"]))
    step = run(loop, group.train_status()).next_step

    async def step_with_a_bug_in_the_loss():
        await group.begin_train_step(step, LossConfig(clip_high=Fraction(1, 5)))
        await group.train_microbatch(
            TrainChunk(step, 0, tuple(keys), lengths, TRAIN_ROW_FIELDS, (1.0, -1.0, 0.5, -0.5))
        )
        await group.finish_train_step(step)

    with pytest.raises(TypeError, match="invalid combination of arguments") as info:
        run(loop, step_with_a_bug_in_the_loss())
    assert not isinstance(info.value, TrainerFailed)
    assert "grpo_loss" in str(info.value)  # the rank's traceback comes with it
    run(loop, group.abort_train_step(step))
    assert run(loop, group.train_status()).open_step is None
    run(loop, storage.clear_rows(keys))


async def test_rank_call_retries_only_what_a_retry_can_fix():
    """`rank_call` keeps a rank's bug as it is and makes a failure a retry can fix a `TrainerFailed`."""
    import ray

    from single_controller.backends.common.rank_calls import rank_call

    def answered(value=None, error=None) -> asyncio.Future:  # what awaiting a rank's ObjectRef gives
        fut = asyncio.get_running_loop().create_future()
        if error is None:
            fut.set_result(value)
        else:  # Ray delivers a rank's exception wrapped, an instance of the original class too
            fut.set_exception(ray.exceptions.RayTaskError("f", f"Traceback\n{error!r}", error).as_instanceof_cause())
        return fut

    with pytest.raises(TypeError) as info:
        await rank_call("train_microbatch(step=0, chunk=0)", [answered(1), answered(error=TypeError("bad operand"))])
    assert not isinstance(info.value, TrainerFailed)
    with pytest.raises(TrainerFailed, match=r"finish_train_step\(0\) failed on rank 1: reading its rows"):
        await rank_call(
            "finish_train_step(0)", [answered(1), answered(error=TrainerFailed("reading its rows: timeout"))]
        )
    # the protocol's errors a rank raises on purpose cross as themselves (#48 R8: the name a failed
    # run records is what `run.auto_resume` heals), naming the rank, Ray's error (its traceback) chained
    for error in (TrainStepStateError("step 0 is still open"), TrainerStateLost("the optimizer step failed partway")):
        with pytest.raises(type(error)) as info:
            await rank_call("begin_train_step(1)", [answered(1), answered(error=error)])
        assert type(info.value) is type(error) and str(info.value) == f"trainer rank 1: {error}"
        assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)
    assert await rank_call("train_status", [answered(1), answered(2)]) == [1, 2]


def test_an_optimizer_step_failing_partway_on_a_ray_rank_reaches_the_driver_as_trainer_state_lost(
    workers, loop, tmp_path
):
    """#48 R8 on real ranks: rank 0's optimizer step fails after moving its weights; the finish fails
    with `TrainerStateLost` itself (not Ray's `RayTaskError(TrainerStateLost)`), whose name is one
    `run.auto_resume` heals; a checkpoint load brings the ranks back to the step."""
    from single_controller.runtime.driver import HEALABLE

    storage, gens, group = workers
    before = run(loop, group.train_status())
    step = before.next_step
    run(loop, group.save_state(str(tmp_path / "trainer")))
    req = GenerationRequest(
        "lost0", reverse_digits(1, 3, seed=11)[0], SamplingParams(n=4, max_new_tokens=3), row_keys("lost0", 4)
    )
    run(loop, gens[0].generate(req))
    keys = list(req.row_keys)
    rows = run(loop, storage.get_rows(keys, list(TRAIN_ROW_FIELDS)))
    lengths = tuple(len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"]))

    def fail_after_the_update(rank):  # in rank 0's process: the update lands, then the step fails
        opt = rank.core.optimizer
        real = type(opt).step

        def step_then_fail(*a, **k):
            real(opt, *a, **k)
            raise RuntimeError("simulated failure after the update")

        opt.step = step_then_fail

    def undo(rank):
        del rank.core.optimizer.step

    run(loop, group.ranks[0].__ray_call__.remote(fail_after_the_update))
    try:
        run(loop, group.begin_train_step(step, LossConfig()))
        run(
            loop,
            group.train_microbatch(TrainChunk(step, 0, tuple(keys), lengths, TRAIN_ROW_FIELDS, (1.0, -1.0, 0.5, -0.5))),
        )
        with pytest.raises(TrainerStateLost) as info:
            run(loop, group.finish_train_step(step))
    finally:
        run(loop, group.ranks[0].__ray_call__.remote(undo))
    assert type(info.value) is TrainerStateLost and type(info.value).__name__ in HEALABLE
    assert str(info.value).startswith(f"trainer rank 0: the optimizer step of step {step} failed partway")
    assert "simulated failure after the update" in str(info.value.__cause__)  # the rank's traceback, chained
    with pytest.raises(TrainerStateLost, match=f"trainer rank 0: abort_train_step\\({step}\\)"):  # until a load
        run(loop, group.abort_train_step(step))
    assert run(loop, group.load_state(str(tmp_path / "trainer"))) == step
    run(loop, group.abort_train_step(step))  # the group's own record of the failed step (a no-op on the ranks)
    assert run(loop, group.train_status()) == before
    run(loop, storage.clear_rows(keys))


def test_shutdown_stops_the_actors(workers, loop):
    """Runs last: shuts the module's workers down (the fixture's own shutdown then finds them gone)."""
    import ray

    _, gens, group = workers
    from single_controller.backends.torch.ray_workers import shutdown_cpu_workers

    run(loop, shutdown_cpu_workers(gens, group))
    with pytest.raises(ray.exceptions.RayActorError):
        run(loop, gens[0].actor.version.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        run(loop, group.ranks[1].get_weights.remote())


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_bfloat16_workers_start_with_the_trainers_float32_weights_cast_to_bfloat16(cluster, loop, transport):
    """model.dtype=bfloat16 through Ray: rank 0 publishes its float32 masters as bfloat16 buckets
    (int16-carried through the object store, or broadcast as bfloat16 over the weight-sync group), and
    each of two generation workers holds exactly their bfloat16 cast."""
    import torch

    from replay.transferqueue.storage import TQRowStorage
    from single_controller.backends.torch.ray_workers import create_cpu_workers, shutdown_cpu_workers

    cfg = dataclasses.replace(
        CFG,
        model=dataclasses.replace(CFG.model, dtype="bfloat16"),
        backend=BackendConfig(num_generation_workers=2, num_trainer_ranks=1),
        sync=SyncConfig(transport=transport),
    )
    factory = functools.partial(TQRowStorage.attach, f"bf16-{uuid.uuid4().hex[:8]}", timeout_s=30.0)
    gens, group = run(loop, create_cpu_workers(cfg, factory), 120)
    try:
        handle = run(loop, group.export_weights(1))
        trainer = run(loop, rank_weights(group, 0))
        assert handle.num_bytes == 2 * sum(v.size for v in trainer.values())  # half of float32
        assert all(v.dtype == np.float32 for v in trainer.values())  # the masters stay float32
        want = {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for k, v in trainer.items()}
        groups = [g._group for g in gens]
        for g in gens:
            assert_same_weights(run(loop, g.actor.get_weights.remote()), want)
            assert (g._group is not None) == (transport == "collective") and g.sync_fallback is None
        handle = run(loop, group.export_weights(2))
        run(loop, gather(*(g.update_weights(handle) for g in gens)))
        assert [g._group for g in gens] == groups  # the next sync reuses each worker's group
    finally:
        run(loop, shutdown_cpu_workers(gens, group), 60)


def test_a_worker_whose_sync_group_cannot_form_says_so_and_gets_its_weights_through_the_object_store(
    cluster, loop, caplog
):
    """sync.transport=collective where no group can form (here: an NCCL group asked of a CPU build of
    torch): the worker's client logs why, once, and the same staged bytes reach it through the
    object store, bit-identical; the next sync does not try again."""
    from replay.transferqueue.storage import TQRowStorage
    from single_controller.backends.common.weight_broadcast import SyncLink
    from single_controller.backends.torch.ray_workers import create_cpu_workers, shutdown_cpu_workers

    cfg = dataclasses.replace(CFG, backend=BackendConfig(num_generation_workers=1, num_trainer_ranks=1))
    factory = functools.partial(TQRowStorage.attach, f"fallback-{uuid.uuid4().hex[:8]}", timeout_s=30.0)
    with caplog.at_level("WARNING", logger="single_controller.backends.common.actor_client"):
        gens, group = run(loop, create_cpu_workers(cfg, factory, sync=SyncLink("nccl", 20.0)), 120)
    try:
        (gen,) = gens
        assert gen._group is None and "gen0" in caplog.text and "object store" in caplog.text
        assert gen.sync_fallback is not None and "nccl" in gen.sync_fallback.lower()
        run(loop, gen.update_weights(run(loop, group.export_weights(1))))
        assert run(loop, gen.actor.version.remote()) == 1
        assert_same_weights(run(loop, gen.actor.get_weights.remote()), run(loop, rank_weights(group, 0)))
        assert caplog.text.count("no weight-sync group") == 1
    finally:
        run(loop, shutdown_cpu_workers(gens, group), 60)


def test_the_trainer_group_measures_each_rows_kl_to_the_reference_for_the_reward(cluster, loop):
    """reward.kl_coef: the group splits the rows over its 2 ranks by tokens, each reads its share from
    storage, and the answers come back in the keys' order, equal to one plain trainer's."""
    from replay.transferqueue.storage import TQRowStorage
    from single_controller.backends.torch.ray_workers import create_cpu_workers, shutdown_cpu_workers
    from single_controller.config.schema import RewardConfig

    cfg = dataclasses.replace(CFG, reward=RewardConfig(kl_coef=0.1))
    partition = f"kl-{uuid.uuid4().hex[:8]}"
    storage = TQRowStorage(partition, timeout_s=30.0)
    factory = functools.partial(TQRowStorage.attach, partition, timeout_s=30.0)
    gens, group = run(loop, create_cpu_workers(cfg, factory), 120)
    try:
        sampling = SamplingParams(n=4, max_new_tokens=3)
        reqs = [
            GenerationRequest(f"k{i}", p, sampling, row_keys(f"k{i}", 4))
            for i, p in enumerate(reverse_digits(3, 3, seed=1))
        ]
        run(loop, gather(*(gens[0].generate(r) for r in reqs)))
        keys = [k for r in reqs for k in r.row_keys]
        stored = dict(run(loop, storage.get_rows(keys, list(TRAIN_ROW_FIELDS))))
        stored["gen_logprobs"] = [g - 0.05 * (i + 1) for i, g in enumerate(stored["gen_logprobs"])]  # KLs differ
        run(loop, storage.put_rows(keys, stored))
        keys = keys[::-1]  # not the stored order
        rows = run(loop, storage.get_rows(keys, list(TRAIN_ROW_FIELDS)))
        lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
        got = run(loop, group.reward_kl(keys, lengths, "k3"))
        plain = TrainerCore(TinyGPT(cfg.model, TOKENIZER.vocab_size, seed=cfg.seed), cfg.train, keep_reference=True)
        assert got == pytest.approx(plain.reward_kl(rows, "k3"), rel=1e-6, abs=1e-9)
        assert len({round(x, 6) for x in got}) == 12
    finally:
        run(loop, shutdown_cpu_workers(gens, group), 60)
