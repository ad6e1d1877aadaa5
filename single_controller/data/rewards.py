"""What a reward function is: its two forms, and the run's list of them from the config.

Batched (TRL's form): fn(prompts=[...], completions=[...], **columns) -> list[float | None], once per
group, `async def` allowed, None meaning "not applicable". Legacy: fn(prompt, response_text) ->
float, once per completion. `resolve_reward_fn` takes a built-in name (`verifiers.BUILTINS`) or
`module:function`; `reward_functions` gives the run's named, weighted functions (empty: `task.reward_fn`
alone); `function_problems` says what is wrong with a list, per function.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from single_controller.config.schema import RewardFunctionConfig
from single_controller.data.tasks import load_callable
from single_controller.data.verifiers import BUILTIN_PACKAGES, BUILTINS

Form = Literal["batched", "legacy"]
BATCHED_SIGNATURE = "fn(prompts, completions, **columns) -> list[float | None]"
LEGACY_SIGNATURE = "fn(prompt, response_text) -> float"


@dataclass(frozen=True)
class RewardFn:
    name: str  # in metrics (`reward/<name>/mean`) and errors
    fn: Callable
    weight: float
    form: Form
    spec: str  # as the config names it


def reward_form(fn: Callable) -> Form:
    """`batched` or `legacy` by `fn`'s signature; TypeError saying why it is neither."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"its signature cannot be read ({e})") from None
    params = list(sig.parameters.values())
    kinds = [p.kind for p in params]
    if inspect.Parameter.VAR_KEYWORD in kinds:
        by_position = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
        if by_position:
            raise TypeError(
                f"its signature {sig} has positional-only parameters {by_position}: a batched reward function "
                f"is called by keyword, {BATCHED_SIGNATURE}"
            )
        return "batched"
    positional = [k for k in kinds if k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    required_kw = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) == 2 and inspect.Parameter.VAR_POSITIONAL not in kinds and not required_kw:
        return "legacy"
    raise TypeError(
        f"its signature {sig} is neither form of a reward function: batched {BATCHED_SIGNATURE} "
        f"(it must take **kwargs) or per completion {LEGACY_SIGNATURE} (exactly two positional parameters)"
    )


def builtin_names() -> str:
    return ", ".join(sorted(BUILTINS))


def resolve_reward_fn(spec: str) -> Callable:
    """A built-in's function, or the callable `module:function` names; KeyError, ImportError,
    TypeError or ValueError saying what is wrong."""
    if spec in BUILTINS:
        module, package = BUILTIN_PACKAGES.get(spec, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ImportError(
                f"the built-in {spec!r} needs the {package!r} package, which is not installed "
                "(pip install 'sc-grpo[verifiers]')"
            )
        return BUILTINS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, sorted(BUILTINS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"{spec!r} is neither a built-in reward ({builtin_names()}) nor 'module:function'{hint}")
    return load_callable(spec)


def default_name(spec: str) -> str:
    """A function's name when the config gives none: the built-in's, or the function's own."""
    return spec if spec in BUILTINS else spec.rpartition(":")[2].rpartition(".")[2]


def _resolved(f: RewardFunctionConfig) -> RewardFn:
    fn = resolve_reward_fn(f.fn)
    return RewardFn(f.name or default_name(f.fn), fn, f.weight, reward_form(fn), f.fn)


def function_problems(functions: Sequence[RewardFunctionConfig]) -> list[str]:
    """What is wrong with each function of `reward.functions` (it does not resolve, is no reward
    function, or shares its name), one message each, naming it."""
    problems = []
    for i, f in enumerate(functions):
        try:
            _resolved(f)
        except (KeyError, ImportError, TypeError, ValueError) as e:
            msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            problems.append(f"reward.functions[{i}] ({f.fn!r}): {msg}")
    names = Counter(f.name or default_name(f.fn) for f in functions)
    for name, n in names.items():
        if n > 1:
            problems.append(f"reward.functions: {n} functions are named {name!r}; give each its own `name`")
    return problems


def reward_functions(functions: Sequence[RewardFunctionConfig], legacy: str | Callable) -> tuple[RewardFn, ...]:
    """The run's reward functions: `functions`, or `legacy` alone (weight 1) when it is empty."""
    if not functions:
        fn = load_callable(legacy) if isinstance(legacy, str) else legacy
        spec = legacy if isinstance(legacy, str) else getattr(legacy, "__qualname__", repr(legacy))
        try:
            form = reward_form(fn)
        except TypeError as e:
            raise TypeError(f"reward function {spec}: {e}") from None
        return (RewardFn(default_name(spec) if isinstance(legacy, str) else spec, fn, 1.0, form, spec),)
    problems = function_problems(functions)
    if problems:
        raise ValueError("; ".join(problems))
    return tuple(_resolved(f) for f in functions)
