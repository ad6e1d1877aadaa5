"""The Megatron-core trainer backend (`backend.trainer: megatron`; needs the `megatron` extra).

`model` builds Llama-, Qwen- and GPT-2-family GPTModels and converts their weights exactly to and
from Hugging Face names; `trainer` is one rank's split train API (`MegatronTrainerCore`);
`ray_workers` the rank actors and `megatron_trainer_group` (a `RankTrainerGroup`); `cpu_emulation`
runs megatron-core on CPU for tests. Nothing here imports megatron-core at import time, so configs
load without the extra.
"""
