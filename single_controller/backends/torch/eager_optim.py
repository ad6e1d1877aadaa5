"""AdamW for the torch trainer without importing `torch._dynamo` (~1.3 s of CPU in each trainer
process, on the run's start-up path).

`torch.optim` wraps `Optimizer.add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` in
`torch._disable_dynamo`, whose first call imports all of Dynamo to build the disabled twin, and every
`step()` calls `torch._dynamo.graph_break()`. Both only matter under `torch.compile`, which this
trainer never uses. `eager_adamw` gives those wrappers their own function as the "disabled" twin (so
they call it directly), and `eager_step` runs the optimizer's update under `torch.no_grad()` (what
`step()` does when the optimizer is not differentiable) and records that it ran. Where torch is not
built the way this expects (another version), both fall back to torch's own calls: same results,
Dynamo imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
import torch._compile
import torch.optim.optimizer as _optimizer

_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _undynamo(cls: type) -> None:
    for name in _WRAPPED:
        for klass in cls.__mro__:
            fn = vars(klass).get(name)
            if fn is None:
                continue
            inner = getattr(fn, "__wrapped__", None)
            code = getattr(fn, "__code__", None)
            if inner is not None and code is not None and code.co_filename == torch._compile.__file__:
                setattr(inner, "__dynamo_disable", inner)  # torch._compile's cache of the disabled twin
            break


def eager_adamw(params: Iterable[torch.Tensor], **kwargs) -> torch.optim.AdamW:
    _undynamo(torch.optim.AdamW)
    return torch.optim.AdamW(params, **kwargs)


def eager_step(opt: torch.optim.Optimizer) -> None:
    """`opt.step()` without its `torch._dynamo.graph_break()`."""
    raw = inspect.unwrap(type(opt).step)  # through step's profiling wrapper and _use_grad_for_differentiable
    hooks = (
        opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _optimizer._global_optimizer_pre_hooks
        or _optimizer._global_optimizer_post_hooks
    )
    # torch's own step() where it does more than the update: a differentiable optimizer, hooks, a
    # step set on the instance (a wrapper someone installed), or a build of torch not wrapped as expected
    if opt.defaults.get("differentiable") or hooks or "step" in vars(opt) or raw is type(opt).step:
        opt.step()
        return
    with torch.no_grad():
        raw(opt)
    # what step()'s wrapper records (LR schedulers check it); torch does not declare this private attribute
    opt._opt_called = True  # type: ignore[attr-defined]
