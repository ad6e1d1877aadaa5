"""Layer (d), cluster mode: a real two-node Ray cluster on this machine, started with `ray start`.

One module-scoped cluster: a head (`node_a`) and a second node (`node_b`), each its own raylet with
its own resources, on ports and a temp dir of their own (other Ray sessions on the machine are never
touched; teardown kills only the processes this test started). Then, against it:

* `sc-grpo storage serve` starts a TransferQueue that outlives every run; a foreign writer puts
  sentinel keys in the partitions `rollout` (the bare prefix a run's partition starts with) and
  `other`.
* Two `sc-grpo run`s at once, both `storage.attach=true`, both asking for the same metrics port:
  A trains with 2 ranks and `backend.trainer_placement=spread`, B with 1 rank. Asserted: both
  finish; A's ranks ran on the two different nodes (recorded in summary.json) and met at rank 0's
  node address; the runs' Ray namespaces, TQ partitions, run ids and metrics URLs differ; each
  printed metrics URL answered a scrape while its run was going; after both, the TQ still holds
  the sentinels untouched and nothing of either run (their partitions were dropped when empty).
* A spread run asking for more ranks than the cluster has nodes is refused with an error naming
  the nodes.

Ray's processes are found for teardown by process group (`ray start --block` in a new session) and
by `RAY_RAYLET_PID` (workers of our raylets), never by name.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from tests.helpers.free_ports import free_port  # (distinct ports: Ray refuses one port for two components)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray]

START_S = 150  # one `ray start` on a loaded 2-core machine took 40 s


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    # multi-node (=1, Linux's default), every node on the loopback (--node-ip-address)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TQ_NUM_THREADS="1"
    )
    # a loaded 2-core machine starts a node's agents slower than Ray's defaults wait for
    env.update(RAY_agent_register_timeout_ms="120000", RAY_raylet_start_wait_time_s="120")
    return env


class Lines:
    """A subprocess whose combined output is read line by line on a thread (kept in `lines`)."""

    def __init__(self, cmd: list[str], *, cwd: Path, env: dict[str, str]):
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(self.lines[-1])
        self._q.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.cmd[:4]}: no {text!r} within {timeout}s:\n" + self.tail()) from None
            if line is None:
                raise AssertionError(f"{self.cmd[:4]} exited ({self.proc.wait()}) before {text!r}:\n" + self.tail())
            if text in line:
                return line

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def kill_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class Cluster:
    """Head + second node, each `ray start --block` in its own process group."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.temp_dir = f"/tmp/scg-{uuid.uuid4().hex[:8]}"  # Ray's socket paths must stay short
        self.env = _env()
        self.nodes: list[Lines] = []
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"

    def _ports(self) -> list[str]:
        return [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            "--min-worker-port=0",
            "--max-worker-port=0",  # workers bind any free port
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]

    def start(self) -> None:
        ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
        head = ray + [
            "--head",
            f"--port={self.gcs_port}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=3",
            '--resources={"node_a": 1}',
            *self._ports(),
        ]
        self.nodes.append(Lines(head, cwd=self.tmp, env=self.env))
        self.nodes[0].wait_for("Ray runtime started", START_S)
        second = ray + [
            f"--address={self.address}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=3",
            '--resources={"node_b": 1}',
            *self._ports(),
        ]
        self.nodes.append(Lines(second, cwd=self.tmp, env=self.env))
        self.nodes[1].wait_for("Ray runtime started", START_S)

    def _ours(self) -> list[psutil.Process]:
        """Every live process of this cluster: the `ray start` process groups and our raylets' workers."""
        groups = {n.proc.pid for n in self.nodes}
        procs: dict[int, psutil.Process] = {}
        raylets: set[int] = set()
        for p in psutil.process_iter(["pid", "name"]):
            try:
                if os.getpgid(p.pid) in groups:
                    procs[p.pid] = p
                    if p.info["name"] == "raylet":
                        raylets.add(p.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        for p in psutil.process_iter(["pid"]):
            try:
                if int(p.environ().get("RAY_RAYLET_PID", -1)) in raylets:
                    procs[p.pid] = p
            except (psutil.Error, ValueError, OSError):
                continue
        return [p for p in procs.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def stop(self) -> None:
        procs = self._ours()
        for node in reversed(self.nodes):
            node.kill_group(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        for node in self.nodes:
            node.kill_group(signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)


def _python(code: str, env: dict[str, str], timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _storage_list(address: str, env: dict[str, str]) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-m", "single_controller", "storage", "list", f"--address={address}", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PUT_SENTINELS = """
import sys, ray, torch
from single_controller.runtime.ray_session import prepare_environment
prepare_environment(local=False)
ray.init(address=sys.argv[1] if len(sys.argv) > 1 else {address!r}, namespace="foreign-writer", log_to_driver=False)
from replay.transferqueue.runtime import attach_tq
attach_tq(60)
import transfer_queue as tq
for partition in ("rollout", "other"):
    tq.kv_put(key="sentinel", partition_id=partition, fields={{"x": torch.tensor([7])}}, tag={{"owner": "foreign"}})
print("ok")
"""


def _run_cmd(tmp: Path, name: str, address: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "single_controller",
        "run",
        str(ROOT / "configs/embedded.yaml"),
        f"ray.address={address}",
        "storage.attach=true",
        f"run.output_dir={tmp}",
        f"run.name={name}",
        "run.progress_bar=false",
        "run.plot=false",
        "run.stop_at_success_rate=null",
        "checkpoint.every_steps=0",
        "metrics.port=19464",
        "timeouts.setup_s=300",
        *overrides,
    ]


def _fetch(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return {"url": url, "status": resp.status, "body": resp.read().decode()}
    except Exception as e:  # reported by the test's assertion
        return {"url": url, "error": f"{type(e).__name__}: {e}"}


def _metrics_urls_while_both_serve(runs: list[Lines], timeout: float) -> list[dict]:
    """Scrape both runs' printed metrics URLs while both serve. Whichever run prints its URL first
    has its driver held (SIGSTOP: its controller actor, and the metrics server in it, run on, but
    the run cannot end) until the other has printed its own; then both URLs are fetched."""
    urls: list[str | None] = [None, None]
    printed = [threading.Event(), threading.Event()]

    def watch(i: int) -> None:
        try:
            urls[i] = runs[i].wait_for("metrics on ", timeout).split("metrics on ", 1)[1].strip()
        finally:
            printed[i].set()

    for i in range(2):
        threading.Thread(target=watch, args=(i,), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not any(e.is_set() for e in printed) and time.monotonic() < deadline:
        time.sleep(0.02)  # test code: waiting for a subprocess's output line
    first = 0 if printed[0].is_set() else 1
    os.kill(runs[first].proc.pid, signal.SIGSTOP)
    try:
        printed[1 - first].wait(max(0.0, deadline - time.monotonic()))
        assert None not in urls, f"a run printed no metrics URL: {urls}\n" + "\n".join(r.tail(20) for r in runs)
        return [_fetch(url) for url in urls]
    finally:
        os.kill(runs[first].proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def tq_server(cluster, tmp_path_factory):
    """`sc-grpo storage serve` on the cluster, with foreign sentinel keys put before any run."""
    server = Lines(
        [sys.executable, "-m", "single_controller", "storage", "serve", f"--address={cluster.address}"],
        cwd=tmp_path_factory.mktemp("tq"),
        env=cluster.env,
    )
    try:
        server.wait_for("sc-grpo storage: ready", START_S)
        assert _python(PUT_SENTINELS.format(address=cluster.address), cluster.env).strip().endswith("ok")
        yield server
    finally:
        server.kill_group(signal.SIGTERM)  # closes TQ (it created it), then disconnects
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill_group(signal.SIGKILL)


def test_two_runs_share_a_two_node_cluster_and_a_tq_that_outlives_them(cluster, tq_server, tmp_path):
    t0 = time.monotonic()
    env = cluster.env
    steps = 6
    common = (
        f"run.max_steps={steps}",
        "train.groups_per_step=4",
        "train.min_groups_per_chunk=2",
        "rollout.group_size=8",
    )
    runs = [
        Lines(
            _run_cmd(
                tmp_path,
                "a",
                cluster.address,
                *common,
                "backend.num_trainer_ranks=2",
                "backend.trainer_placement=spread",
            ),
            cwd=tmp_path,
            env=env,
        ),
        Lines(_run_cmd(tmp_path, "b", cluster.address, *common), cwd=tmp_path, env=env),
    ]
    try:
        scrapes = _metrics_urls_while_both_serve(runs, 240)
        codes = [r.proc.wait(timeout=300) for r in runs]
    finally:
        for r in runs:
            if r.proc.poll() is None:
                r.kill_group(signal.SIGKILL)
    for r, code, name in zip(runs, codes, ("a", "b")):
        errors = [p.read_text()[-4000:] for p in tmp_path.glob(f"{name}-*/error.log")]
        assert code == 0, r.tail() + "\n".join(errors)

    summaries = [json.loads(next(tmp_path.glob(f"{n}-*/summary.json")).read_text()) for n in ("a", "b")]
    sa, sb = summaries
    for s in summaries:
        assert s["steps"] == steps and "failure" not in s, s
        assert s["storage_keys_left"] == 0  # every key the run wrote, cleared
    # A's two ranks ran on the two nodes (they met at rank 0's node address)
    assert len(sa["placement"]["trainer_nodes"]) == 2
    assert len(set(sa["placement"]["trainer_nodes"])) == 2, sa["placement"]
    assert len(sa["placement"]["trainer_node_ips"]) == 2 and all(sa["placement"]["trainer_node_ips"])
    # nothing shared between the runs: run ids, Ray namespaces, TQ partitions, metrics URLs
    for key in ("run_id", "storage_partition", "metrics_url"):
        assert sa[key] != sb[key], key
    assert sa["placement"]["ray_namespace"] != sb["placement"]["ray_namespace"]
    assert sa["storage_partition"] == f"rollout-{sa['run_id']}"
    # each printed URL is the one that served, both at once; both asked for 19464, so one moved on
    for s, scrape in zip(summaries, scrapes):
        assert "error" not in scrape, scrape
        assert scrape["url"] == s["metrics_url"] and scrape["status"] == 200
        assert "sc_grpo_steps_total" in scrape["body"]

    # the TQ outlived both runs: the foreign keys are there, untouched; no trace of either run
    listing = _storage_list(cluster.address, env)
    assert listing.get("rollout") == ["sentinel"] and listing.get("other") == ["sentinel"], listing
    assert sa["storage_partition"] not in listing and sb["storage_partition"] not in listing, listing
    assert tq_server.proc.poll() is None, tq_server.tail()
    print(f"two concurrent cluster runs: {time.monotonic() - t0:.0f}s, load average {os.getloadavg()}", file=sys.stderr)


def test_spread_refuses_more_ranks_than_nodes(cluster, tq_server, tmp_path):
    run = subprocess.run(
        _run_cmd(
            tmp_path,
            "c",
            cluster.address,
            "run.max_steps=2",
            "backend.num_trainer_ranks=3",
            "backend.trainer_placement=spread",
        ),
        cwd=tmp_path,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "trainer_placement=spread" in run.stderr and "2 alive node(s)" in run.stderr, run.stderr[-3000:]


def test_sigterm_then_resume_on_attached_storage_leaves_no_key_and_loses_no_prompt(cluster, tq_server, tmp_path):
    """Interrupt equivalence on a TransferQueue that outlives the run (`storage.attach`): SIGTERM at
    random moments, `--resume` each time, to the end: every prompt trained once, and the run's
    partition gone at the end (no key left); the foreign keys untouched."""
    import random

    # 48 steps: three drives of at most a few step lines (~0.06 s each) + 0.3 s never reach the end,
    # so every drive is interrupted, not finished (16 steps once let the third drive finish first)
    rng, env, steps = random.Random(1), cluster.env, 48
    overrides = (f"run.max_steps={steps}", "checkpoint.every_steps=1000")
    run_dir = None
    for _ in range(3):
        if run_dir is None:
            cmd = _run_cmd(tmp_path, "i", cluster.address, *overrides)
        else:
            cmd = [sys.executable, "-m", "single_controller", "run", "--resume", str(run_dir), *overrides]
        run = Lines(cmd, cwd=tmp_path, env=env)
        try:
            for _ in range(rng.randint(1, 3)):  # a few step lines into this drive
                run.wait_for("| reward", START_S)
            time.sleep(rng.uniform(0.0, 0.3))
            run.kill_group(signal.SIGINT)  # the driver's session: as Ctrl-C or a SIGTERM to it
            assert run.proc.wait(timeout=60) == 130, run.tail()
        finally:
            run.kill_group(signal.SIGKILL)
        run_dir = run_dir or next(tmp_path.glob("i-*"))
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["storage_keys_left"] == 0, summary.get("storage_keys_left_sample")
    final = subprocess.run(
        [sys.executable, "-m", "single_controller", "run", "--resume", str(run_dir), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["storage_keys_left"] == 0
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
    assert len({p["prompt_id"] for p in ledger}) == len(ledger)
    per_step = collections.Counter(p["step"] for p in ledger if p["fate"] == "trained")
    assert per_step == {k: 16 for k in range(steps)}, per_step
    listing = _storage_list(cluster.address, env)
    assert summary["storage_partition"] not in listing, listing  # dropped when it ended empty
    assert listing.get("rollout") == ["sentinel"] and listing.get("other") == ["sentinel"], listing


def test_two_runs_join_a_pool_served_on_the_cluster(cluster, tq_server, tmp_path):
    """`sc-grpo pool serve` + `pool.attach=true`: two `sc-grpo run`s on the cluster share its 2 slots
    (each with a generation worker on both, training on its own), both finish exactly once, and the
    pool outlives them."""
    env = cluster.env
    pool = Lines(
        [sys.executable, "-m", "single_controller", "pool", "serve", f"--address={cluster.address}", "--slots=2"],
        cwd=tmp_path,
        env=env,
    )
    steps = 6
    common = (
        f"run.max_steps={steps}",
        "pool.enabled=true",
        "pool.attach=true",
        "backend.num_generation_workers=2",
        "rollout.max_in_flight_per_worker=8",
        "pool.gen_slots=[0,1]",
        "metrics.port=0",
    )
    try:
        pool.wait_for("sc-grpo pool: ready", START_S)
        runs = [
            Lines(_run_cmd(tmp_path, n, cluster.address, *common, f"pool.train_slots=[{i}]"), cwd=tmp_path, env=env)
            for i, n in enumerate(("pa", "pb"))
        ]
        try:
            codes = [r.proc.wait(timeout=400) for r in runs]
        finally:
            for r in runs:
                if r.proc.poll() is None:
                    r.kill_group(signal.SIGKILL)
        for r, code in zip(runs, codes):
            assert code == 0, r.tail()
        for n in ("pa", "pb"):
            run_dir = next(tmp_path.glob(f"{n}-*"))
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["steps"] == steps and summary["storage_keys_left"] == 0, summary
            ledger = json.loads((run_dir / "prompt_ledger.json").read_text())["prompts"]
            per_step = collections.Counter(p["step"] for p in ledger if p["fate"] == "trained")
            assert per_step == {k: 16 for k in range(steps)}, per_step
            last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            assert last["elastic/expands"] >= 1, last  # the pool brought its workers in
        assert pool.proc.poll() is None, pool.tail()  # the pool outlived both runs
    finally:
        pool.kill_group(signal.SIGTERM)
        try:
            pool.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pool.kill_group(signal.SIGKILL)
