"""STYLE #3: nothing blocks the controller's event loop. No `ray.get`, `time.sleep` or sleep-polling
loops inside `async def` bodies anywhere in our packages (checked on the syntax tree)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("single_controller", "pumps", "samplers", "replay")


def _async_bodies():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.AsyncFunctionDef):
                    yield path.relative_to(ROOT), node


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def test_no_blocking_calls_in_async_code():
    bad = []
    for path, fn in _async_bodies():
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and _dotted(node.func) in {"ray.get", "time.sleep", "ray.wait"}:
                bad.append(f"{path}:{node.lineno} {fn.name}: {_dotted(node.func)}")
    assert not bad, "blocking calls inside async code:\n" + "\n".join(bad)


def _is_yield(call: ast.Call) -> bool:
    """`asyncio.sleep(0)`: a turn of the loop for whatever is ready, not a wait for time to pass."""
    return (
        len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0
    )


def _is_backoff(call: ast.Call) -> bool:
    """`asyncio.sleep(<...backoff...>(attempt))`: a retry's pause after a failure, which waits for time
    to pass by design (a storage that failed gets a moment), not for a state change."""
    arg = call.args[0] if len(call.args) == 1 and not call.keywords else None
    return isinstance(arg, ast.Call) and "backoff" in _dotted(arg.func)


def _sleep_polls(fn: ast.AsyncFunctionDef) -> list[int]:
    lines = []
    for loop in (n for n in ast.walk(fn) if isinstance(n, (ast.While, ast.For))):
        for node in ast.walk(loop):
            if (
                isinstance(node, ast.Await)
                and isinstance(node.value, ast.Call)
                and _dotted(node.value.func) == "asyncio.sleep"
            ):
                if not _is_yield(node.value) and not _is_backoff(node.value):
                    lines.append(node.lineno)
    return lines


def test_no_sleep_polling_loops_in_async_code():
    """A `while` loop in async code that awaits asyncio.sleep is a poll: waits must be event-driven.
    (`asyncio.sleep(0)`, a yield to the loop, waits for nothing; a retry's backoff pause is no poll.)"""
    bad = [f"{path}:{line} {fn.name}" for path, fn in _async_bodies() for line in _sleep_polls(fn)]
    assert not bad, "sleep-polling loops in async code:\n" + "\n".join(bad)


def test_the_poll_check_tells_a_poll_from_a_yield():
    polls = (
        "async def f():\n    while True:\n        await asyncio.sleep(0.1)\n        await asyncio.sleep(x)\n"
        "        await asyncio.sleep(0)\n        await asyncio.sleep(clear_backoff_s(attempt))\n"
    )
    assert _sleep_polls(ast.parse(polls).body[0]) == [3, 4]


def test_the_checker_sees_a_violation():
    src = "async def f():\n    while True:\n        await asyncio.sleep(0.1)\n        ray.get(x)\n"
    fn = ast.parse(src).body[0]
    calls = {_dotted(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    assert {"asyncio.sleep", "ray.get"} <= calls


CONTROL_PLANE = (
    "pumps",
    "samplers",
    "single_controller/controller.py",
    "single_controller/state.py",
    "single_controller/runtime/actor_host.py",
)


def test_control_plane_never_reads_rows():
    """The controller moves keys and small columns; reading rows is the trainers' job (1 hop)."""
    bad = []
    for entry in CONTROL_PLANE:
        root = ROOT / entry
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("get_rows")
                ):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "row reads in the control plane:\n" + "\n".join(bad)


# Tests run coroutines as `async def test_...` (pytest-asyncio, asyncio_mode = "auto"), not through
# hand-rolled `asyncio.run` wrappers. (A blocking `ray.get` between awaits in such a test is fine:
# nothing else runs on the test's own loop.)
ASYNCIO_RUN_ALLOWED: set[str] = set()


def test_tests_use_pytest_asyncio_not_asyncio_run():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name in ASYNCIO_RUN_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and _dotted(node.func) == "asyncio.run":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "asyncio.run in tests (write `async def test_...` instead):\n" + "\n".join(bad)
