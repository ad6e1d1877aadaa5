"""`sc-grpo bench one-gpu`: one GPU, the same model, prompts, reward and settings
(`configs/one_gpu.yaml`), five contenders one after the other, each in its own process:

- `engine`: vLLM alone, its offline `LLM.generate` on the step's batch (the config's prompts through
  its chat template, G completions each, its sampling settings and engine arguments): the ceiling
  of a generation phase;
- `shared` and `turns`: `sc-grpo run` in both colocated forms;
- `trl`: TRL's `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"` (the `bench` extra), the
  same model directory, prompts, reward functions and weights, G, batch, completion length, learning
  rate, clip range and precision, for the same number of steps;
- `fsdp`: `sc-grpo run` shared with `backend.trainer=fsdp` (the FSDP2 trainer, one rank), its step
  time and peak memory beside the torch trainer's.

Reported (markdown, to `--out`/one_gpu.md and stdout): per contender steps/s and the step split
(generation / training / weight update / sleep and wake), generation and training tokens/s, the
trainer's model FLOPs utilisation, peak device memory, the bf16 mismatch KL, the reward range; then
the two ratios the issue sets: sc-grpo's better form over TRL in steps/s (>= 1.3) and sc-grpo's
generation phase over vLLM alone (>= 0.8). `--dry-run`: the same on the CPU with a CPU-sized model
(vLLM's CPU engine; TRL without vLLM, which it runs only on CUDA): it proves every step and the report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTENDERS = ("engine", "shared", "turns", "trl", "fsdp")
FORMS = {
    "shared": ["backend.colocate_form=shared"],
    "turns": ["backend.colocate_form=turns", "train.offload=optimizer"],
    # the FSDP2 trainer (one rank: nothing to shard, its step and memory beside the torch trainer's)
    "fsdp": ["backend.colocate_form=shared", "backend.trainer=fsdp"],
}
TORCH_FORMS = ("shared", "turns")  # the forms the ratios compare (the torch trainer's)
# The dry run's CPU-sized twin of configs/one_gpu.yaml: same arch, options and data, small numbers.
DRY_RUN = [
    "vllm.device=cpu",
    "vllm.enforce_eager=true",  # no compile on the CPU
    "backend.trainer_device=cpu",
    "train.gpu_memory_fraction=null",
    "rollout.sleep_level=0",  # vLLM sleeps on CUDA only; the CPU turns keep its memory
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=128",
    "model.max_seq_len=128",
    "rollout.max_new_tokens=16",
    "rollout.group_size=4",
    "train.groups_per_step=4",
    "train.min_groups_per_chunk=2",
    "rollout.max_in_flight_groups=8",
]
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense, per GPU (SXM)
WARMUP_STEPS = 2  # left out of every median: allocator growth, first compiles


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sc-grpo bench one-gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="configs/one_gpu.yaml")
    p.add_argument("overrides", nargs="*", help="key=value for every contender")
    p.add_argument("--steps", type=int, default=12, help="steps per training contender (the first 2 are warm-up)")
    p.add_argument("--batches", type=int, default=3, help="timed batches of vLLM alone (after one warm-up)")
    p.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    p.add_argument("--out", default="runs/bench_one_gpu")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, CPU-sized (proves the script)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per contender")
    p.add_argument("--role", choices=("engine", "trl"), help=argparse.SUPPRESS)  # a contender's own process
    return p.parse_args(argv)


def load(args: argparse.Namespace, extra: Sequence[str] = ()) -> Any:
    from single_controller.preflight.loader import load_config

    overrides = [*(DRY_RUN if args.dry_run else []), *args.overrides, *extra]
    if args.dry_run:
        overrides.append(f"model.path={Path(args.out).resolve()}/model-cpu-seed${{seed}}")
    return load_config(args.config, overrides)


def prepare(args: argparse.Namespace) -> Any:
    """The config, with its model directory written once (every contender loads the same one)."""
    from single_controller.data.hf_model import prepare_model_dir

    cfg = load(args)
    if prepare_model_dir(cfg.model, cfg.seed, bool(cfg.data.train_files)):
        print(f"wrote {cfg.model.path}", flush=True)
    return cfg


# -- vLLM alone ------------------------------------------------------------------------------------


def step_batch(cfg: Any, index: int) -> list[list[int]]:
    """The token ids of batch `index` of the config's prompts (a step's worth: train.groups_per_step)."""
    from single_controller.data.sources import train_prompts

    n = cfg.train.groups_per_step
    prompts = train_prompts(cfg).prompts
    return [list(prompts[(index * n + i) % len(prompts)].token_ids) for i in range(n)]


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM alone: one warm-up batch, then `--batches` timed; completion tokens per second."""
    cfg = load(args)
    from single_controller.backends.vllm.engine_env import apply_engine_env

    apply_engine_env(cfg.vllm.device, cfg.vllm.kv_cache_gib)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from single_controller.backends.vllm.worker import engine_args
    from single_controller.config.schema import rollout_max_new_tokens
    from single_controller.data.tokenizer import load_tokenizer

    kwargs = {k: v for k, v in engine_args(cfg, cfg.seed).items() if k != "worker_extension_cls"}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    r = cfg.rollout
    eos = list(load_tokenizer(cfg.model.path).eos_ids) if r.stop_at_eos else []
    params = SamplingParams(
        n=r.group_size,
        temperature=r.temperature,
        top_p=r.top_p,
        max_tokens=rollout_max_new_tokens(cfg),
        logprobs=0,
        ignore_eos=True,
        stop_token_ids=eos or None,
        detokenize=False,
    )
    times, tokens = [], []
    for b in range(args.batches + 1):
        batch = [TokensPrompt(prompt_token_ids=ids) for ids in step_batch(cfg, b)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        if b > 0:  # the first batch warms the engine up
            times.append(time.perf_counter() - t0)
            tokens.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
    return {
        "who": "engine",
        "start_s": start_s,
        "batch_s": statistics.median(times),
        "gen_tokens_per_s": sum(tokens) / sum(times),
        "tokens_per_batch": statistics.mean(tokens),
    }


# -- TRL's GRPOTrainer, vLLM colocated -------------------------------------------------------------


def trl_rewards(cfg: Any) -> tuple[list[Any], list[float]]:
    """The config's batched reward functions, called as TRL calls them (a conversational
    completion becomes its text), and their weights."""
    from single_controller.data.rewards import resolve_reward_fn, reward_form

    def text_of(spec: str) -> Any:
        fn = resolve_reward_fn(spec)
        if reward_form(fn) != "batched":
            raise SystemExit(f"bench one-gpu: reward {spec} is per completion; TRL takes batched ones")

        def reward(prompts: list, completions: list, **columns: Any) -> list[float | None]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return list(fn(prompts=prompts, completions=texts, **columns))

        reward.__name__ = spec.rpartition(":")[2]
        return reward

    return [text_of(f.fn) for f in cfg.reward.functions], [f.weight for f in cfg.reward.functions]


def trl_config(cfg: Any, args: argparse.Namespace, out: str) -> Any:
    """TRL's settings, each one the config's; on the GPU its vLLM colocated, in the engine's share."""
    from trl import GRPOConfig

    from single_controller.config.schema import rollout_max_new_tokens

    t, r, cuda = cfg.train, cfg.rollout, not args.dry_run
    completions = t.groups_per_step * r.group_size
    micro = min(completions, 32 if cuda else completions)  # 32 x ~536 tokens: sc-grpo's micro_batch_tokens
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": cfg.vllm.gpu_memory_utilization}
    return GRPOConfig(
        output_dir=out,
        use_cpu=not cuda,
        bf16=cfg.model.dtype == "bfloat16" and cuda,
        gradient_checkpointing=t.gradient_checkpointing,
        disable_dropout=True,
        seed=cfg.seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,  # one optimizer step per step of rollouts
        num_generations=r.group_size,
        num_iterations=1,
        max_completion_length=rollout_max_new_tokens(cfg),
        temperature=r.temperature,
        top_p=r.top_p,
        learning_rate=t.lr,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        lr_scheduler_type="constant",
        beta=0.0,
        epsilon=t.clip_eps,
        loss_type="dapo",  # token-level, as sc-grpo's default
        scale_rewards="group",
        max_steps=args.steps,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **(vllm if cuda else {}),
    )


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer for `--steps` steps; the wall time of each."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from single_controller.data.files import read_records

    cfg = load(args)
    if not args.dry_run:  # TRL's colocated engine, as sc-grpo's: without FlashInfer where it is missing
        from single_controller.backends.vllm.engine_env import gpu_sampler_env

        os.environ.update(gpu_sampler_env())
    rows = [rec for f in cfg.data.train_files for rec in read_records(f)]
    data = Dataset.from_list([{"prompt": rec[cfg.data.prompt_key], **_columns(rec, cfg)} for rec in rows])
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    funcs, weights = trl_rewards(cfg)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        config = trl_config(cfg, args, out)
        config.reward_weights = weights
        tok = AutoTokenizer.from_pretrained(cfg.model.path)
        trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=config, train_dataset=data, processing_class=tok)
        trainer.add_callback(Clock())
        t0 = time.perf_counter()
        trainer.train()
    steps = [b - a for a, b in zip([t0, *ends], ends)]
    timed = steps[WARMUP_STEPS:] or steps
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"who": "trl", "steps": len(steps), "step_s": statistics.median(timed), "torch_peak_bytes": peak}


def _columns(rec: dict, cfg: Any) -> dict[str, Any]:
    skip = {cfg.data.prompt_key}
    return {k: v for k, v in rec.items() if k not in skip}


# -- the race --------------------------------------------------------------------------------------


class PeakMemory:
    """The GPU's peak used memory while a contender runs (nvidia-smi every 0.5 s; None without one)."""

    def __init__(self) -> None:
        self.peak_mib: int | None = None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "500"]
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib or 0, int(line))

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


def _own_process(args: argparse.Namespace, role: str, out: Path) -> dict[str, Any]:
    """Run contender `role` in a process of its own (the GPU is whole again after it); its result."""
    result = out / f"{role}.json"
    cmd = [sys.executable, "-m", "single_controller.bench.one_gpu", args.config, *args.overrides]
    cmd += ["--role", role, "--steps", str(args.steps), "--batches", str(args.batches), "--out", args.out]
    cmd += ["--dry-run"] if args.dry_run else []
    log = out / f"{role}.log"
    with PeakMemory() as mem, open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    if proc.returncode != 0 or not result.exists():
        tail = log.read_text()[-1500:]
        return {"who": role, "failed": f"exit {proc.returncode}; {log}:\n{tail}"}
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - t0, "peak_mib": mem.peak_mib}


def _sc_grpo(args: argparse.Namespace, form: str, out: Path) -> dict[str, Any]:
    """`sc-grpo run` in colocated form `form`; its step records, summarized."""
    runs = out / "runs"
    name = f"one_gpu-{form}"
    cmd = [sys.executable, "-m", "single_controller", "run", args.config, *args.overrides, *FORMS[form]]
    cmd += [*(DRY_RUN if args.dry_run else [])]
    if args.dry_run:
        cmd.append(f"model.path={Path(args.out).resolve()}/model-cpu-seed${{seed}}")
    cmd += [f"run.max_steps={args.steps}", f"run.output_dir={runs}", f"run.name={name}", "run.progress_bar=false"]
    cmd += ["run.plot=false", "metrics.port=0"]
    log = out / f"{form}.log"
    with PeakMemory() as mem, open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    dirs = sorted(runs.glob(f"{name}-*"), key=os.path.getmtime)
    if proc.returncode != 0 or not dirs:
        return {"who": form, "failed": f"exit {proc.returncode}; {log}:\n{log.read_text()[-1500:]}"}
    records = [json.loads(line) for line in (dirs[-1] / "metrics.jsonl").read_text().splitlines()]
    return {**summarize(records, form), "wall_s": time.perf_counter() - t0, "peak_mib": mem.peak_mib}


def summarize(records: list[dict[str, Any]], who: str) -> dict[str, Any]:
    """Medians over the steps past the warm-up of the step and its parts; tokens/s of each phase over
    all of them. The generation phase: in `turns` what is left of the step once training, the sync
    and the switches are taken out (generation has the device then); in `shared` the step less the
    sync's closed admission (generation runs beside training throughout)."""
    switch = [0.0]  # sleep + wake + the trainer's moves, per step (the record holds running totals)
    keys = ("turns/sleep_s", "turns/wake_s", "turns/offload_s", "turns/onload_s")
    for a, b in zip(records, records[1:]):
        switch.append(sum(b.get(k, 0.0) - a.get(k, 0.0) for k in keys))
    rows = []
    for r, sw in zip(records, switch):
        step, train, sync = r["time/step_s"], r["train/step_s"], r["sync/admission_closed_s"]
        gen_tokens = r["throughput/gen_tokens_per_s"] * step
        gen_s = max(1e-9, step - sync - (train + sw if who == "turns" else 0.0))
        rows.append(
            dict(
                step_s=step,
                train_s=train,
                sync_s=r["sync/last_s"],
                switch_s=sw,
                gen_s=gen_s,
                gen_tokens=gen_tokens,
                train_tokens=r["train/tokens"],
                mismatch_kl=r.get("train/mismatch_kl", float("nan")),
                reward=r["rollout/reward_mean"],
            )
        )
    timed_rows = rows[WARMUP_STEPS:] or rows
    med = {k: statistics.median(row[k] for row in timed_rows) for k in timed_rows[0]}
    # Throughputs over the whole timed window (a turn may generate two steps' groups at once)
    med["gen_tokens_per_s"] = sum(r["gen_tokens"] for r in timed_rows) / sum(r["gen_s"] for r in timed_rows)
    med["train_tokens_per_s"] = sum(r["train_tokens"] for r in timed_rows) / sum(r["train_s"] for r in timed_rows)
    rewards = [row["reward"] for row in rows]
    kl = [row["mismatch_kl"] for row in timed_rows if row["mismatch_kl"] == row["mismatch_kl"]]
    return {
        "who": who,
        "steps": len(records),
        **med,
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "mismatch_kl_max": max(kl, default=float("nan")),
    }


def model_params(path: str) -> int:
    """Parameters in the model directory's safetensors (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                total += math.prod(shape)
    return total


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def _f(x: Any, fmt: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def report(results: dict[str, dict[str, Any]], cfg: Any, gpu: str | None, dry_run: bool) -> str:
    """The markdown table and the two ratios."""
    n = model_params(cfg.model.path)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if gpu and k in gpu), None)
    where = "dry run on the CPU" if dry_run else gpu or "no GPU"
    r = cfg.rollout
    lines = [
        f"## bench one-gpu ({where}), {n / 1e6:.0f} M parameters, "
        f"{cfg.train.groups_per_step} prompts x {r.group_size}, up to {r.max_new_tokens} new tokens",
        "",
        "| contender | steps/s | step s | generation s | training s | weight update s | sleep+wake s | gen tok/s "
        "| train tok/s | MFU | peak MiB | mismatch KL med / max | reward min / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for who, r in results.items():
        if "failed" in r:
            lines.append(f"| {who} | failed: {r['failed'].splitlines()[0]} |" + " |" * 11)
            continue
        mfu = 6 * n * r["train_tokens_per_s"] / peak if peak and "train_tokens_per_s" in r else None
        step = float(r.get("step_s", r.get("batch_s")) or "nan")
        lines.append(
            f"| {who} | {_f(1 / step if who != 'engine' else None)} | {_f(step)} | {_f(r.get('gen_s'))} "
            f"| {_f(r.get('train_s'))} | {_f(r.get('sync_s'))} | {_f(r.get('switch_s'))} "
            f"| {_f(r.get('gen_tokens_per_s'), '.0f')} | {_f(r.get('train_tokens_per_s'), '.0f')} "
            f"| {_f(mfu, '.1%')} | {_f(r.get('peak_mib'), 'd')} "
            f"| {_f(r.get('mismatch_kl'))} / {_f(r.get('mismatch_kl_max'))} "
            f"| {_f(r.get('reward_min'))} / {_f(r.get('reward_max'))} |"
        )
    lines += ["", *ratios(results)]
    return "\n".join(lines) + "\n"


def ratios(results: dict[str, dict[str, Any]]) -> list[str]:
    ok = {k: v for k, v in results.items() if "failed" not in v}
    forms = [f for f in TORCH_FORMS if f in ok]
    out = []
    if forms and "trl" in ok:
        best = min(forms, key=lambda f: ok[f]["step_s"])
        speed = ok["trl"]["step_s"] / ok[best]["step_s"]
        out.append(f"- steps/s, sc-grpo ({best}) over TRL colocated: **{speed:.2f}x** (target >= 1.3)")
    for f in forms:
        if "engine" in ok:
            gen = ok[f]["gen_tokens_per_s"] / ok["engine"]["gen_tokens_per_s"]
            out.append(f"- generation phase, sc-grpo {f} over vLLM alone: **{gen:.2f}** (target >= 0.8)")
    if "fsdp" in ok and "shared" in ok:
        train = ok["fsdp"]["train_s"] / ok["shared"]["train_s"]
        out.append(f"- the fsdp trainer's step over the torch trainer's (both shared): **{train:.2f}x** the time")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.role is not None:  # a contender's own process
        result = run_engine(args) if args.role == "engine" else run_trl(args)
        (out / f"{args.role}.json").write_text(json.dumps(result))
        return 0
    cfg = prepare(args)
    results: dict[str, dict[str, Any]] = {}
    for who in args.only:
        print(f"== {who}", flush=True)
        results[who] = _sc_grpo(args, who, out) if who in FORMS else _own_process(args, who, out)
        print(json.dumps(results[who])[:400], flush=True)
    table = report(results, cfg, None if args.dry_run else gpu_name(), args.dry_run)
    (out / "one_gpu.md").write_text(table)
    (out / "one_gpu.json").write_text(json.dumps(results, indent=1))
    print(table, flush=True)
    return 1 if any("failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
