"""The FSDP2 (DTensor) trainer backend (issue #52, in progress): `trainer.FsdpTrainerCore`."""
