"""ray_session: starts and stops a local Ray leaving no process behind; interrupts end a run in time.

The interrupt policy is tested twice: without Ray (fast, exact), and end to end in a subprocess that
holds a real Ray session and gets Ctrl-C the way a terminal sends it (to the whole process group).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from single_controller.config.schema import RayConfig
from single_controller.runtime.ray_session import ray_session, worker_env

ROOT = Path(__file__).resolve().parents[2]


def gone(procs: list[psutil.Process], timeout: float = 0.0) -> list[psutil.Process]:
    """The processes of `procs` still alive (zombies count as gone) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


def workers_of(raylet_pids: set[int]) -> list[psutil.Process]:
    """Processes anywhere on the machine that a raylet of ours started (RAY_RAYLET_PID)."""
    out = []
    for p in psutil.process_iter():
        try:
            if int(p.environ().get("RAY_RAYLET_PID", "-1")) in raylet_pids and p.status() != "zombie":
                out.append(p)
        except (psutil.Error, ValueError):
            pass
    return out


POLICY_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from single_controller.runtime.ray_session import RaySession, _Interrupts, _Tracker
    mode, grace = sys.argv[1], float(sys.argv[2])
    policy = _Interrupts(grace, None)
    policy.install(2, 15)  # SIGINT, SIGTERM
    session = RaySession(None, None, False, None, policy, _Tracker(owned=False))

    async def main():
        try:
            print("READY", flush=True)
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            print("CANCELLED", flush=True)
            raise

    async def stubborn():
        print("READY", flush=True)
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                print("IGNORING", flush=True)

    try:
        if mode == "sync":
            print("READY", flush=True)
            while True:
                time.sleep(0.05)
        session.run(main() if mode == "async" else stubborn())
    except KeyboardInterrupt:
        print("KEYBOARDINTERRUPT", flush=True)
        sys.exit(130)
    """
)


def start_script(script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a job in a terminal
    )
    line = proc.stdout.readline()
    assert line.strip() == "READY", line + proc.stdout.read()
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running {timeout}s after the interrupt:\n{out}")
    return proc.returncode, out, time.monotonic() - t0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_first_interrupt_cancels_the_main_task(signum):
    proc = start_script(POLICY_SCRIPT, "async", "20")
    proc.send_signal(signum)
    rc, out, elapsed = finish(proc, 10)
    assert rc == 130 and "CANCELLED" in out and "KEYBOARDINTERRUPT" in out, out
    assert "stopping the run cleanly" in out
    assert elapsed < 5


def test_first_interrupt_raises_keyboardinterrupt_in_synchronous_code():
    proc = start_script(POLICY_SCRIPT, "sync", "20")
    proc.send_signal(signal.SIGINT)
    rc, out, _ = finish(proc, 10)
    assert rc == 130 and "KEYBOARDINTERRUPT" in out, out


def test_second_interrupt_forces_exit():
    proc = start_script(POLICY_SCRIPT, "stubborn", "60")
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().startswith("sc-grpo: SIGINT: stopping")
    assert proc.stdout.readline().strip() == "IGNORING"  # the run does not stop by itself
    proc.send_signal(signal.SIGINT)
    rc, out, elapsed = finish(proc, 10)
    assert rc == 130 and "forced exit: second interrupt" in out, out
    assert elapsed < 5


def test_a_run_that_ignores_the_interrupt_is_forced_after_the_grace_period():
    proc = start_script(POLICY_SCRIPT, "stubborn", "1.5")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, out, _ = finish(proc, 15)
    elapsed = time.monotonic() - t0
    assert rc == 130 and "forced exit: still running 1.5s after SIGTERM" in out, out
    assert 1.4 < elapsed < 8


# ---------------------------------------------------------------- with a real Ray


@pytest.fixture(autouse=True)
def _no_foreign_ray(request):
    if request.node.get_closest_marker("ray") and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            pytest.skip("another test left Ray initialized in this process; ray_session would borrow it")
    yield


@pytest.mark.ray
def test_start_and_stop_leaves_no_ray_process():
    import ray

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with ray_session(RayConfig(), min_cpus=2, log_to_driver=False, env_vars=worker_env(1)) as session:
        assert ray.is_initialized() and session.owned
        assert ray.cluster_resources()["CPU"] == max(2, os.cpu_count())

        @ray.remote(num_cpus=0)
        class Probe:
            def env(self):
                return os.environ["OMP_NUM_THREADS"], os.getpid()

        probe = Probe.remote()
        omp, worker_pid = ray.get(probe.env.remote())
        assert omp == "1"
        procs = session.processes()
        names = {p.name() for p in procs}
        assert {"raylet", "gcs_server"} <= names, names
        assert worker_pid in {p.pid for p in procs}  # actors are found as part of the session
        assert os.environ["RAY_AUTH_MODE"] and os.environ["TQ_NUM_THREADS"]
        system = ray._private.worker._global_node._ray_params._system_config
        assert system["enable_metrics_collection"] is False and system["task_events_report_interval_ms"] == 0
        with ray_session(RayConfig(), min_cpus=1) as inner:  # nested: borrows, never shuts down
            assert not inner.owned and inner.processes() == []
        assert ray.is_initialized() and ray.get(probe.env.remote())[1] == worker_pid
    assert not ray.is_initialized()
    assert describe(gone(procs)) == []  # the context waits: nothing is left when it returns
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@pytest.mark.parametrize("observability", [False, True])
def test_a_local_ray_records_its_own_task_events_and_metrics_only_when_asked(monkeypatch, observability):
    import ray

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(Stop):
        with ray_session(RayConfig(ray_observability=observability), min_cpus=1, log_to_driver=False):
            pass
    system = seen["_system_config"]
    assert system["enable_worker_prestart"] is False
    if observability:
        assert not {"enable_metrics_collection", "task_events_report_interval_ms", "event_stats"} & set(system)
    else:
        assert system["enable_metrics_collection"] is False and system["task_events_report_interval_ms"] == 0
        assert system["event_stats"] is False


STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
)


@pytest.mark.ray
def test_an_exception_inside_still_cleans_up_and_kills_stragglers(tmp_path, monkeypatch, caplog):
    import ray

    from single_controller.runtime import ray_session as ray_runtime

    monkeypatch.setattr(ray_runtime, "_WAIT_EXIT_S", 1.0)
    monkeypatch.setattr(ray_runtime, "_TERM_S", 1.0)
    caplog.set_level(logging.INFO, logger=ray_runtime.__name__)
    # a Ray-looking straggler that outlives ray.shutdown() and ignores SIGTERM, and a child of the
    # driver that has nothing to do with Ray (not the session's to kill)
    fake = tmp_path / "ray" / "fake_worker.py"
    fake.parent.mkdir()
    fake.write_text(STUBBORN)
    unrelated = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with ray_session(RayConfig(num_cpus=3), min_cpus=1, log_to_driver=False) as session:
                assert ray.cluster_resources()["CPU"] == 3  # cfg.num_cpus wins over min_cpus
                ray.get(ray.remote(lambda: 1).remote())
                straggler = subprocess.Popen([sys.executable, str(fake)], stdout=subprocess.PIPE, text=True)
                assert straggler.stdout.readline() == "up\n"
                procs = session.processes()
                assert straggler.pid in {p.pid for p in procs}
                assert unrelated.pid not in {p.pid for p in procs}
                raylets = {p.pid for p in procs if p.name() == "raylet"}
                raise RuntimeError("boom")
        assert not ray.is_initialized()
        assert straggler.pid in {p.pid for p in procs}
        assert describe(gone(procs)) == []  # the straggler too, though it ignored SIGTERM
        assert describe(workers_of(raylets)) == []
        assert unrelated.poll() is None
        # an INFO record of the ray_session logger (shown by sc-grpo run -v)
        assert "outlived ray.shutdown(); terminating: python" in caplog.text
    finally:
        unrelated.kill()
        unrelated.wait()


RAY_SCRIPT = textwrap.dedent(
    """
    import asyncio, os
    from single_controller.config.schema import RayConfig
    from single_controller.runtime.ray_session import ray_session

    async def main(actor):
        try:
            await actor.ping.remote()
            print("READY", flush=True)
            while True:
                await actor.ping.remote()  # a live run: remote calls in flight
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            print("CANCELLED", flush=True)
            raise

    try:
        with ray_session(RayConfig(), min_cpus=2, log_to_driver=False) as session:
            import ray

            @ray.remote(num_cpus=0)
            class Worker:
                def ping(self):
                    return os.getpid()

            session.run(main(Worker.remote()))
    except KeyboardInterrupt:
        print("EXITED", flush=True)
        raise SystemExit(130)
    """
)


@pytest.mark.ray
def test_ctrl_c_ends_a_ray_run_within_30s_leaving_no_ray_process():
    proc = start_script(RAY_SCRIPT)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert any(p.name().startswith("ray::") for p in tree), describe(tree)
    raylets = {p.pid for p in tree if p.name() == "raylet"}
    assert raylets
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group gets it
    rc, out, elapsed = finish(proc, 30)
    assert rc == 130, out
    assert "CANCELLED" in out and "EXITED" in out, out
    assert elapsed < 30
    assert describe(gone(tree)) == [], out
    assert describe(workers_of(raylets)) == []


def test_a_ray_address_where_nothing_listens_is_refused_at_once_before_a_run_directory_exists(tmp_path, capsys):
    import socket

    from single_controller.runtime import cli
    from single_controller.runtime.ray_session import RayUnreachable, check_ray_address

    with socket.socket() as s:  # a port that was free a moment ago, and one that listens
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_ray_address(f"127.0.0.1:{listening.getsockname()[1]}")  # something answers: fine
    for other in (None, "auto", "ray://10.0.0.1:10001", "local"):
        check_ray_address(other)  # left to ray.init
    with pytest.raises(RayUnreachable, match=f"nothing answers at the Ray address 127.0.0.1:{closed}"):
        check_ray_address(f"127.0.0.1:{closed}")
    config = str(Path(__file__).resolve().parents[2] / "configs/embedded.yaml")
    assert cli.main(["run", config, f"ray.address=127.0.0.1:{closed}", f"run.output_dir={tmp_path / 'runs'}"]) == 2
    assert "nothing answers at the Ray address" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
