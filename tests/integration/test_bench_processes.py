"""The benchmarks' parts that start processes: `sc-grpo bench sync` over a local Ray (both weight-sync transports),
and `--keep-cpu-awake`'s idle-class busy loop beside the bench."""

import json
import os
import re

import psutil
import pytest

from single_controller.bench import runner as bench
from single_controller.bench.runner import main_scale


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling classes")
def test_keep_cpu_awake_pins_the_bench_beside_an_idle_class_busy_loop_and_undoes_it(capsys):
    cpus = os.sched_getaffinity(0)
    with bench.cpu_kept_awake() as cpu:
        assert os.sched_getaffinity(0) == {cpu}
        children = [p.pid for p in psutil.Process().children()]
        spinners = [p for p in children if os.sched_getscheduler(p) == os.SCHED_IDLE]
        assert len(spinners) == 1, children  # the busy loop: idle class, so it never delays the benchmark
        spinner = spinners[0]
        assert os.sched_getaffinity(spinner) == {cpu}  # on the benchmark's CPU, before anything is measured
    assert os.sched_getaffinity(0) == cpus
    assert not psutil.pid_exists(spinner)  # stopped with the benchmark
    assert (
        main_scale(
            [
                "--groups",
                "2",
                "--workers",
                "1",
                "--workers-at",
                "1",
                "--groups-at",
                "2",
                "--group-size",
                "2",
                "--steps",
                "3",
                "--t",
                "0.02",
                "--long-steps",
                "0",
                "--keep-cpu-awake",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"CPU \d+ kept awake by an idle-class busy loop", out) and re.search(r"^\s+2\s+1\s+\d", out, re.M)
    assert os.sched_getaffinity(0) == cpus


@pytest.mark.ray
def test_bench_sync_moves_a_model_by_each_transport_checks_it_and_prints_each_point(capsys, tmp_path):
    """`sc-grpo bench sync` on a small model: both transports to 1 and 2 workers (every sync checked
    bit for bit inside the bench, and a fallback to the object store would fail it), a row per point
    with the raw broadcast and memcpy beside it."""

    from single_controller.bench.sync import main as main_sync

    out = tmp_path / "sync.json"
    assert main_sync(["--params", "2M", "--workers", "1", "2", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["workers"], r["transport"]) for r in rows] == [
        (1, "object_store"),
        (1, "collective"),
        (2, "object_store"),
        (2, "collective"),
    ]
    for r in rows:
        assert r["bytes"] == 2 * r["params"] and r["params"] >= 2_000_000 * 0.9
        assert 0 < r["publish_s"] and 0 < r["deliver_s"] and 0 < r["raw_bcast_s"] and 0 < r["memcpy_s"]
    text = capsys.readouterr().out
    assert "weight sync over gloo, bfloat16" in text and text.count("collective") == 2
