"""The learning-rate schedules (`algorithm.schedules.lr_at`): warmup, linear and cosine decay to the
floor, against values derived by hand; the config rule for the decay horizon; and the resume rule
that pins the horizon (`run.max_steps`) under a decaying schedule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from single_controller.algorithm.schedules import LrSchedule, lr_at
from single_controller.checkpoint import config_fingerprint, incompatible_keys
from single_controller.preflight.loader import ConfigError, load_config


def test_a_constant_schedule_without_warmup_is_the_lr_at_every_step():
    s = LrSchedule(lr=3e-4)
    assert [lr_at(k, s) for k in (0, 1, 7, 10_000)] == [3e-4] * 4


def test_warmup_rises_linearly_from_near_zero_to_the_lr():
    # W = 4: step s < 4 gets lr * (s + 1) / 4 = 0.25, 0.5, 0.75, 1.0 (x lr = 2); then the constant lr.
    s = LrSchedule(lr=2.0, warmup_steps=4)
    assert [lr_at(k, s) for k in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]


def test_linear_decay_runs_from_the_lr_after_warmup_to_the_floor_at_the_last_step():
    # W = 2, T = 7, m = 0.1: p = (s - 2) / (7 - 1 - 2) = (s - 2) / 4; lr(s) = 1 - 0.9 p for s >= 2.
    s = LrSchedule(lr=1.0, kind="linear", warmup_steps=2, min_lr_ratio=0.1, total_steps=7)
    want = [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]
    assert [lr_at(k, s) for k in range(7)] == pytest.approx(want, abs=1e-15)
    assert lr_at(50, s) == pytest.approx(0.1, abs=1e-15)  # past the horizon: the floor


def test_cosine_decay_follows_half_a_cosine_down_to_the_floor():
    # W = 2, T = 7, m = 0.1: lr(s) = 0.1 + 0.45 (1 + cos(pi p)), p = (s - 2) / 4:
    #   p = 0 -> 1.0; p = 1/4 -> 0.1 + 0.45 (1 + sqrt(2)/2) = 0.868198; p = 1/2 -> 0.55;
    #   p = 3/4 -> 0.1 + 0.45 (1 - sqrt(2)/2) = 0.231802; p = 1 -> 0.1.
    s = LrSchedule(lr=1.0, kind="cosine", warmup_steps=2, min_lr_ratio=0.1, total_steps=7)
    r = math.sqrt(2) / 2
    want = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + r), 0.55, 0.1 + 0.45 * (1 - r), 0.1]
    assert [lr_at(k, s) for k in range(7)] == pytest.approx(want, abs=1e-15)


def test_a_zero_floor_ends_at_zero_and_a_full_floor_never_decays():
    for kind in ("linear", "cosine"):
        assert lr_at(9, LrSchedule(lr=1.0, kind=kind, total_steps=10)) == pytest.approx(0.0, abs=1e-15)
        assert {lr_at(k, LrSchedule(lr=1.0, kind=kind, min_lr_ratio=1.0, total_steps=10)) for k in range(10)} == {1.0}


@given(
    kind=st.sampled_from(["linear", "cosine"]),
    warmup=st.integers(0, 20),
    extra=st.integers(2, 200),
    floor=st.floats(0.0, 1.0),
)
def test_a_decaying_schedule_never_rises_after_warmup_and_stays_within_floor_and_lr(kind, warmup, extra, floor):
    s = LrSchedule(lr=1e-3, kind=kind, warmup_steps=warmup, min_lr_ratio=floor, total_steps=warmup + extra)
    lrs = [lr_at(k, s) for k in range(warmup, warmup + extra)]
    assert all(a >= b - 1e-18 for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(floor * 1e-3, abs=1e-15)


def test_a_decaying_schedule_without_a_horizon_or_with_no_step_to_decay_is_refused():
    with pytest.raises(ValueError, match="cosine lr schedule decays over the run's max_steps.*got None"):
        LrSchedule(lr=1.0, kind="cosine")
    with pytest.raises(ValueError, match="needs max_steps >= warmup_steps \\+ 2, got 5"):
        LrSchedule(lr=1.0, kind="linear", warmup_steps=4, total_steps=5)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(-1, LrSchedule(lr=1.0))


def test_the_config_refuses_a_decaying_schedule_with_no_steps_after_warmup():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lr_schedule=cosine", "train.warmup_steps=10", "run.max_steps=11"])
    text = " ".join(str(info.value).split())
    assert "train.lr_schedule=cosine decays the lr" in text and "its horizon is run.max_steps" in text
    assert "at least train.warmup_steps + 2 = 12 (got 11)" in text
    load_config(None, ["train.lr_schedule=cosine", "train.warmup_steps=10", "run.max_steps=12"])  # fits
    load_config(None, ["train.warmup_steps=10", "run.max_steps=3"])  # constant: no horizon needed


def test_a_resume_keeps_the_horizon_of_a_decaying_schedule_but_may_change_the_microbatch_passes():
    cosine = load_config(None, ["train.lr_schedule=cosine", "run.max_steps=50"])
    saved = config_fingerprint(cosine)
    longer = load_config(None, ["train.lr_schedule=cosine", "run.max_steps=80"])
    assert [k for k, _, _ in incompatible_keys(saved, longer)] == ["run.max_steps"]
    passes = ["train.micro_batch_tokens=512", "train.gradient_checkpointing=true"]
    cut = load_config(None, ["train.lr_schedule=cosine", "run.max_steps=50", *passes])
    assert incompatible_keys(saved, cut) == []
    constant = config_fingerprint(load_config(None, ["run.max_steps=50"]))
    assert incompatible_keys(constant, load_config(None, ["run.max_steps=80"])) == []  # no horizon to keep


def test_a_resume_may_change_the_trainer_ranks_but_not_megatrons():
    """The torch trainer's state is whole on every rank and the fsdp trainer's checkpoint reshards,
    so their resume may run on another number of ranks; Megatron's per-rank shards are its layout's."""
    for trainer in ("torch", "fsdp"):
        saved = config_fingerprint(load_config(None, [f"backend.trainer={trainer}", "backend.num_trainer_ranks=2"]))
        fewer = load_config(None, [f"backend.trainer={trainer}", "backend.num_trainer_ranks=1"])
        assert incompatible_keys(saved, fewer) == []
    mg = ["backend.trainer=megatron", "megatron.cpu_emulation=true"]
    saved = config_fingerprint(load_config(None, [*mg, "backend.num_trainer_ranks=2", "megatron.data_parallel_size=2"]))
    fewer = load_config(None, [*mg, "backend.num_trainer_ranks=1"])
    assert "backend.num_trainer_ranks" in [k for k, _, _ in incompatible_keys(saved, fewer)]
