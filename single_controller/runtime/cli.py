"""The `sc-grpo` command line: run, check a config, benchmark, inspect a live run.

Contract: `main(argv=None) -> int` never prints a traceback for a user error. An invalid configuration
prints the `ConfigError` report to stderr and returns 2; a command whose implementation is not
installed prints which entry point is missing and returns 1. Implementations are imported lazily,
inside each command, so `sc-grpo config` and `--help` work with nothing but the config modules.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse's code for usage errors; also used for invalid configurations
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

# `sc-grpo bench NAME` -> "module:function", each `main(argv: list[str]) -> int`
BENCHMARKS: dict[str, tuple[str, str]] = {
    "overlap": (
        "single_controller.bench.runner:main_overlap",
        "how much the async pipeline overlaps generation and training (vs synchronous)",
    ),
    "reference": (
        "single_controller.bench.reference_loop:main",
        "the embedded torch backend against a plain single-process reference loop",
    ),
    "storage": (
        "single_controller.bench.tq:main",
        "TransferQueue row storage put/get throughput",
    ),
    "scale": (
        "single_controller.bench.runner:main_scale",
        "the control plane at 16-1024 groups per step and 1-64 workers; memory over 10,000 steps",
    ),
    "embedded": (
        "single_controller.bench.runner:main_embedded",
        "the embedded default for 3 seeds: start-up, training time vs the reference loop, whole command",
    ),
    "startup": (
        "single_controller.bench.startup:main",
        "a run's start-up split by phase and process, beside the floor (bare ray.init + a torch import)",
    ),
    "sync": (
        "single_controller.bench.sync:main",
        "one weight sync to 1-2 workers by each transport, beside a raw gloo broadcast and a memcpy",
    ),
    "trl": (
        "single_controller.bench.trl:main",
        "sc-grpo against TRL's GRPOTrainer on the identical model, data and settings (the `bench` extra)",
    ),
    "eval": (
        "single_controller.bench.runner:main_eval",
        "training throughput with held-out evaluation every N steps vs eval off",
    ),
    "one-gpu": (
        "single_controller.bench.one_gpu:main",
        "one GPU: vLLM alone, sc-grpo colocated (shared, turns) and TRL's colocated GRPOTrainer, same model and data",
    ),
    "fsdp-memory": (
        "single_controller.bench.fsdp_memory:main",
        "the FSDP2 trainer's memory per rank for one model on 1, 2 and 4 ranks, beside 1/N of one rank's",
    ),
    "logprob-memory": (
        "single_controller.bench.logprob_memory:main",
        "the trainer's peak memory for response-token log-probabilities at a 151,936 vocabulary, chunked vs whole",
    ),
    "pool": (
        "single_controller.bench.pool:main",
        "two runs sharing 4 slots (gap-ratio pool) against the static splits by run and by role (sim workers)",
    ),
}


class EntryPointMissing(Exception):
    """The module or function implementing a command is not part of this installation."""


def _load_entry_point(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # only "the module itself (or a parent package) does not exist" is a missing entry point; a
        # missing dependency inside an existing module is a real error and keeps its traceback
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise EntryPointMissing(f"{spec} is not available: no module named {e.name!r}") from None
        raise
    try:
        return getattr(module, attr)
    except AttributeError:
        raise EntryPointMissing(f"{spec} is not available: {module_name} has no {attr!r}") from None


def _load(args: argparse.Namespace):
    from single_controller.preflight.loader import load_config

    return load_config(args.config, args.overrides)


def _cmd_run(args: argparse.Namespace) -> int:
    from single_controller.checkpoint import latest_checkpoint
    from single_controller.runtime.run_dir import resume_config

    if args.resume is None:
        if args.config is None:
            raise _UsageError("sc-grpo run: a CONFIG file is required (or --resume RUN_DIR)")
        cfg = _load(args)
    else:
        overrides = list(args.overrides)
        if args.config is not None:
            if "=" not in args.config:
                raise _UsageError(
                    "sc-grpo run --resume RUN_DIR takes the run's own config.yaml; give only KEY=VALUE overrides"
                )
            overrides.insert(0, args.config)
        try:  # the config the run last ran with (an earlier resume's overrides included)
            cfg = resume_config(args.resume, overrides)
        except FileNotFoundError as e:
            raise _UsageError(f"sc-grpo run --resume: {e}") from None
        latest_checkpoint(args.resume)  # a clear error now, before anything starts
    run_from_config = _load_entry_point("single_controller.runtime.driver:run_from_config")
    return int(run_from_config(cfg) if args.resume is None else run_from_config(cfg, args.resume))


def _cmd_config(args: argparse.Namespace) -> int:
    from single_controller.preflight.loader import config_reference_markdown, config_to_yaml

    if args.reference:
        sys.stdout.write(config_reference_markdown())
        return EXIT_OK
    if args.config is None:
        raise _UsageError("sc-grpo config: give a CONFIG file (or --reference)")
    from single_controller.preflight.environment import gpu_split
    from single_controller.preflight.loader import environment_problems

    cfg = _load(args)
    sys.stdout.write(config_to_yaml(cfg))
    split = gpu_split(cfg)
    if split is not None:
        print(f"sc-grpo config: GPUs: {split[0]}", file=sys.stderr)
    # The config is valid; what this machine lacks for it (packages, the model directory) is what
    # `sc-grpo run` would refuse here: said on stderr, without failing (a config for another machine
    # is still a valid config).
    problems = environment_problems(cfg)
    if problems:
        print(
            "sc-grpo config: the config is valid, but on this machine `sc-grpo run` would refuse it "
            f"({len(problems)}):",
            file=sys.stderr,
        )
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.name is None:
        raise _UsageError(f"sc-grpo bench: give a benchmark NAME: {', '.join(BENCHMARKS)}")
    spec, _ = BENCHMARKS[args.name]
    fn = _load_entry_point(spec)
    return int(fn(list(args.args)))


def _cmd_init_model(args: argparse.Namespace) -> int:
    fn = _load_entry_point("single_controller.data.hf_model:main_init_model")
    return int(fn([args.dir, *args.args]))


def _cmd_storage(args: argparse.Namespace) -> int:
    fn = _load_entry_point("single_controller.runtime.storage_service:main")
    return int(fn(list(args.args)))


def _cmd_pool(args: argparse.Namespace) -> int:
    fn = _load_entry_point("single_controller.runtime.pool_run:main")
    return int(fn(list(args.args)))


def _cmd_env(args: argparse.Namespace) -> int:
    fn = _load_entry_point("single_controller.envs.http_server:main")
    return int(fn(list(args.args)))


def _cmd_status(args: argparse.Namespace) -> int:
    fn = _load_entry_point("single_controller.runtime.status:main")
    argv = ["--url", args.url] if args.url else []
    if args.watch is not None:
        argv += ["--watch", str(args.watch)]
    if args.timeout is not None:
        argv += ["--timeout", str(args.timeout)]
    return int(fn(argv))


class _UsageError(Exception):
    pass


_EXAMPLES = """\
commands:
  run      train with a config:      sc-grpo run configs/embedded.yaml train.lr=3e-4 run.max_steps=100
  config   validate and print it:    sc-grpo config configs/embedded_sync.yaml sampler.order=fifo
  bench    run a benchmark:          sc-grpo bench overlap --help
  status   ask a running controller: sc-grpo status --url http://127.0.0.1:9464
  init-model  write a tiny HF model: sc-grpo init-model models/tiny --hidden-size 64
  storage  a TransferQueue for runs:  sc-grpo storage serve --address HEAD_IP:6379
  pool     runs sharing slots:        sc-grpo pool run configs/pools/embedded.yaml
  env      serve an environment:     sc-grpo env serve lookup --port 8765

Overrides are `section.field=value` (values parsed as YAML: 3e-4, true, null, [0.9, 0.95]).
The full list of fields, with types, defaults and meaning, is in docs/config.md,
or printed by `sc-grpo config --reference`.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sc-grpo",
        description="Asynchronous GRPO with a single asyncio controller.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_run, _add_config, _add_bench, _add_status, _add_storage, _add_pool, _add_env, _add_init_model):
        add(sub)
    return parser


def _with_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", nargs="?", help="YAML config file, e.g. configs/embedded.yaml")
    p.add_argument(
        "overrides",
        metavar="KEY=VALUE",
        nargs="*",
        help="override a field, e.g. train.lr=3e-4 (applied in order, after the file)",
    )


def _subparser(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def _add_run(sub: Any) -> None:
    p = _subparser(
        sub,
        "run",
        help="train with a config",
        description="Validate the config, then run asynchronous GRPO: the run directory "
        "(<run.output_dir>/<run.name>-<timestamp>) gets the resolved config.yaml, metrics.jsonl, "
        "checkpoints/, prompt_ledger.json, summary.json, curves.png and logs/ (the output of every "
        "worker process). Ctrl-C or SIGTERM stops the run on its last finished step and checkpoints "
        "it; a second one forces the exit.",
        epilog="examples:\n  sc-grpo run configs/embedded.yaml train.lr=3e-4 run.max_steps=100\n"
        "  sc-grpo run --resume runs/embedded-20261123-120000 run.max_steps=300",
    )
    _with_config(p)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue this run directory from its newest checkpoint, with the config it last ran with "
        "(config.yaml, or its latest resume's config.resume.yaml) plus overrides",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the components' log records too: -v INFO, -vv DEBUG (default: warnings and errors)",
    )
    p.set_defaults(func=_cmd_run, subparser=p)


def _add_config(sub: Any) -> None:
    p = _subparser(
        sub,
        "config",
        help="validate a config and print it resolved",
        description="Load CONFIG with the overrides, report every problem at once (exit 2), or print "
        "the complete resolved configuration as YAML (exit 0); what this machine lacks for it (backend "
        "packages, a usable model.path), which `sc-grpo run` would refuse, is listed on stderr.",
        epilog="examples:\n  sc-grpo config configs/embedded.yaml rollout.group_size=8\n"
        "  sc-grpo config --reference > reference.md",
    )
    _with_config(p)
    p.add_argument(
        "--reference", action="store_true", help="print the markdown reference of every config field instead"
    )
    p.set_defaults(func=_cmd_config, subparser=p)


def _add_bench(sub: Any) -> None:
    bench_lines = "\n".join(f"  {name:<10} {desc}" for name, (_, desc) in BENCHMARKS.items())
    p = _subparser(
        sub,
        "bench",
        usage="sc-grpo bench [-h] NAME [ARGS ...]",
        help="run a benchmark (" + ", ".join(BENCHMARKS) + ")",
        description="Run a benchmark; the arguments after NAME are passed to it unchanged.\n\n"
        f"benchmarks:\n{bench_lines}",
        epilog="example:\n  sc-grpo bench overlap --help",
    )
    p.add_argument("name", metavar="NAME", nargs="?", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=_cmd_bench, subparser=p)


def _add_status(sub: Any) -> None:
    p = _subparser(
        sub,
        "status",
        help="show the state of a running controller",
        description="Read a running controller's metrics endpoint and summarize its state.",
        epilog=(
            "examples:\n  sc-grpo status --url http://127.0.0.1:9464\n  sc-grpo status --url 10.0.0.1:9464 --watch 2"
        ),
    )
    p.add_argument("--url", help="metrics endpoint of the run (default: the status tool's own; host:port is enough)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="HTTP timeout of one fetch (default 3)")
    p.set_defaults(func=_cmd_status)


def _add_storage(sub: Any) -> None:
    p = _subparser(
        sub,
        "storage",
        help="serve a TransferQueue on a Ray cluster that outlives runs, or list its partitions",
        description="serve: start a TransferQueue on the Ray cluster at --address and keep it until "
        "Ctrl-C / SIGTERM; runs attach to it with ray.address=ADDRESS storage.attach=true, each in its "
        "own partition. list: print its partitions and keys.",
        epilog="examples:\n  sc-grpo storage serve --address 10.0.0.1:6379\n"
        "  sc-grpo storage list --address 10.0.0.1:6379 --keys",
    )
    p.add_argument("args", metavar="ACTION", nargs=argparse.REMAINDER, help="serve|list and their options (--help)")
    p.set_defaults(func=_cmd_storage)


def _add_pool(sub: Any) -> None:
    p = _subparser(
        sub,
        "pool",
        help="several runs time-sharing one pool of slots (RLix-style), or serve such a pool on a cluster",
        description="run: start the runs POOL.yaml lists in one pool (one Ray, one TransferQueue, the pool "
        "actor), each with its own run directory, and write the pool's summary with its slot timeline. "
        "serve: the pool actor on the Ray cluster at --address until Ctrl-C; runs join it with "
        "pool.enabled=true pool.attach=true. See docs/pool.md.",
        epilog="examples:\n  sc-grpo pool run configs/pools/embedded.yaml\n"
        "  sc-grpo pool serve --address 10.0.0.1:6379 --slots 8",
    )
    p.add_argument("args", metavar="ACTION", nargs=argparse.REMAINDER, help="run POOL.yaml | serve and its options")
    p.set_defaults(func=_cmd_pool)


def _add_env(sub: Any) -> None:
    p = _subparser(
        sub,
        "env",
        help="serve an environment over HTTP for multi-turn runs (env.url)",
        description="serve: serve SPEC (lookup, guess or module:Class, what env.fn takes) over the JSON "
        "protocol of docs/environments.md, on 127.0.0.1 unless --host says otherwise; prints the url it "
        "listens on, one line, and serves until Ctrl-C / SIGTERM. Options: --host, --port (default 8765, "
        "0: a free one), --args JSON (the class's keyword arguments), --idle-timeout S.",
        epilog="examples:\n  sc-grpo env serve lookup --port 8765\n"
        "  sc-grpo env serve guess --args '{\"shaped\": true}'\n"
        "  sc-grpo run configs/embedded.yaml env.url=http://127.0.0.1:8765",
    )
    p.add_argument("args", metavar="ACTION", nargs=argparse.REMAINDER, help="serve SPEC and its options (--help)")
    p.set_defaults(func=_cmd_env)


def _add_init_model(sub: Any) -> None:
    p = _subparser(
        sub,
        "init-model",
        help="write a tiny random-init Hugging Face model and its tokenizer",
        description="Write a random-init LlamaForCausalLM, or Qwen2ForCausalLM / Qwen3ForCausalLM / "
        "GPT2LMHeadModel with --arch qwen2 / qwen3 / gpt2 (head_dim 32 by default: valid for vLLM's CPU "
        "attention) and its tokenizer (a byte-level BPE with a chat template, or --tokenizer char) into DIR, "
        "offline. Use it as model.path. Options after DIR: --hidden-size, --num-layers, --head-dim, "
        "--intermediate-size, --num-kv-heads, --max-positions, --seed, --arch, --rope-theta, --tokenizer, "
        "--vocab-size, --tie-embeddings "
        "(`sc-grpo init-model DIR --help`).",
        epilog="examples:\n  sc-grpo init-model models/tiny-llama --hidden-size 64 --seed 0\n"
        "  sc-grpo init-model models/tiny-qwen3 --arch qwen3\n"
        "  sc-grpo init-model models/tiny-gpt2 --arch gpt2",
    )
    p.add_argument("dir", metavar="DIR", help="the model directory to write")
    p.add_argument("args", metavar="OPTIONS", nargs=argparse.REMAINDER, help="--hidden-size N etc.")
    p.set_defaults(func=_cmd_init_model)


def main(argv: Sequence[str] | None = None) -> int:
    from single_controller.checkpoint import CheckpointError
    from single_controller.preflight.loader import ConfigError
    from single_controller.runtime.logs import console_logging
    from single_controller.runtime.ray_session import RayUnreachable

    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with usage on bad arguments, 0 on --help
    # A config's `module:function` names (task.name, task.reward_fn, eval.dataset) import from the
    # current directory, as under `python -m single_controller`; Ray puts the driver's current
    # directory on its workers' path too, so a user's reward module is found everywhere.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with console_logging(getattr(args, "verbose", 0)):
            return args.func(args)
    except ConfigError as e:
        print(f"sc-grpo {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _UsageError as e:
        getattr(args, "subparser", parser).print_usage(sys.stderr)
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, RayUnreachable) as e:
        print(f"sc-grpo {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EntryPointMissing as e:
        print(f"sc-grpo {args.command}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"sc-grpo {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
