"""The Megatron-core trainer backend (`backend.trainer: megatron`; needs the `megatron` extra).

* `model`: Llama- and GPT-2-family GPTModels and their exact weight conversion to/from Hugging Face names.
* `trainer`: `MegatronTrainerCore`, one rank's split train API on Megatron DDP and optimizer.
* `ray_workers`: rank actors, `MegatronTrainerGroup` (the `TrainerGroup` the controller drives) and
  the registry starter `start_megatron_trainer`.
* `cpu_emulation`: running megatron-core on CPU for tests (`megatron.cpu_emulation`), never on CUDA.

No module here imports megatron-core at import time (only inside functions), so configs and the
registry load without the extra.
"""
