"""Evaluation during asynchronous training (issue 14): the held-out split, the workers' eval lane, the config
checks, and the metrics it leaves. The eval pump on the simulated backend: test_eval_pump.py; the embedded run
with eval on: tests/e2e/test_eval_run.py."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
import torch

from pumps.eval import eval_metrics
from replay.storage import InMemoryRowStorage, row_keys
from single_controller.backends.sim import SimGenerationWorker, sim_eval_rewards
from single_controller.config.schema import Config, EvalConfig, RunConfig
from single_controller.data.tasks import (
    EVAL_DATASETS,
    TASKS,
    TOKENIZER,
    is_held_out,
    load_eval_prompts,
)
from single_controller.preflight.loader import ConfigError, load_config
from single_controller.preflight.rules import DIGIT_TASKS
from single_controller.runtime.actor_host import make_dataloader
from single_controller.types import GenerationRequest, GenerationResult, Prompt, SamplingParams, WeightsHandle
from tests.helpers.sim import EVAL_PROMPTS, eval_cfg, make_cfg, run_eval_sim


# -- the held-out split ------------------------------------------------------------------------
def _digits(p: Prompt) -> str:
    return TOKENIZER.decode(p.token_ids)[1:-1]


@pytest.mark.parametrize("task", DIGIT_TASKS)  # the environments' tasks: tests/unit/test_envs.py
@pytest.mark.parametrize("num_digits", [1, 2, 3, 5])
def test_held_out_split_is_disjoint_from_every_training_pool(task, num_digits):
    held_out = EVAL_DATASETS[f"{task}.held_out"](10_000, num_digits, 0)
    assert held_out and all(is_held_out(_digits(p)) for p in held_out)
    assert len({p.token_ids for p in held_out}) == len(held_out)  # distinct prompts
    if num_digits <= 2:  # small spaces are enumerated: every held-out string is there
        assert {_digits(p) for p in held_out} == {
            s for s in (str(i).zfill(num_digits) for i in range(10**num_digits)) if is_held_out(s)
        }
    for seed in range(3):
        train = TASKS[task](500, num_digits, seed)
        assert not {p.token_ids for p in train} & {p.token_ids for p in held_out}
        assert not any(is_held_out(_digits(p)) for p in train)
    # about 1 string in 10 is held out (3 digits: 87 of 1000)
    assert sum(is_held_out(str(i).zfill(3)) for i in range(1000)) == 87


def test_training_dataloader_never_yields_an_eval_prompt(monkeypatch):
    cfg = load_config(None, ["eval.enabled=true", "task.num_prompts=300"])
    eval_ids = {p.token_ids for p in load_eval_prompts(cfg)}
    assert len(eval_ids) == 64
    loader = make_dataloader(cfg)
    assert not any(next(loader).token_ids in eval_ids for _ in range(900))  # three epochs
    # A custom eval set overlapping the training pool is taken out of training.
    overlap = TASKS["reverse_digits"](20, 3, 0)
    monkeypatch.setitem(sys.modules, "_sc_eval_custom", types.SimpleNamespace(overlap=lambda n, d, s: overlap[:n]))
    cfg = load_config(
        None, ["eval.enabled=true", "eval.dataset=_sc_eval_custom:overlap", "eval.num_prompts=5", "task.num_prompts=20"]
    )
    excluded = {p.token_ids for p in overlap[:5]}
    taken = [p for p, _ in zip(make_dataloader(cfg), range(60))]
    assert taken and not any(p.token_ids in excluded for p in taken)


def test_eval_metrics_by_hand():
    res = [
        GenerationResult("a", (1.0, 0.5), (3, 3), 5, 2, 2),  # one success of two
        GenerationResult("b", (0.0, 0.25), (3, 2), 5, 2, 2),  # none
    ]
    m = eval_metrics(res, success_reward=1.0)
    # accuracy 1/4 completions; reward (1 + .5 + 0 + .25) / 4; pass@2: prompt a solved, b not
    assert m == {
        "eval/accuracy": 0.25,
        "eval/reward_mean": 0.4375,
        "eval/pass@2": 0.5,
        "eval/tokens": 11.0,
        "eval/prompts": 2.0,
    }


# -- the workers' eval lane ----------------------------------------------------------------------
async def test_sim_worker_queue_eval_lane_first_fifo_within_skipping_cancelled_callers_versions_at_start():
    storage = InMemoryRowStorage()
    w = SimGenerationWorker("g", storage, group_s=0.004, writes_rows=False)
    sp = SamplingParams(2, max_new_tokens=3)
    done: list[tuple[str, int]] = []

    def req(i, ev=False):
        if ev:
            return GenerationRequest(
                f"eval0-h{i}-a0", Prompt(f"h{i}", (1, 2)), SamplingParams(2, temperature=0.0), eval=True
            )
        return GenerationRequest(f"p{i}-a0", Prompt(f"p{i}", (1, 2)), sp, row_keys(f"p{i}-a0", 2))

    async def go(r):
        res = await w.generate(r)
        done.append((res.group_id, res.version_start))

    first = asyncio.create_task(go(req(0)))
    await asyncio.sleep(0)  # p0's compute starts at v0
    tasks = [asyncio.create_task(go(r)) for r in [req(1), req(2), req(1, ev=True), req(2, ev=True), req(3, ev=True)]]
    await asyncio.sleep(0)  # all queued behind p0
    tasks[3].cancel()  # h2's caller stops waiting: it leaves the queue
    update = asyncio.create_task(w.update_weights(WeightsHandle(1, None, 0)))
    await asyncio.sleep(0)
    assert not update.done() and w.version == 0  # lands after p0, ahead of the queue
    await asyncio.gather(first, update, *[t for i, t in enumerate(tasks) if i != 3])
    assert done == [("p0-a0", 0), ("eval0-h1-a0", 1), ("eval0-h3-a0", 1), ("p1-a0", 1), ("p2-a0", 1)]
    assert w.evaluated == [("eval0-h1-a0", 1), ("eval0-h3-a0", 1)] and await w.in_flight() == 0


async def test_sim_batching_worker_serves_a_ticks_requests_together_at_one_version_and_updates_between_batches():
    """`max_batch > 1` (what `bench scale` simulates, as the shipped clients batch): the requests of
    one tick form a batch of at most `max_batch`, served at one version, all answered at its end on
    one timer, after the sum of their times; a weight update lands between batches; a caller that
    stops waiting leaves the others' results and the batch's time as they were."""
    storage = InMemoryRowStorage()
    w = SimGenerationWorker("g", storage, group_s=0.01, writes_rows=False, max_batch=3)
    sp = SamplingParams(2, max_new_tokens=3)
    loop = asyncio.get_running_loop()
    done: dict[str, tuple[int, float]] = {}

    async def go(i):
        res = await w.generate(GenerationRequest(f"p{i}-a0", Prompt(f"p{i}", (1, 2)), sp, row_keys(f"p{i}-a0", 2)))
        done[res.group_id] = (res.version_start, loop.time())

    t0 = loop.time()
    tasks = [asyncio.create_task(go(i)) for i in range(5)]  # one tick: one wave of requests
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the first batch (p0..p2) is computing, p3 and p4 queue
    tasks[1].cancel()  # p1's caller stops waiting mid-batch
    update = asyncio.create_task(w.update_weights(WeightsHandle(1, None, 0)))
    await asyncio.sleep(0)
    assert not update.done() and w.version == 0
    await asyncio.gather(update, *[t for i, t in enumerate(tasks) if i != 1])
    assert sorted(done) == ["p0-a0", "p2-a0", "p3-a0", "p4-a0"]
    (v0, e0), (v2, e2), (v3, e3), (v4, e4) = (done[k] for k in sorted(done))
    assert (v0, v2, v3, v4) == (0, 0, 1, 1)  # one version per batch; the update landed between them
    assert (
        abs(e2 - e0) < 0.004 and abs(e4 - e3) < 0.004
    )  # each batch's results come back together (serially: 0.01 apart)
    assert e0 - t0 >= 0.03 - 0.002 and e3 - e0 >= 0.02 - 0.002  # each batch takes its requests' summed time
    assert await w.in_flight() == 0
    with pytest.raises(ValueError, match="max_batch"):
        SimGenerationWorker("g", storage, max_batch=0)


async def test_sim_worker_serves_eval_ahead_of_queued_rollouts_and_stores_nothing():
    storage = InMemoryRowStorage()
    # a group takes 50 ms: the eval request (sent 5 ms in) must arrive while p0 computes, even on
    # a loaded machine (with 5 ms groups and a 1 ms sleep, a scheduling hiccup let p1 start first)
    w = SimGenerationWorker("g", storage, group_s=0.05)
    sp = SamplingParams(2, max_new_tokens=3)
    rollouts = [GenerationRequest(f"p{i}-a0", Prompt(f"p{i}", (1, 2)), sp, row_keys(f"p{i}-a0", 2)) for i in range(4)]
    done: list[str] = []

    async def go(req):
        res = await w.generate(req)
        done.append(res.group_id)
        return res

    tasks = [asyncio.create_task(go(r)) for r in rollouts]
    await asyncio.sleep(0.005)  # p0 is being generated, p1..p3 queue
    ev = GenerationRequest("eval0-h1-a0", Prompt("h1", (1, 2)), SamplingParams(3, temperature=0.0), eval=True)
    res = await go(ev)
    await asyncio.gather(*tasks)
    assert done[:2] == ["p0-a0", "eval0-h1-a0"]
    assert res.rewards == sim_eval_rewards("h1", 0, 3) and (res.version_start, res.version_end) == (0, 0)
    assert storage.statistics().rows_put == 8 and w.evaluated == [("eval0-h1-a0", 0)]


def test_eval_request_carries_no_row_keys():
    with pytest.raises(ValueError, match="must not carry row keys"):
        GenerationRequest("e", Prompt("h", (1,)), SamplingParams(1), ("k",), eval=True)


def _cpu_core(storage, version=0):
    from single_controller.backends.torch.generation import GenerationCore
    from single_controller.backends.torch.model import TinyGPT
    from single_controller.config.schema import ModelConfig

    torch.set_num_threads(1)
    model = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=3)
    return GenerationCore(
        model, storage, "single_controller.data.tasks:positional_match_reward", seed=0, version=version
    ), model


async def test_cpu_core_scores_eval_requests_greedily_and_stores_only_rollout_rows():
    from single_controller.backends.torch.sampling import sample
    from single_controller.data.tasks import positional_match_reward

    storage = InMemoryRowStorage()
    core, model = _cpu_core(storage, version=4)
    prompts = EVAL_PROMPTS[:3]
    greedy = SamplingParams(1, temperature=0.0, max_new_tokens=3)
    rollout = GenerationRequest("g0", TASKS["reverse_digits"](1, 3, 0)[0], SamplingParams(4), row_keys("g0", 4))
    evals = [GenerationRequest(f"eval0-{p.prompt_id}-a0", p, greedy, eval=True) for p in prompts]
    results = core.generate([evals[0], rollout, *evals[1:]])
    assert storage.statistics().puts == 1 and storage.statistics().rows_put == 4
    assert set(await storage.resident_keys()) == set(row_keys("g0", 4))
    out = sample(model, torch.tensor([p.token_ids for p in prompts]), max_new_tokens=3, greedy=True)
    for i, (p, res) in enumerate(zip(prompts, [results[0], *results[2:]])):
        text = TOKENIZER.decode(out.row(i)[0].tolist())
        assert res.rewards == (positional_match_reward(p, text),)
        assert (res.version_start, res.version_end, res.response_lengths) == (4, 4, (3,))
    again = core.generate(evals)  # greedy: the same answers again
    assert [r.rewards for r in again] == [r.rewards for r in (results[0], *results[2:])]
    assert core.statistics().eval_requests == 6 and core.statistics().groups == 1


async def test_cpu_actor_takes_the_eval_lane_first():
    from single_controller.backends.torch.generation import GenerationActor
    from single_controller.backends.torch.trainer import pack_weights
    from single_controller.config.schema import ModelConfig
    from tests.helpers.torch_generation import GatedCore, request

    storage = InMemoryRowStorage()
    actor = GenerationActor(
        "gen-eval",
        ModelConfig(),
        lambda: storage,
        "single_controller.data.tasks:positional_match_reward",
        max_batch_groups=4,
    )
    _, model = _cpu_core(storage)
    snap = pack_weights(model, 0)
    await actor.update_weights(WeightsHandle(0, snap, snap.manifest.num_bytes))
    gate = GatedCore(actor._core)
    first = asyncio.create_task(actor.generate(request(0)))
    await asyncio.to_thread(gate.started.wait, 10)
    queued = [asyncio.create_task(actor.generate(request(i))) for i in range(1, 7)]
    greedy = SamplingParams(1, temperature=0.0)
    evals = [
        asyncio.create_task(actor.generate(GenerationRequest(f"eval0-{p.prompt_id}-a0", p, greedy, eval=True)))
        for p in EVAL_PROMPTS[:2]
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    assert await actor.in_flight() == 9
    gate.release.set()
    await asyncio.gather(first, *queued, *evals)
    # an eval request (1 row) weighs 1/4 of a rollout group (4 rows): 2 of them + 3 groups fit in 4
    assert gate.batches[1] == ["eval0-h00000-a0", "eval0-h00001-a0", "grp1", "grp2", "grp3"]
    assert storage.statistics().rows_put == 7 * 4  # the eval requests stored nothing
    await actor.close()


# -- config ----------------------------------------------------------------------------------------
def test_bad_eval_config_is_one_clear_error_before_start_up():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.enabled=true", "eval.dataset=no_such_set", "eval.num_prompts=0", "eval.every_steps=0"])
    text = " ".join(str(info.value).split())
    assert "3 problems" in text
    assert "eval.every_steps: must be >= 1, got 0" in text
    assert "eval.num_prompts: must be >= 1, got 0" in text
    assert "unknown eval dataset 'no_such_set'" in text and "reverse_digits.held_out" in text
    with pytest.raises(ConfigError, match="must be >= 1, got -3"):
        load_config(None, ["eval.every_steps=-3"])


def test_an_eval_dataset_that_repeats_prompt_ids_is_a_config_error_naming_them(monkeypatch):
    twice = [Prompt("h1", (1, 2), "x"), Prompt("h2", (1, 3), "x"), Prompt("h1", (1, 4), "x")]
    monkeypatch.setitem(sys.modules, "_sc_eval_dup", types.SimpleNamespace(twice=lambda n, d, s: twice[:n]))
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.enabled=true", "eval.dataset=_sc_eval_dup:twice"])
    assert "1 duplicated prompt id(s): 'h1' (2 times)" in " ".join(str(info.value).split())


def test_eval_dataset_with_no_prompts_or_no_held_out_split_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "_sc_eval_empty", types.SimpleNamespace(none=lambda n, d, s: []))
    with pytest.raises(ConfigError, match="gave no prompts") as info:
        load_config(None, ["eval.enabled=true", "eval.dataset=_sc_eval_empty:none"])
    assert "1 problem" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.enabled=true", "task.name=single_controller.data.tasks:reverse_digits"])
    assert "has no registered held-out split" in " ".join(str(info.value).split())  # the message wraps
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.num_samples=4"])
    assert "greedy samples of a prompt are all the same" in " ".join(str(info.value).split())
    cfg = load_config(None, ["eval.enabled=true", "eval.num_samples=4", "eval.temperature=0.7"])
    assert cfg.eval == EvalConfig(enabled=True, num_samples=4, temperature=0.7)
    assert Config().eval.enabled is False  # off by default


# -- what it leaves: metrics.jsonl records, Prometheus, curves.png, the console -------------------
async def test_prometheus_exports_the_last_eval_point():
    from single_controller.runtime.metrics import families

    ctl, *_ = await run_eval_sim(eval_cfg(steps=4, every=2))
    samples = {s.name: s for fam in families(ctl.statistics()) for s in fam.samples}
    last = ctl.eval_history[-1]
    assert samples["sc_grpo_eval_accuracy"].value == last["eval/accuracy"]
    assert (
        samples["sc_grpo_eval_pass_at_k"].labels == {"k": "1"}
        and samples["sc_grpo_eval_pass_at_k"].value == last["eval/pass@1"]
    )
    assert samples["sc_grpo_eval_policy_version"].value == 4
    assert samples["sc_grpo_eval_rounds_total"].value == len(ctl.eval_history)
    assert samples["sc_grpo_eval_in_progress"].value == 0
    off, *_ = await run_eval_sim(make_cfg(steps=2), prompts=())
    assert not any(s.name.startswith("sc_grpo_eval") for fam in families(off.statistics()) for s in fam.samples)


async def test_eval_records_in_metrics_file_plot_and_console(tmp_path):
    import io

    from single_controller.runtime.console import ConsoleReporter
    from single_controller.runtime.records import is_eval_record
    from single_controller.runtime.run_dir import RunDirectory

    ctl, *_ = await run_eval_sim(eval_cfg(steps=6, every=3))
    records = sorted([*ctl.history, *ctl.eval_history], key=lambda r: r["time/wall_s"])
    with RunDirectory(Config(run=RunConfig(output_dir=str(tmp_path), plot=True))) as rd:
        for r in records:
            rd.append_metrics(r)
        back = rd.read_metrics()
        png = rd.save_plot()
    assert [r for r in back if is_eval_record(r)] == ctl.eval_history
    assert [r["step"] for r in back if not is_eval_record(r)] == list(range(6))
    assert png.stat().st_size > 10_000
    out = io.StringIO()
    rep = ConsoleReporter(6, progress_bar=False, stream=out)
    line = rep.eval(ctl.eval_history[0])
    assert line.startswith("eval v0 | accuracy ") and "pass@1" in line and "8 prompts" in line
    assert rep._reported == 0  # an eval line is not a step


# -- the status tool, and what a resume measures again ---------------------------------------------


async def test_status_shows_the_last_eval_point():
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from single_controller.runtime.metrics import ControllerCollector, parse_metrics
    from single_controller.runtime.status import render

    ctl, *_ = await run_eval_sim(eval_cfg(steps=4, every=2))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(ctl.statistics))
    text = render(parse_metrics(generate_latest(registry).decode()), "http://x")
    last = ctl.eval_history[-1]
    line = next(ln for ln in text.splitlines() if ln.startswith("eval "))
    assert line.startswith(f"eval      v4 accuracy {100 * last['eval/accuracy']:.1f}%  pass@1 "), line
    assert f"{len(ctl.eval_history)} points" in line


def test_resume_drops_eval_points_that_will_be_measured_again(tmp_path):
    from single_controller.runtime.run_dir import RunDirectory

    cfg = Config(run=RunConfig(output_dir=str(tmp_path)))
    with RunDirectory(cfg) as rd:
        for step in range(12):
            rd.append_metrics({"step": step, "time/wall_s": float(step)})
            if step % 5 == 0:
                rd.append_metrics({"eval/policy_version": step, "eval/accuracy": 0.1, "time/wall_s": step + 0.5})
        path = rd.path
    with RunDirectory.reopen(path, cfg, from_step=5) as rd:
        kept = rd.read_metrics()
    # steps 0..4 and the v0 point stay; the v5 and v10 points come again after the resume
    assert [r.get("step", r.get("eval/policy_version")) for r in kept] == [0, 0, 1, 2, 3, 4]
