"""`sc-grpo bench fsdp-memory`: memory per rank of the FSDP2 trainer (`backend.trainer: fsdp`) for one
model on 1, 2 and 4 gloo ranks, each rank in a process of its own, the same global batch split over
the ranks as a run splits it.

Per rank: the resident training state (its shards of the parameters, of the gradients and of the
AdamW moments, counted from the tensors), and the step's peak: how far the process's resident memory
rose above where it stood before the step (Linux: `VmHWM` after resetting it with `clear_refs`), which
adds the activations, the one block's gathered parameters and the gradients before their reduction.
Each figure is compared with 1/N of the one-rank figure (the issue's bound: within 15 %). Both
`fsdp.reduce` modes: `microbatch` shards the gradients as they are made, `finish` keeps them whole
until the step's end. CPU only (a GPU's figures are `torch.cuda.max_memory_allocated`'s business).

The ranks run with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`): by default glibc raises
it after each large free, so FSDP's per-block buffers (tens of MiB, freed and made again every block)
come from the heap, whose freed pages stay resident: the high-water mark then shows the allocator's
retention (measured: 380-480 MiB for the forward of one row on 2 ranks) rather than what the step
holds (137-144 MiB with the threshold fixed).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIB = 2**20
BOUND = 0.15  # within 15 % of 1/N


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sc-grpo bench fsdp-memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--reduce", nargs="+", choices=("microbatch", "finish"), default=["microbatch", "finish"])
    p.add_argument(
        "--hidden", type=int, default=640, help="hidden size of the Llama written (default: 54 M parameters)"
    )
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--rows", type=int, default=64, help="rows of the global batch (split over the ranks)")
    p.add_argument("--row-tokens", type=int, default=96, help="prompt + response tokens a row")
    p.add_argument("--out", default="bench_out/fsdp_memory")
    return p.parse_args(argv)


def _status(field: str) -> int:
    """A `/proc/self/status` figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _settle() -> int:
    """Collect, give freed memory back to the system, reset the high-water mark; returns VmRSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _nbytes(tensors: Any) -> int:
    from single_controller.backends.fsdp.trainer import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def _rank(rank: int, world: int, port: int, path: str, args: argparse.Namespace, reduce: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from single_controller.algorithm.dp_split import balanced_partition
    from single_controller.backends.common.offload import optimizer_tensors
    from single_controller.backends.fsdp.trainer import FsdpTrainerCore, Reduce
    from single_controller.backends.torch.model import load_hf_policy
    from single_controller.config.schema import TrainConfig
    from single_controller.types import LossConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    assert dist.group.WORLD is not None  # initialized above
    mode: Reduce = "finish" if reduce == "finish" else "microbatch"
    core = FsdpTrainerCore(load_hf_policy(path), TrainConfig(), process_group=dist.group.WORLD, reduce=mode)
    rows = _batch(args, torch)
    mine = balanced_partition([args.row_tokens] * args.rows, world)[rank]
    share = {k: [v[i] for i in mine] for k, v in rows.items() if k != "advantage"}
    share["advantage"] = rows["advantage"][mine]
    peaks = []
    for step in range(3):  # the first builds the AdamW state; the peak of the later ones is kept
        before = _settle()
        core.begin_train_step(step, LossConfig())
        core.train_microbatch(share)
        mb = _status("VmHWM") - before
        mid = _settle()
        core.finish_train_step(step)
        peaks.append((max(mb, _status("VmHWM") - before), mb, _status("VmHWM") - mid))
    state = {
        "params": _nbytes(core.params),
        "grads": _nbytes(p.grad for p in core.params),
        "optimizer": _nbytes(optimizer_tensors(core.optimizer)),
    }
    worst = max(peaks[1:])
    result = {**state, "state": sum(state.values()), "step_peak": worst[0], "microbatch_peak": worst[1]}
    result.update(finish_peak=worst[2], rss=_status("VmRSS"))
    Path(out, f"{world}-{reduce}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _batch(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    prompt = args.row_tokens // 3
    response = args.row_tokens - prompt
    return {
        "prompt_ids": [torch.randint(0, 19, (prompt,), generator=g) for _ in range(args.rows)],
        "response_ids": [torch.randint(0, 19, (response,), generator=g) for _ in range(args.rows)],
        "gen_logprobs": [-torch.rand(response, generator=g) - 2.0 for _ in range(args.rows)],
        "response_mask": [torch.ones(response, dtype=torch.bool) for _ in range(args.rows)],
        "advantage": torch.randn(args.rows, generator=g),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def table(results: dict[tuple[int, str], list[dict]], params: int) -> str:
    lines = [
        f"## bench fsdp-memory: a {params / 1e6:.1f} M-parameter Llama, float32, per rank (the largest rank)",
        "",
        "| fsdp.reduce | ranks | params MiB | grads MiB | AdamW MiB | state MiB | x ranks / 1 rank | "
        "step peak MiB | x ranks / 1 rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (world, reduce), ranks in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        one = results.get((1, reduce))
        worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
        state_x = worst["state"] * world / one[0]["state"] if one else float("nan")
        peak_x = worst["step_peak"] * world / one[0]["step_peak"] if one else float("nan")
        lines.append(
            f"| {reduce} | {world} | {worst['params'] / MIB:.0f} | {worst['grads'] / MIB:.0f} "
            f"| {worst['optimizer'] / MIB:.0f} | {worst['state'] / MIB:.0f} | {state_x:.2f} "
            f"| {worst['step_peak'] / MIB:.0f} | {peak_x:.2f} |"
        )
    lines += ["", f"Within {BOUND:.0%} of 1/N: x ranks / 1 rank <= {1 + BOUND:.2f}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from single_controller.bench.one_gpu import model_params
    from single_controller.data import hf_model

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = str(
        hf_model.init_model(
            tempfile.mkdtemp(prefix="fsdp-memory-"),
            hidden_size=args.hidden,
            num_layers=args.layers,
            head_dim=64,
            max_positions=max(128, args.row_tokens),
        )
    )
    params = model_params(path)
    results: dict[tuple[int, str], list[dict]] = {}
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # the ranks' RSS follows what they hold (above)
    for reduce in args.reduce:
        for world in args.ranks:
            print(f"== {world} rank(s), fsdp.reduce={reduce}", flush=True)
            mp.spawn(_rank, args=(world, _free_port(), path, args, reduce, str(out)), nprocs=world, join=True)
            results[(world, reduce)] = [
                json.loads(Path(out, f"{world}-{reduce}-rank{r}.json").read_text()) for r in range(world)
            ]
    text = table(results, params)
    (out / "fsdp_memory.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
