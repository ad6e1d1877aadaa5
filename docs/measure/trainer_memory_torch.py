"""Peak RSS of torch-trainer steps on a ~12.7 M-parameter TinyGPT (d_model 512, 4 layers)."""

import os
import resource
import sys

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # the tests' fixtures
from test_torch_trainer import make_rows  # noqa: E402

from single_controller.backends.torch.model import TinyGPT  # noqa: E402
from single_controller.backends.torch.trainer import TrainerCore  # noqa: E402
from single_controller.config.schema import ModelConfig, TrainConfig  # noqa: E402
from single_controller.data.tasks import TOKENIZER  # noqa: E402
from single_controller.types import LossConfig  # noqa: E402

torch.set_num_threads(1)
m = TinyGPT(ModelConfig(d_model=512, n_heads=8, n_layers=4), TOKENIZER.vocab_size, seed=0)
n = sum(p.numel() for p in m.parameters())
t = TrainerCore(m, TrainConfig())
rows = make_rows(64, 1)


def step(k):
    t.begin_train_step(k, LossConfig())
    t.train_microbatch(rows)
    t.finish_train_step(k)


step(0)  # Adam state exists from here
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for k in range(1, 6):
    step(k)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(
    f"params {n / 1e6:.1f} M ({n * 4 / 2**20:.0f} MiB fp32): peak RSS after step 0 {base / 1024:.0f} MiB, "
    f"after 5 more steps {peak / 1024:.0f} MiB (+{(peak - base) / 1024:.0f})"
)
