"""The environment a Ray session gives its processes (runtime/ray_session.py), without Ray: every thread pool's size
in a worker's environment, and the defaults set before Ray starts without overriding the user's. Ray sessions
themselves and interrupts: tests/integration/test_ray_runtime.py."""

from __future__ import annotations

import os

from single_controller.runtime.ray_session import prepare_environment, worker_env


def test_worker_env_sets_every_thread_pool():
    env = worker_env(3)
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "3"
    assert all(isinstance(v, str) for v in env.values())


def test_prepare_environment_sets_defaults_without_overriding(monkeypatch):
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.delenv("TQ_NUM_THREADS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    prepare_environment()
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["TQ_NUM_THREADS"] == str(os.cpu_count())
    assert os.environ["RAY_AUTH_MODE"] == "token"  # the user's choice stands
