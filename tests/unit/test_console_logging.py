"""Logging in this process: without a log directory a worker's output is not redirected, and the console shows
sc-grpo's warnings by default and the components' records with `-v` (backends/common/worker_logs.py,
runtime/logs.py). A worker's output in its file, as a process and as a Ray worker:
tests/integration/test_worker_logs.py."""

from __future__ import annotations

import logging

from single_controller.backends.common.worker_logs import LOG_DIR_ENV, redirect_output
from single_controller.runtime.logs import console_logging


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
