"""The TransferQueue (TQ) adapter: rows of a run in TransferQueue 0.1.11, on Ray.

Modules, each importing only those above it: `shims` (every workaround of TQ's and torch's
internals, one switch), `common` (actor names, environment knobs, the import), `host` (TQ's
controller and storage unit in one actor), `runtime` (start / attach / stop), `storage`
(`TQRowStorage`), `factory` (what the controller and the workers call). `sc-grpo storage serve |
list` lives in `single_controller.runtime.storage_service`. Every Ray worker process of a run runs
`shims.install_shims` first (`single_controller.runtime.ray_session`).
"""
