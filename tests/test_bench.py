"""`sc-grpo bench scale` runs end to end on a tiny sweep and prints every figure it promises
(its speed targets are read off the real sweep, never asserted here)."""

import re

from single_controller.bench import main_scale


def test_bench_scale_prints_every_point_the_latency_samples_the_fit_and_the_memory_run(capsys):
    assert main_scale(["--groups", "2,4", "--workers", "1,2", "--workers-at", "2", "--groups-at", "4",
                       "--group-size", "2", "--steps", "4", "--t", "0.02", "--long-steps", "20", "--long-groups", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d", line)]
    points = [(int(r[0]), int(r[1])) for r in rows if len(r) == 11]
    assert points == [(2, 2), (4, 2), (4, 1)]
    for r in rows[:3]:
        assert int(r[9]) >= 1  # the latency run's samples: the train pump waited for its chunks
    assert re.search(r"CPU per step ~ [\d.]+ ms \+ -?[\d.]+ us x groups per step \(least squares over the 2 points at 2 workers\)", out)
    assert re.search(r"worst: overlap [\d.]+ .*select p99 [\d.]+ ms", out)
    assert "long run: 20 steps of 1 groups" in out
