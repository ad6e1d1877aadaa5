"""Acceptance 5: the single-process reference GRPO loop learns reverse_digits from random init."""

import torch

from single_controller.bench.reference_loop import group_advantages, main, run_reference


def test_group_advantages():
    # group [0, 1]: mean .5, population std .5 -> (+-.5) / (.5 + 1e-4); a constant group -> 0
    adv = group_advantages([[0.0, 1.0], [0.3, 0.3]])
    assert torch.allclose(adv, torch.tensor([[-0.5 / 0.5001, 0.5 / 0.5001], [0.0, 0.0]]))


def test_reference_loop_reaches_exact_match_0_9():
    """Seed 0 reaches a 5-step average exact match >= 0.9 in ~130-145 steps (~8-11 s here); the
    bound of 400 steps leaves a wide margin while still failing a loop that does not learn."""
    r = run_reference(seed=0, max_steps=400, max_seconds=80)
    assert r.reached and r.final_exact >= 0.9, r
    assert r.steps < 400


def test_main_reports_a_failed_seed(capsys):
    assert main(["--seeds", "5", "--max-steps", "3"]) == 1  # 3 steps cannot reach 0.9
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bench/reference seed=5 reached=False steps=3")
    assert out[-1].startswith("bench/reference summary: 0/1 reached 0.9")
