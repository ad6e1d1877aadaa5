"""`single_controller.step.grpo_step`: the step in one screen runs as written on the real worker
interfaces (the sim workers here) and does what the pumps do, in order."""

from __future__ import annotations

from replay.storage import InMemoryRowStorage
from single_controller.algorithm.advantages import grpo_advantages
from single_controller.backends.sim import sim_prompts, sim_rewards, sim_workers
from single_controller.step import grpo_step
from single_controller.types import LossConfig, SamplingParams


async def test_three_steps_of_the_spine_train_every_row_once_and_publish_each_version():
    async def main():
        storage = InMemoryRowStorage()
        gens, trainer = sim_workers(storage, num_generators=2)
        prompts = list(sim_prompts(12))
        results = []
        for step in range(3):
            batch = prompts[4 * step : 4 * step + 4]
            results.append(
                await grpo_step(
                    step,
                    batch,
                    gens,
                    trainer,
                    storage,
                    sampling=SamplingParams(n=4),
                    loss=LossConfig(),
                    groups_per_chunk=3,
                )
            )
            # one optimizer step over exactly this step's rows, then every worker on the new version
            assert sorted(trainer.trained[step]) == sorted(f"{p.prompt_id}-a0_g{i}" for p in batch for i in range(4))
            assert trainer.optimizer_steps == step + 1
            assert [g.version for g in gens] == [step + 1, step + 1]
            assert await storage.resident_keys() == set()  # trained rows are cleared
        return results

    results = await main()
    assert [r.step for r in results] == [0, 1, 2]


async def test_the_advantages_the_spine_sends_are_each_groups_normalised_rewards():
    sent = []

    async def main():
        storage = InMemoryRowStorage()
        gens, trainer = sim_workers(storage)
        original = trainer.train_microbatch

        async def spy(chunk):
            sent.append(chunk)
            await original(chunk)

        trainer.train_microbatch = spy
        prompts = list(sim_prompts(2))
        await grpo_step(0, prompts, gens, trainer, storage, sampling=SamplingParams(n=4), loss=LossConfig())
        return prompts

    prompts = await main()
    assert [c.chunk_index for c in sent] == [0, 1]  # one group per chunk by default
    for chunk, p in zip(sent, prompts):
        expected = grpo_advantages(sim_rewards(p.prompt_id, 0, 4), normalize_std=True, eps=1e-6)
        assert chunk.advantages == expected
        assert len(chunk.row_keys) == len(chunk.seq_lengths) == 4
