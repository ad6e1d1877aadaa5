"""Rules for colocated runs (`backend.colocate`, `colocate_form`) and the trainer's memory settings
(`train.offload`, `train.gpu_memory_fraction`): each `rule(cfg) -> Problem | None`, in `rules.RULES`."""

from __future__ import annotations

from single_controller.backends.common.colocation import colocated_on_gpu, generation_on_gpu, training_on_gpu
from single_controller.config.problems import Problem
from single_controller.config.schema import Config

SHARED_GPU_MEMORY = 0.95  # what the two shares of one GPU may add up to (CUDA context, allocator slack)


def colocation_is_on_one_device(cfg: Config) -> Problem | None:
    """Both roles on the CPU, or both on one GPU: one worker and one rank there (a GPU each for more)."""
    b = cfg.backend
    if not b.colocate:
        return None
    paths = ("backend.colocate", "backend.generation", "vllm.device", "backend.trainer", "backend.trainer_device")
    gen, train = generation_on_gpu(cfg), training_on_gpu(cfg)
    if gen != train:
        where = "generation on a GPU, training on the CPU" if gen else "training on a GPU, generation on the CPU"
        return Problem(
            paths,
            f"backend.colocate=true with {where}: colocation shares one device, so put both roles on the GPU "
            "(vLLM with vllm.device=cuda, and backend.trainer_device=cuda or Megatron on CUDA) or both on the CPU",
        )
    if gen and (b.num_generation_workers, b.num_trainer_ranks) != (1, 1):
        return Problem(
            (*paths, "backend.num_generation_workers", "backend.num_trainer_ranks"),
            f"backend.colocate=true on a GPU shares one GPU between one generation worker and one trainer rank; "
            f"this run has {b.num_generation_workers} worker(s) and {b.num_trainer_ranks} rank(s): colocation "
            "across several GPUs is not built (use backend.colocate=false, a GPU per worker and per rank)",
        )
    return None


def turns_can_free_the_engine(cfg: Config) -> Problem | None:
    """In turns on a GPU the engine must give its memory back while the trainer steps: vLLM's sleep."""
    if not (cfg.backend.colocate and cfg.backend.colocate_form == "turns" and colocated_on_gpu(cfg)):
        return None
    if cfg.rollout.sleep_level >= 1:
        return None
    return Problem(
        ("backend.colocate_form", "rollout.sleep_level"),
        "backend.colocate_form=turns on a GPU needs rollout.sleep_level 1 (the engine's weights go to host "
        "memory and its KV cache is freed while the trainer steps) or 2 (both freed; the new weights come "
        "with the wake); level 0 would keep the engine's memory through every train step",
    )


def turns_are_the_runs_own(cfg: Config) -> Problem | None:
    """A pool already time-shares the workers between its runs (the same hooks): not both."""
    if not (cfg.backend.colocate and cfg.backend.colocate_form == "turns" and cfg.pool.enabled):
        return None
    return Problem(
        ("backend.colocate_form", "pool.enabled"),
        "backend.colocate_form=turns in a pool: the pool already gives the device to training and back "
        "(its train slots); use backend.colocate_form=shared or leave the pool",
    )


def offload_needs_turns(cfg: Config) -> Problem | None:
    """`train.offload` moves the trainer's state out of the engine's way during a turn; the torch
    and fsdp trainers do it (and the sim records it); Megatron's trainer keeps its state."""
    if cfg.train.offload == "none":
        return None
    paths = ("train.offload", "backend.colocate", "backend.colocate_form", "backend.trainer")
    if not (cfg.backend.colocate and cfg.backend.colocate_form == "turns"):
        return Problem(
            paths,
            f"train.offload={cfg.train.offload} without backend.colocate=true and backend.colocate_form=turns: "
            "nothing would take the memory it frees, and every step would pay for the move; use train.offload=none",
        )
    if cfg.backend.trainer == "megatron":
        return Problem(
            paths,
            f"train.offload={cfg.train.offload} with backend.trainer=megatron: Megatron's trainer does not offload "
            "its state (the torch and fsdp trainers do); use train.offload=none (the engine's sleep still frees "
            "its memory)",
        )
    return None


def gpu_memory_shares_fit(cfg: Config) -> Problem | None:
    """`train.gpu_memory_fraction` is the torch and fsdp trainers' on CUDA; shared on one GPU, the engine's and
    the trainer's shares must both be set and fit together."""
    frac = cfg.train.gpu_memory_fraction
    paths = ("train.gpu_memory_fraction", "backend.trainer", "backend.trainer_device", "vllm.gpu_memory_utilization")
    if frac is not None and not (cfg.backend.trainer in ("torch", "fsdp") and cfg.backend.trainer_device == "cuda"):
        return Problem(
            paths,
            "train.gpu_memory_fraction limits the torch or fsdp trainer on CUDA: set backend.trainer_device=cuda "
            "or null it",
        )
    if not colocated_on_gpu(cfg):
        return None
    engine = cfg.vllm.gpu_memory_utilization
    if engine > SHARED_GPU_MEMORY:
        return Problem(
            ("vllm.gpu_memory_utilization", "backend.colocate"),
            f"vllm.gpu_memory_utilization={engine:g} with both roles colocated on one GPU leaves the trainer none; "
            f"keep it at most {SHARED_GPU_MEMORY:g}",
        )
    if cfg.backend.colocate_form != "shared" or cfg.backend.trainer not in ("torch", "fsdp"):
        return None
    if frac is None:
        return Problem(
            (*paths, "backend.colocate_form"),
            f"backend.colocate_form=shared on one GPU: set train.gpu_memory_fraction (the trainer's share; the "
            f"engine's is vllm.gpu_memory_utilization={engine:g}) so neither takes the other's memory, e.g. "
            f"train.gpu_memory_fraction={round(SHARED_GPU_MEMORY - engine, 2):g}",
        )
    if engine + frac > SHARED_GPU_MEMORY:
        return Problem(
            (*paths, "backend.colocate_form"),
            f"backend.colocate_form=shared on one GPU: vllm.gpu_memory_utilization={engine:g} + "
            f"train.gpu_memory_fraction={frac:g} = {engine + frac:g} is over {SHARED_GPU_MEMORY:g} of the GPU; "
            "lower one of them, or use backend.colocate_form=turns (each phase gets the whole GPU)",
        )
    return None


RULES = (
    colocation_is_on_one_device,
    turns_can_free_the_engine,
    turns_are_the_runs_own,
    offload_needs_turns,
    gpu_memory_shares_fit,
)
