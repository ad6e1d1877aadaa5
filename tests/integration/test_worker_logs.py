"""Logging: a worker's output goes to its file in the run directory, the console carries sc-grpo's
lines, and `-v` shows the components' log records (backends/common/worker_logs.py, runtime/logs.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from single_controller.backends.common.worker_logs import LOG_DIR_ENV, redirect_output
from single_controller.runtime.logs import console_logging

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


def test_without_a_log_dir_nothing_is_redirected(monkeypatch, capfd):
    monkeypatch.delenv(LOG_DIR_ENV, raising=False)
    assert redirect_output("gen0") is None
    print("still on the console")
    assert capfd.readouterr().out == "still on the console\n"


def test_the_console_shows_warnings_by_default_and_info_with_verbose(capsys):
    log = logging.getLogger("single_controller.runtime.probe")
    with console_logging(0):
        log.info("an info record")
        log.warning("a warning")
    assert capsys.readouterr().err == "sc-grpo: a warning\n"
    with console_logging(1):
        log.info("an info record")
        log.debug("a debug record")
    err = capsys.readouterr().err
    assert "INFO single_controller.runtime.probe: an info record" in err and "debug" not in err
    with console_logging(2):
        log.debug("a debug record")
    assert "DEBUG single_controller.runtime.probe: a debug record" in capsys.readouterr().err
    logging.getLogger("some_library").warning("not ours")  # libraries' records are not sc-grpo's console
    log.warning("after the command")  # the console handler is gone once the command returns
    assert "not ours" not in capsys.readouterr().err
    assert all(not h.__class__.__name__.startswith("_Stderr") for h in logging.getLogger("single_controller").handlers)


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
            from single_controller.backends.common.worker_logs import redirect_output

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
