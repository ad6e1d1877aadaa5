"""Logging: a worker's output goes to its file in the run directory, as a process of its own and as a Ray worker
(backends/common/worker_logs.py; the console's levels, in this process: tests/unit/test_console_logging.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from single_controller.backends.common.worker_logs import LOG_DIR_ENV, redirect_output

REPO = Path(__file__).resolve().parents[2]

# A worker process: it redirects its output, then writes the ways workers do (print, a C-level
# write to fd 2, a warning, a child process, a log record); the parent sees none of it.
WORKER = textwrap.dedent(
    """
    import logging, os, subprocess, sys, warnings
    from single_controller.backends.common.worker_logs import redirect_output
    print("before the redirect", flush=True)
    path = redirect_output("gen0")
    print("a print of the worker")
    os.write(2, b"a C extension's write to fd 2\\n")
    warnings.warn("a FutureWarning of a library", FutureWarning)
    subprocess.run([sys.executable, "-c", "print('a child process of the worker')"], check=True)
    logging.getLogger("single_controller.backends.probe").info("an INFO record of a component")
    """
)


def test_a_workers_output_goes_to_its_file_in_the_log_dir_and_not_to_the_console(tmp_path):
    logs = tmp_path / "run" / "logs"
    env = {**os.environ, LOG_DIR_ENV: str(logs), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "before the redirect\n" and out.stderr == ""  # nothing after the redirect
    text = (logs / "gen0.log").read_text()
    assert text.startswith("==== gen0 (pid ")
    for line in (
        "a print of the worker",
        "a C extension's write to fd 2",
        "FutureWarning: a FutureWarning of a library",
        "a child process of the worker",
        "INFO single_controller.backends.probe: an INFO record of a component",
    ):
        assert line in text, text


@pytest.mark.ray
def test_a_ray_workers_print_lands_in_its_log_file_and_not_on_the_drivers_console(tmp_path, capfd):
    """A run's Ray session: log_to_driver=False and the log directory in every worker's environment."""
    import ray

    from single_controller.config.schema import RayConfig
    from single_controller.runtime.ray_session import ray_session

    if ray.is_initialized():
        pytest.skip("another test left Ray initialized in this process; ray_session would borrow it")

    class Worker:
        def __init__(self, name: str):

            redirect_output(name)  # first thing, as every worker actor's constructor does
            print(f"{name}: hello from the worker", flush=True)

        def shout(self) -> int:
            print("a print inside a method", flush=True)
            return os.getpid()

    logs = tmp_path / "logs"
    with ray_session(RayConfig(), min_cpus=1, log_to_driver=False, env_vars={LOG_DIR_ENV: str(logs)}):
        actor = ray.remote(num_cpus=0)(Worker).remote("gen7")
        pid = ray.get(actor.shout.remote())
    text = (logs / "gen7.log").read_text()
    assert f"==== gen7 (pid {pid}) started" in text
    assert "gen7: hello from the worker" in text and "a print inside a method" in text
    console = capfd.readouterr()
    assert "hello from the worker" not in console.out + console.err
    assert "a print inside a method" not in console.out + console.err
