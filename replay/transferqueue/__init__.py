"""The TransferQueue (TQ) adapter: rows of a run in TransferQueue 0.1.11, on Ray.

Modules, each importing only those above it (no cycle):

  shims     every workaround of TQ's and torch's internals, and the only module that touches TQ's private
            names; `install_shims()` switches on the start-up shims (no Dynamo, no GC during imports).
  common    TQ's actor names, its environment knobs (`configure_env`), `import_transfer_queue()`.
  host      the one-process host: TQ's controller and storage unit in one Ray actor
            (`storage.tq_one_process`).
  runtime   starts TQ (`start_tq`: the host, or `tq.init`), attaches to a running one (`attach_tq`),
            stops it (`stop_tq`).
  storage   `TQRowStorage`, the `replay.storage.RowStorage` the controller and the workers read and
            write rows through (imports torch and TQ).
  factory   what the controller calls: `open_tq_storage` (start or attach, then the storage) and
            `attach_tq_storage` (the workers' storage factory).
  service   `sc-grpo storage serve | list`: a TQ that outlives runs, on a Ray cluster.

Every Ray worker process of a run runs `shims.install_shims` first (`single_controller.runtime.ray_session`).
"""
