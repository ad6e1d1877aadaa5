"""Peak RSS of Megatron-trainer steps (CPU emulation, 1 rank) on a ~12.6 M-parameter Llama."""

import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # the tests' fixtures
from free_ports import free_port  # noqa: E402
from megatron_fixtures import make_hf_dir, make_rows  # noqa: E402

from single_controller.backends.megatron.ray_workers import MegatronRankActor  # noqa: E402
from single_controller.config.schema import TrainConfig  # noqa: E402
from single_controller.types import LossConfig  # noqa: E402

torch.set_num_threads(1)
d = make_hf_dir(
    Path(tempfile.mkdtemp()) / "m",
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=1536,
)
rank = MegatronRankActor(0, 1)
rank.join("127.0.0.1", free_port(), 120, backend="gloo")
info = rank.build(str(d), TrainConfig(), tensor_parallel_size=1, emulate_cpu=True)
rows = make_rows(64, 3)


def step(k):
    rank.begin_train_step(k, LossConfig())
    rank.train_microbatch_rows(rows)
    rank.finish_train_step(k)


step(0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for k in range(1, 6):
    step(k)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = info["params"]
print(
    f"params {n / 1e6:.1f} M ({n * 4 / 2**20:.0f} MiB fp32): peak RSS after step 0 {base / 1024:.0f} MiB, "
    f"after 5 more steps {peak / 1024:.0f} MiB (+{(peak - base) / 1024:.0f})"
)
rank.close()
