"""The short sim run with every logger that the logger tests drive (through the CLI in tests/e2e/test_loggers_run.py,
in this process in tests/unit/test_loggers.py). Not a test module."""

from __future__ import annotations

from single_controller.runtime.records import is_eval_record

# The first drive trains 6 steps and keeps the checkpoint of step 4 only: the resume trains steps 4
# and 5 again (their records replace the first drive's), then 6 to 8.
STEPS, CHECKPOINT, RESUMED_STEPS = 6, 4, 9
RUN = [
    "configs/sim.yaml",
    "run.loggers=[jsonl,tensorboard,wandb]",
    f"run.max_steps={STEPS}",
    "run.sample_every_steps=2",  # the controller's samples: steps 0, 2 and 4
    f"checkpoint.every_steps={CHECKPOINT}",
    "checkpoint.at_exit=false",
    "eval.enabled=true",
    "eval.every_steps=2",
    "metrics.enabled=false",
    "run.plot=false",
    "run.progress_bar=false",
]


def steps_of(records):
    return [r for r in records if not is_eval_record(r)]
