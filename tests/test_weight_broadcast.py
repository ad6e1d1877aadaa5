"""The collective transport's two ends in one process (threads, a gloo group; no Ray): what is sent
is what the trainer staged, bit for bit; a sender packs a new version into the buckets of the one it
drops, never into one a send is reading."""

import threading

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
