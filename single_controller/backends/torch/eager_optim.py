"""AdamW for the torch trainer without importing `torch._dynamo` (a start-up cost of every trainer
process: docs/performance.md).

`torch.optim` wraps a few `Optimizer` methods in `torch._disable_dynamo`, whose first call imports
Dynamo, and every `step()` calls `torch._dynamo.graph_break()`; both matter only under
`torch.compile`, which this trainer never uses. `eager_adamw` and `eager_step` skip them with the
same results; where torch is not built as this expects, both fall back to torch's own calls.
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
