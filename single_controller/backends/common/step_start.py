"""What a train step of several updates (`train.updates_per_step` > 1) keeps of its start.

A step with one update changes nothing before its optimizer step, so an abort only drops gradients
and no copy is kept. A step of M updates applies M - 1 optimizer steps before its finish: right
before the first, the rank copies everything an optimizer step changes (`StateCopy`), so an abort
puts it back bit-exactly, and the later updates' ratio is taken against the policy the step started
from (`StepStart.policy_at_start`: the forward's parameters hold their start values meanwhile). The
copy costs the parameters plus the optimizer state once more, only while such a step is open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _clone(v: Any) -> Any:
    return v.detach().clone() if torch.is_tensor(v) else v


def _main(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@dataclass(frozen=True)
class StateCopy:
    """Everything an optimizer step changes: model parameters the optimizers do not hold themselves
    (a 16-bit model beside its float32 mains), each optimizer's parameters (the mains), its
    per-parameter state and its group hyperparameters."""

    params: tuple[torch.Tensor, ...]
    main_params: tuple[tuple[torch.Tensor, ...], ...]  # [optimizer][param]
    states: tuple[dict[int, dict[str, Any]], ...]  # [optimizer] param index -> state
    groups: tuple[tuple[dict[str, Any], ...], ...]  # [optimizer][group] without "params"

    @classmethod
    def take(cls, params: Sequence[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> StateCopy:
        states = []
        for opt in optimizers:
            index = {p: i for i, p in enumerate(_main(opt))}
            states.append({index[p]: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()})
        return cls(
            params=tuple(p.detach().clone() for p in params),
            main_params=tuple(tuple(p.detach().clone() for p in _main(o)) for o in optimizers),
            states=tuple(states),
            groups=tuple(
                tuple({k: _clone(v) for k, v in g.items() if k != "params"} for g in o.param_groups) for o in optimizers
            ),
        )

    @torch.no_grad()
    def restore(self, params: Sequence[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for p, saved in zip(params, self.params, strict=True):
            p.copy_(saved)
        for opt, mains, state, groups in zip(optimizers, self.main_params, self.states, self.groups, strict=True):
            ps = _main(opt)
            for p, saved in zip(ps, mains):
                p.copy_(saved)
            opt.state.clear()
            for i, s in state.items():
                opt.state[ps[i]] = {k: _clone(v) for k, v in s.items()}
            for g, saved_group in zip(opt.param_groups, groups):
                g.update({k: _clone(v) for k, v in saved_group.items()})

    def equals(self, other: StateCopy) -> bool:
        """Bit-identical (for tests)."""

        def same(a: Any, b: Any) -> bool:
            if torch.is_tensor(a) or torch.is_tensor(b):
                return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
            return a == b

        return (
            len(self.params) == len(other.params)
            and all(same(a, b) for a, b in zip(self.params, other.params))
            and all(same(a, b) for x, y in zip(self.main_params, other.main_params) for a, b in zip(x, y))
            and all(
                x.keys() == y.keys()
                and all(x[i].keys() == y[i].keys() and all(same(x[i][k], y[i][k]) for k in x[i]) for i in x)
                for x, y in zip(self.states, other.states)
            )
            and all(
                g.keys() == h.keys() and all(same(g[k], h[k]) for k in g)
                for x, y in zip(self.groups, other.groups)
                for g, h in zip(x, y)
            )
        )


class StepStart:
    """A rank's state at the start of a step of several updates (see the module docstring).
    `forward_params`: the tensors the policy's forward reads (each among `model_params` or an
    optimizer's parameters); `model_params`: those the optimizers do not hold; `settle`: called after
    the parameters change under the forward's feet (e.g. FSDP drops the whole parameters it kept)."""

    def __init__(
        self,
        forward_params: Sequence[torch.Tensor],
        model_params: Sequence[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        settle: Callable[[], None] = lambda: None,
    ):
        self.model_params, self.optimizers, self.settle = list(model_params), list(optimizers), settle
        self.copy = StateCopy.take(self.model_params, self.optimizers)
        saved = dict(zip(map(id, self.model_params), self.copy.params))
        for opt, mains in zip(self.optimizers, self.copy.main_params):
            saved.update(zip(map(id, _main(opt)), mains))
        self._pairs = [(p, saved[id(p)]) for p in forward_params]

    @contextlib.contextmanager
    def policy_at_start(self) -> Iterator[None]:
        """Inside, the forward's parameters hold their values at the step's start; after, their own
        again, bit-exactly (swapped in place with the copy: one parameter's worth of scratch)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for p, saved in self._pairs:
            scratch = p.detach().clone()
            p.copy_(saved)
            saved.copy_(scratch)
        self.settle()

    def restore(self) -> None:
        """Parameters and optimizer state as they were at the step's start."""
        self.copy.restore(self.model_params, self.optimizers)
        self.settle()
