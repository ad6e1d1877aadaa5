"""Colocated turns (`backend.colocate`, `backends/common/colocation.py`): a generation worker's
hold excludes every other hold on the node; trainer ranks hold together (they meet in collectives);
and the config refuses, by name, the colocated settings that cannot work."""

from __future__ import annotations

import threading
import time

import pytest

from single_controller.backends.common.colocation import ComputeTurns, threads_per_process, turns_path
from single_controller.config.schema import BackendConfig


def _hold_in_turns(path: str | None) -> list[tuple[str, float, float]]:
    """Two generation workers and two trainer ranks, each in its own thread with its own lock file
    descriptor (as separate processes have), holding 20 times for 2 ms; their (role, start, end)."""
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def work(role: str) -> None:
        turns = ComputeTurns(path, "generate" if role.startswith("gen") else "train")
        start.wait()
        for _ in range(20):
            with turns.hold():
                t0 = time.perf_counter()
                time.sleep(0.002)
                t1 = time.perf_counter()
            with lock:
                spans.append((role, t0, t1))
        turns.close()

    threads = [threading.Thread(target=work, args=(r,)) for r in ("gen0", "gen1", "train0", "train1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return spans


def _overlaps(spans, a: str, b: str) -> int:
    return sum(
        1
        for ra, s0, e0 in spans
        for rb, s1, e1 in spans
        if ra.startswith(a) and rb.startswith(b) and ra != rb and s0 < e1 and s1 < e0
    )


def test_a_generation_turn_excludes_every_other_and_trainer_ranks_share_theirs(tmp_path):
    assert turns_path("run-1").endswith("sc-grpo-turns-run-1")
    spans = _hold_in_turns(str(tmp_path / "turns"))
    assert len(spans) == 80
    assert _overlaps(spans, "gen", "gen") == 0
    assert _overlaps(spans, "gen", "train") == 0
    assert _overlaps(spans, "train", "train") > 0  # shared: the ranks of a node hold together
    # Without the lock (disaggregated) the same work overlaps: the assertions above can fail.
    free = _hold_in_turns(None)
    assert _overlaps(free, "gen", "train") > 0


def test_turns_count_their_waits_and_each_step_reports_its_own(tmp_path):
    path = str(tmp_path / "turns")
    trainer, gen = ComputeTurns(path, "train"), ComputeTurns(path, "generate")
    with gen.hold():  # the trainer's turn waits for the generation worker's to end
        waiting = threading.Thread(target=_enter_and_leave, args=(trainer,))
        waiting.start()
        time.sleep(0.1)
    waiting.join(5)
    first = trainer.take_step_figures()
    assert first["train/turns"] == 1 and first["train/turn_wait_s"] >= 0.05
    assert trainer.take_step_figures() == {"train/turn_wait_s": 0.0, "train/turns": 0.0}


def _enter_and_leave(turns: ComputeTurns) -> None:
    with turns.hold():
        pass


def test_threads_per_process_default_to_one_or_every_core_when_colocated():
    import os

    assert threads_per_process(BackendConfig()) == 1
    assert threads_per_process(BackendConfig(colocate=True)) == (os.cpu_count() or 1)
    assert threads_per_process(BackendConfig(colocate=True, torch_threads=3)) == 3


GPU = ["backend.colocate=true"]  # configs/vllm_gpu.yaml: vLLM on CUDA, the torch trainer on CUDA


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        ([*GPU, "vllm.device=cpu"], r"training on a GPU, generation on the CPU"),
        (
            [*GPU, "backend.num_trainer_ranks=2", "train.micro_batch_size=2"],
            r"one generation worker and one trainer rank",
        ),
        ([*GPU, "backend.colocate_form=turns"], r"turns on a GPU needs rollout.sleep_level 1"),
        ([*GPU, "train.gpu_memory_fraction=0.5", "vllm.gpu_memory_utilization=0.6"], r"= 1.1 is over 0.95"),
        ([*GPU], r"set train.gpu_memory_fraction .* e.g. train.gpu_memory_fraction=0.45"),
        ([*GPU, "vllm.gpu_memory_utilization=0.99"], r"leaves the trainer none"),
        (["train.offload=optimizer"], r"without backend.colocate=true and backend.colocate_form=turns"),
        (["train.gpu_memory_fraction=0.3"], r"limits the torch or fsdp trainer on CUDA"),
        (["backend.colocate=true", "backend.colocate_form=turns", "pool.enabled=true"], r"turns in a pool"),
    ],
)
def test_colocation_settings_that_cannot_work_are_refused_by_name(overrides, refusal):
    from single_controller.config.problems import ConfigError
    from single_controller.preflight.loader import load_config

    with pytest.raises(ConfigError, match="(?s)" + refusal.replace(" ", r"\s+")):
        load_config(
            "configs/vllm_gpu.yaml" if "backend.colocate=true" == overrides[0] else "configs/embedded.yaml", overrides
        )


def test_both_colocated_forms_validate_on_one_gpu_and_ask_ray_for_their_shares():
    from single_controller.backends.common.colocation import colocated_on_gpu, gpu_shares
    from single_controller.preflight.loader import load_config

    assert load_config("configs/embedded.yaml", ["backend.colocate=true"]).backend.colocate
    assert load_config("configs/embedded.yaml", ["backend.colocate=true", "backend.colocate_form=turns"])
    cfg = load_config(
        "configs/embedded.yaml", ["backend.colocate=true", "backend.colocate_form=turns", "train.offload=all"]
    )
    assert not colocated_on_gpu(cfg) and gpu_shares(cfg) == (1.0, 1.0)
    # on a GPU the rules pass (the model directory is the environment check's, not a rule's)
    shared = [*GPU, "train.gpu_memory_fraction=0.4", "vllm.gpu_memory_utilization=0.5"]
    turns = [*GPU, "backend.colocate_form=turns", "rollout.sleep_level=1", "train.offload=optimizer"]
    assert colocated_on_gpu(load_config("configs/vllm_gpu.yaml", shared))
    assert gpu_shares(load_config("configs/vllm_gpu.yaml", shared)) == (0.5, 0.5)
    cfg = load_config("configs/vllm_gpu.yaml", [*turns, "vllm.gpu_memory_utilization=0.8"])
    assert colocated_on_gpu(cfg) and gpu_shares(cfg) == (0.8, 0.2)
    assert gpu_shares(load_config("configs/vllm_gpu.yaml")) == (1.0, 1.0)  # disaggregated: a GPU each
