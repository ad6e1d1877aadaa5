"""`ProcessTree`: every process descended from a driver while it runs (Ray's, the workers', the
engines'), to check that none outlives the run. Test code: it polls with `time.sleep`."""

from __future__ import annotations

import subprocess
import time

import psutil


class ProcessTree:
    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.seen: dict[int, str] = {}  # pid -> the start of its command line

    @classmethod
    def follow(cls, proc: subprocess.Popen, timeout: float = 60) -> tuple[ProcessTree, str]:
        """Read `proc`'s output to its end, recording its descendants after each line, and wait for
        it to exit (killed if it has not `timeout` s after its output ended). Returns (tree, output)."""
        tree = cls(proc.pid)
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                tree.snapshot()
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        return tree, "".join(lines)

    def snapshot(self) -> None:
        """Record the driver's descendants alive now."""
        try:
            for p in self.root.children(recursive=True):
                try:
                    self.seen.setdefault(p.pid, " ".join(p.cmdline())[:80])
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        except psutil.NoSuchProcess:
            pass

    def alive(self, timeout: float) -> dict[int, str]:
        """The recorded processes still alive (zombies excluded) once all are gone or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while True:
            alive = {}
            for pid, cmd in self.seen.items():
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        alive[pid] = cmd
                except psutil.NoSuchProcess:
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)
