"""`sc-grpo run`: from a validated config to a finished run directory.

cpu backend: start (or attach to) Ray with resources that fit the machine, start the controller as
a CPU-only Ray actor (which starts TransferQueue and the workers side by side), stream one
record per step into the run directory and the console, save the final policy, and tear
everything down on success, error and Ctrl-C. sim backend: the same controller in-process.

Exit codes: 0 finished, 1 the run failed (its cause is printed, no traceback), 130 interrupted.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Awaitable, Callable

from single_controller.config import Config

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def run_from_config(cfg: Config) -> int:
    from single_controller.run_output import RunDirectory

    t_start = time.perf_counter()
    run_dir = RunDirectory.create(cfg)
    print(f"sc-grpo: run directory {run_dir.path}", flush=True)
    try:
        if cfg.backend.kind == "sim":
            code = asyncio.run(_drive_local(cfg, run_dir, t_start))
        else:
            code = _run_on_ray(cfg, run_dir, t_start)
    except KeyboardInterrupt:
        print("sc-grpo: interrupted; everything was shut down", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    finally:
        run_dir.close()
    return code


def _run_on_ray(cfg: Config, run_dir, t_start: float) -> int:
    from single_controller.ray_runtime import ray_session, worker_env

    b = cfg.backend
    # Logical CPUs: TQ takes 1 + storage units; workers and the controller ask for none, so this
    # never oversubscribes the real cores (one torch thread per worker process does that job).
    min_cpus = 1 + cfg.storage.num_storage_units + 1
    with ray_session(cfg.ray, min_cpus=min_cpus, env_vars=worker_env(b.torch_threads)) as session:
        print(f"sc-grpo: ray {time.perf_counter() - t_start:.1f}s", flush=True)
        # TransferQueue is started by the controller actor, beside the workers' own start-up.
        return session.run(_drive_actor(cfg, run_dir, t_start))


async def _drive_actor(cfg: Config, run_dir, t_start: float) -> int:
    import ray

    from single_controller.service import ControllerService

    actor_cls = ray.remote(num_cpus=0, num_gpus=0)(ControllerService)
    actor = actor_cls.options(name="sc-grpo-controller", max_concurrency=64).remote(cfg)

    async def call(method: str, *args: Any) -> Any:
        return await getattr(actor, method).remote(*args)

    try:
        return await _drive(cfg, run_dir, t_start, call)
    finally:
        ray.kill(actor)


async def _drive_local(cfg: Config, run_dir, t_start: float) -> int:
    from single_controller.service import ControllerService

    service = ControllerService(cfg)

    async def call(method: str, *args: Any) -> Any:
        return await getattr(service, method)(*args)

    return await _drive(cfg, run_dir, t_start, call)


async def _drive(cfg: Config, run_dir, t_start: float, call: Callable[..., Awaitable[Any]]) -> int:
    """Setup, run while streaming records, checkpoint, close: the same for an actor or in-process."""
    from single_controller.deadlines import within
    from single_controller.run_output import ConsoleReporter, is_eval_record

    reporter = ConsoleReporter(cfg)
    try:
        info = await within(call("setup"), cfg.timeouts.setup_s, "controller setup (storage, workers, metrics)")
        t_ready = time.perf_counter()
        if info.get("metrics_port"):
            print(f"sc-grpo: metrics on http://{cfg.metrics.host}:{info['metrics_port']}/metrics", flush=True)
        parts = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in info.items() if k.endswith("_s"))
        print(f"sc-grpo: started in {t_ready - t_start:.1f}s ({parts}); training", flush=True)
        run = asyncio.ensure_future(call("run"))
        cursor = 0
        try:
            while True:
                records, finished = await call("next_records", cursor)
                cursor += len(records)
                for rec in records:
                    rec = {**rec, "time/since_launch_s": time.perf_counter() - t_start}
                    run_dir.append_metrics(rec)
                    (reporter.eval if is_eval_record(rec) else reporter.step)(rec)
                if finished:
                    break
            summary = await run
        except BaseException:
            run.cancel()
            raise
        finally:
            reporter.close()
        ckpt = await call("save_checkpoint", str(run_dir.path / "checkpoint"))
        run_dir.write_json("summary.json", {**summary, "startup_s": t_ready - t_start, "checkpoint": ckpt})
        run_dir.write_json("prompt_ledger.json", await call("prompt_ledger"))
        print(
            f"sc-grpo: {summary['steps']} steps in {summary['wall_s']:.1f}s of training "
            f"(+{t_ready - t_start:.1f}s startup): {summary['stop_reason']}",
            flush=True,
        )
        if cfg.run.plot:
            run_dir.save_plot()
        return EXIT_OK
    except Exception as e:
        cause = e.__cause__ if getattr(e, "__cause__", None) is not None else e
        print(f"sc-grpo: run failed: {e}", file=sys.stderr, flush=True)
        if cause is not e:
            print(f"  cause: {type(cause).__name__}: {cause}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        try:
            await within(call("close"), 60, "controller close")
        except Exception as e:
            print(f"sc-grpo: close failed: {e}", file=sys.stderr, flush=True)
