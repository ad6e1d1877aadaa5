"""The Ray workers' import shims (`replay/transferqueue/shims.py`), each in a fresh process: the cyclic collector is
paused until TransferQueue is imported (then back on, the import's objects frozen, Dynamo out, the modules' own
loaders kept), and a pause ends by itself in a process that never imports TransferQueue."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_worker_setup_pauses_the_collector_until_transfer_queue_is_imported():
    """Every Ray worker process of a run imports torch and TransferQueue with the cyclic collector
    paused; it is back on (with the import's objects frozen) once TQ is in, Dynamo stays out, and the
    imported modules keep their own loaders (TQ reads its config.yaml through them)."""
    out = _python(
        """
        import gc, sys
        from importlib import resources
        from replay.transferqueue.shims import install_shims, pause_gc_until_transfer_queue
        install_shims()
        assert not gc.isenabled(), "the collector runs during the imports"
        assert not pause_gc_until_transfer_queue(), "paused twice"
        import transfer_queue
        assert gc.isenabled(), "the collector stayed off after TQ was imported"
        assert gc.get_freeze_count() > 50_000, gc.get_freeze_count()
        assert "torch._dynamo" not in sys.modules
        for name in ("transfer_queue", "tensordict"):
            loader = sys.modules[name].__spec__.loader
            assert type(loader).__module__ != "replay.transferqueue.shims", (name, loader)
            assert sys.modules[name].__loader__ is loader, (name, loader)
        assert (resources.files("transfer_queue") / "config.yaml").is_file()
        assert not pause_gc_until_transfer_queue(), "TQ is imported already: nothing to pause for"
        print("OK")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-3000:]


def test_the_collector_pause_ends_by_itself_in_a_process_that_never_imports_transfer_queue():
    out = _python(
        """
        import gc, time
        from replay.transferqueue.shims import pause_gc_until_transfer_queue, resume_gc
        assert pause_gc_until_transfer_queue(max_s=0.3) and not gc.isenabled()
        time.sleep(1.0)
        assert gc.isenabled(), "still paused after max_s"
        resume_gc()  # idempotent
        assert gc.isenabled()
        print("OK")
        """,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-3000:]
