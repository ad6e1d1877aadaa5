"""The collective transport's two ends in one process (threads, a gloo group; no Ray): what is sent
is what the trainer staged, bit for bit; a sender packs a new version into the buckets of the one it
drops, never into one a send is reading."""

import threading
from types import SimpleNamespace

import pytest
import torch

from single_controller.backends.common.weight_broadcast import (
    STAGED_VERSIONS,
    GroupAddress,
    WeightReceiver,
    WeightSender,
)
from single_controller.backends.common.weights import bucket_tensor, pack_weights


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(300, generator=g)}


def test_a_staged_bfloat16_snapshot_arrives_bit_for_bit_and_twice_into_the_same_buffers():
    sender, receiver = WeightSender(), WeightReceiver()
    host, port = sender.sync_address()
    addr = GroupAddress("t", "127.0.0.1", port, 2, "gloo", 30.0)
    joined = threading.Thread(target=receiver.join, args=(addr, 1))
    joined.start()
    sender.open_sync_group(addr)
    joined.join()
    got = []
    for v in range(2):
        snap = pack_weights(_model(v), v, bucket_bytes=4096, dtype=torch.bfloat16)
        staged = sender.stage_weights(snap, sender=None)
        send = threading.Thread(target=sender.send_weights, args=("t", v))
        send.start()
        got.append(receiver.receive("t", staged.manifest))
        send.join()
        for b, want in zip(got[-1].buckets, snap.buckets):
            assert b.dtype == torch.bfloat16 and torch.equal(b.view(torch.int16), bucket_tensor(want, "int16"))
    assert [b.data_ptr() for b in got[0].buckets] == [b.data_ptr() for b in got[1].buckets]  # reused


def test_make_room_recycles_the_dropped_versions_buckets_unless_a_send_reads_them():
    sender = WeightSender()
    snaps = []
    for v in range(STAGED_VERSIONS):
        snaps.append(pack_weights(_model(v), v, bucket_bytes=4096, dtype=torch.bfloat16))
        sender.stage_weights(snaps[-1], sender=None)
    spare = sender.make_room()  # drops v0, whose buckets no send reads
    assert spare is not None and sorted(sender._staged) == list(range(1, STAGED_VERSIONS))
    fresh = pack_weights(_model(9), 9, bucket_bytes=4096, dtype=torch.bfloat16)
    packed = pack_weights(_model(9), 9, bucket_bytes=4096, dtype=torch.bfloat16, into=spare)
    assert [b.__array_interface__["data"][0] for b in packed.buckets] == [t.data_ptr() for t in spare]
    assert all((a == b).all() for a, b in zip(packed.buckets, fresh.buckets))
    sender.stage_weights(packed, sender=None)
    sender._sending[1] = 1  # a send of v1 is under way
    assert sender.make_room() is None and 1 not in sender._staged  # dropped, but not recycled


class _Method:
    """A fake actor method: `.remote(...)` (and `.options(...).remote(...)`) returns what `fn` does."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)

    def options(self, **_):
        return self


async def test_a_transfer_cut_short_by_its_deadline_leaves_its_group_the_next_one_forms_another():
    # (S2) an expand's update that timed out kept its group: the next transfer could run on it beside the first
    import asyncio

    from single_controller.backends.common.actor_client import ActorGenerationClient
    from single_controller.backends.common.weight_broadcast import StagedWeights
    from single_controller.deadlines import DeadlineExceeded, within
    from single_controller.types import WeightsHandle

    stuck = asyncio.Event()  # the first transfer never ends (the test's end cancels it)
    keys_sent: list[str] = []
    closed: list[str] = []

    async def nothing(*_):
        return None

    async def sync_address():
        return "127.0.0.1", 1

    async def send(key, version):
        keys_sent.append(key)
        if len(keys_sent) == 1:
            await stuck.wait()
        return 0

    async def receive(weights, key):
        if weights.version == 1:
            await stuck.wait()
        return weights.version

    async def one_rank():
        return 1

    sender = SimpleNamespace(
        sync_address=_Method(sync_address),
        open_sync_group=_Method(nothing),
        send_weights=_Method(send),
        close_sync_group=_Method(closed.append),
    )
    actor = SimpleNamespace(
        sync_ranks=_Method(one_rank), join_sync_group=_Method(nothing), receive_weights=_Method(receive)
    )
    client = ActorGenerationClient("gen-0", actor)
    handle = WeightsHandle(1, StagedWeights(manifest=None, sender=sender), 0)  # type: ignore[arg-type]
    try:
        with pytest.raises(DeadlineExceeded):
            await within(client.update_weights(handle), 0.05, "update_weights(v1)")
        assert client._group is None and closed == keys_sent[:1]
        await within(client.update_weights(WeightsHandle(2, handle.payload, 0)), 1.0, "update_weights(v2)")
        assert len(keys_sent) == 2 and keys_sent[1] != keys_sent[0]
    finally:
        stuck.set()
