"""`sc-grpo storage serve | list`: a TransferQueue that outlives runs, on a Ray cluster.

`serve` connects to `--address` (namespace `sc-grpo-storage`), starts TQ there
(`replay.transferqueue.runtime.start_tq`), prints one `ready` line and serves until SIGINT /
SIGTERM, then closes it: TQ lives exactly as long as this process. Runs use it with
`storage.attach=true`, each in its own partition. `list` attaches and prints every partition and its
key count (`--keys`, `--json`). Exit codes: 0, 1 when it cannot connect, start or attach.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence

NAMESPACE = "sc-grpo-storage"


def _connect(address: str, timeout_s: float) -> None:
    from single_controller.runtime.ray_session import check_ray_address, prepare_environment

    check_ray_address(address, min(timeout_s, 10.0))
    prepare_environment(local=False)
    import logging

    import ray

    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)


def serve(address: str, storage_units: int, timeout_s: float) -> int:
    from replay.transferqueue.runtime import TQRuntimeError, start_tq, stop_tq
    from single_controller.deadlines import DeadlineExceeded

    stop = threading.Event()
    try:
        _connect(address, timeout_s)
    except ConnectionError as e:
        print(f"sc-grpo storage serve: {e}", file=sys.stderr, flush=True)
        return 1
    import ray

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        try:
            # TQ's own layout on a cluster: it places the units across the nodes
            # (`storage.tq_one_process` is for one machine)
            info = start_tq(storage_units, timeout_s=timeout_s, one_process=False)
        except (TQRuntimeError, DeadlineExceeded) as e:
            print(f"sc-grpo storage serve: {e}", file=sys.stderr, flush=True)
            return 1
        print(
            f"sc-grpo storage: ready: TransferQueue ({storage_units} storage unit(s), "
            f"started in {info.startup_s:.1f}s) "
            f"on the Ray cluster at {address}; runs attach with ray.address={address} storage.attach=true; "
            "Ctrl-C stops it",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print("sc-grpo storage: stopping TransferQueue", flush=True)
        return 0
    finally:
        stop_tq()
        ray.shutdown()


def listing(address: str, timeout_s: float) -> dict[str, list[str]]:
    """{partition: sorted keys} of the TQ running on the cluster at `address`."""
    import ray

    from replay.transferqueue.runtime import attach_tq, stop_tq

    _connect(address, timeout_s)
    try:
        attach_tq(timeout_s)
        import transfer_queue as tq

        out = {}
        for partition in sorted(tq.get_client().get_partition_list()):
            out[partition] = sorted(tq.kv_list(partition_id=partition).get(partition, {}))
        return out
    finally:
        stop_tq()  # attached: drops this process's client only
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sc-grpo storage", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("serve", help="start a TransferQueue on a Ray cluster and keep it until Ctrl-C / SIGTERM")
    p.add_argument("--address", required=True, help="Ray cluster address (e.g. HEAD_IP:6379 or auto)")
    p.add_argument("--storage-units", type=int, default=1, help="TQ storage units (each takes one logical Ray CPU)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for TQ to start")
    p = sub.add_parser("list", help="print the partitions of the running TransferQueue and their keys")
    p.add_argument("--address", required=True, help="Ray cluster address")
    p.add_argument("--keys", action="store_true", help="print every key, not only the count")
    p.add_argument("--json", action="store_true", help="print one JSON object {partition: [keys]}")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the TQ controller")
    args = parser.parse_args(argv)
    if args.action == "serve":
        return serve(args.address, args.storage_units, args.timeout)
    t0 = time.perf_counter()
    try:
        parts = listing(args.address, args.timeout)
    except Exception as e:
        print(f"sc-grpo storage list: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    if args.json:
        print(json.dumps(parts, sort_keys=True))
        return 0
    for partition, keys in parts.items():
        print(f"{partition}\t{len(keys)} key(s)" + (": " + " ".join(keys) if args.keys and keys else ""))
    print(f"({len(parts)} partition(s), {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
