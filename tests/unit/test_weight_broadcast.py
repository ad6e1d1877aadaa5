"""The collective transport's two ends in one process (threads, a gloo group; no Ray): what is sent
is what the trainer staged, bit for bit; a sender packs a new version into the buckets of the one it
drops, never into one a send is reading."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from single_controller.backends.common.weight_broadcast import (
    STAGED_VERSIONS,
    GroupAddress,
    StagedWeights,
    SyncLink,
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


class _Group:
    """A weight-sync group that keeps a copy of what it broadcasts."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensors, opts):
        self.sent.append(tensors[0].clone())
        return self

    def wait(self):
        return None


def _staged_sender() -> tuple[WeightSender, list[list[torch.Tensor]]]:
    """A sender with versions 0.. staged, and a copy of each one's buckets (staged buckets are the
    snapshot's own memory)."""
    sender, copies = WeightSender(), []
    for v in range(STAGED_VERSIONS):
        snap = pack_weights(_model(v), v, bucket_bytes=4096, dtype=torch.bfloat16)
        copies.append([bucket_tensor(b, "int16").clone() for b in snap.buckets])
        sender.stage_weights(snap, sender=None)
    return sender, copies


def _export(sender: WeightSender) -> None:
    """What the rank's export does on its main thread: make room, pack the next version into the
    spare buckets, stage it."""
    spare = sender.make_room()
    snap = pack_weights(_model(9), 9, bucket_bytes=4096, dtype=torch.bfloat16, into=spare)
    sender.stage_weights(snap, sender=None)


def _same(got, want: list[torch.Tensor]) -> bool:
    """`got` (bfloat16 tensors, or numpy int16 bits) holds the very bits of `want` (int16 bits)."""
    bits = [bucket_tensor(g, "int16") for g in got]
    return len(got) == len(want) and all(torch.equal(g.view(torch.int16), w) for g, w in zip(bits, want))


@pytest.mark.timeout(30)
def test_an_export_right_after_a_send_found_its_buckets_never_packs_into_them():
    """#48 S1: the export that drops v0 (on the rank's main thread) lands right after a send of v0 has
    found v0's buckets, before it takes the sender's lock again; the send goes on reading those
    buckets, so they are not recycled: v0 goes out bit for bit (before, they were the spare the export
    packed v9 into, sent as v0)."""
    sender, snaps = _staged_sender()
    group = _Group()
    sender._sync_groups["t"] = (GroupAddress("t", "127.0.0.1", 0, 2, "gloo", 30.0), group)

    class ExportAfterLookup:
        """The sender's lock; before it is taken the second time (the send has found its buckets),
        the export runs, outside it."""

        def __init__(self, lock):
            self.lock, self.taken = lock, 0

        def __enter__(self):
            self.taken += 1
            if self.taken == 2:
                _export(sender)
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    sender._sync_lock = ExportAfterLookup(sender._sync_lock)
    sender.send_weights("t", 0)
    assert sender._sync_lock.taken > 2  # the export ran (and took the lock itself)
    assert _same(group.sent, snaps[0])
    assert sorted(sender._staged) == [1, 2, 9] and sender._sending == {}


@pytest.mark.timeout(30)
def test_an_export_while_the_object_store_copy_runs_never_packs_into_the_buckets_it_copies(monkeypatch):
    """#48 S1, the fallback: `put_weights` copies staged v0 into the object store while the export that
    drops v0 lands; the copies are v0's bytes (before, v0's buckets were recycled under the copy)."""
    import numpy as np
    import ray

    sender, snaps = _staged_sender()
    exported = []

    def put(array):
        if not exported:
            exported.append(_export(sender))
        return np.array(array, copy=True)

    monkeypatch.setattr(ray, "put", put)
    copied = sender.put_weights(0)
    assert exported and _same(copied.buckets, snaps[0])
    assert sorted(sender._staged) == [1, 2, 9] and sender._sending == {}


# -- the controller's side: whose failure a failed broadcast is ----------------------------------


class _Method:
    """A Ray actor method: `.remote(...)` gives an awaitable answer; `.options(...)` changes nothing."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls += 1
        return self.answer(*args)


def _answer(value=None, error=None):
    async def answer(*_):
        if error is not None:
            raise error
        return value

    return answer


def _remote_error(error: BaseException):
    import ray

    return ray.exceptions.RayTaskError("receive_weights", f"Traceback\n{error!r}", error).as_instanceof_cause()


class _Actor:
    def __init__(self, **methods):
        for name, answer in methods.items():
            setattr(self, name, _Method(answer))


def _client_and_weights(sender_alive: bool):
    import ray

    from single_controller.backends.common.actor_client import ActorGenerationClient
    from single_controller.backends.common.weight_broadcast import SyncGroupError
    from single_controller.types import WeightsHandle

    dead = ray.exceptions.ActorDiedError()
    worker = _Actor(
        sync_ranks=_answer(1),
        join_sync_group=_answer(),
        receive_weights=_answer(error=_remote_error(SyncGroupError("connection closed by peer"))),
    )
    formed = []

    async def sync_address():  # answers while the group forms; afterwards only if the rank still lives
        if formed and not sender_alive:
            raise dead
        formed.append(True)
        return "127.0.0.1", 1234

    async def send_weights(key, version):
        await asyncio.Event().wait()  # Ray has not reported the sender's death yet: this call hangs

    sender = _Actor(sync_address=sync_address, open_sync_group=_answer(), send_weights=send_weights)
    client = ActorGenerationClient("gen0", worker, sync=SyncLink("gloo", 5.0))
    snap = pack_weights(_model(0), 3, bucket_bytes=4096)
    return client, WeightsHandle(3, StagedWeights(snap.manifest, sender), snap.manifest.num_bytes)


@pytest.mark.timeout(30)
async def test_a_trainer_rank_dying_mid_broadcast_is_the_trainers_failure_not_the_workers():
    """#48 S3: the sending rank dies mid-transfer; the worker's receive fails first (its connection
    broke) while the send hangs (Ray has not reported the death). The sync fails with
    `TrainerRankDied` (resumable), not the `GenerationFailed` that took every worker out of routing
    and restarted it (each restart then failed on the dead sender: `NoGenerationWorkers`). With the
    sender alive, the same failure is still the worker's."""
    from single_controller.protocols import GenerationFailed, TrainerRankDied

    client, weights = _client_and_weights(sender_alive=False)
    with pytest.raises(TrainerRankDied, match=r"sending weights died during .*v3.* to generation worker gen0"):
        await client.update_weights(weights)
    assert client._group is None  # the group is gone with it

    client, weights = _client_and_weights(sender_alive=True)
    with pytest.raises(GenerationFailed, match=r"gen0: weights v3 over weight-sync group .* the sender is alive"):
        await client.update_weights(weights)


class _FnMethod:
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
        sync_address=_FnMethod(sync_address),
        open_sync_group=_FnMethod(nothing),
        send_weights=_FnMethod(send),
        close_sync_group=_FnMethod(closed.append),
    )
    actor = SimpleNamespace(
        sync_ranks=_FnMethod(one_rank), join_sync_group=_FnMethod(nothing), receive_weights=_FnMethod(receive)
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
