"""The house rules of the package layout, checked on the source (docs/architecture.md).

- Each folder one floor: a folder imports only folders on floors below its own (every import counts,
  lazy ones too), so no arrow between folders runs back up; a new folder must be given its floor here.
- No private name (`_x`) is imported from another folder.
- No import cycle between modules (imports at module level; `if TYPE_CHECKING:` ones excluded).
- No backend imports another: `backends/<engine>/` may import `backends/common/`, never a sibling.
- The pure algorithm (`single_controller/algorithm/`) imports no asyncio, Ray or other layer.
- No function longer than 60 lines, except declarative tables listed here by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("single_controller", "pumps", "samplers", "replay")
ENGINES = ("torch", "vllm", "megatron", "sim")
MAX_FUNCTION_LINES = 60
# Functions allowed past the limit: declarative tables (a literal mapping, a list of checks).
LONG_ALLOWED: set[str] = set()


# The floors, ground first. A "folder" is a package under `single_controller/` (or one of its
# top-level modules) or one of the other three top-level packages. A folder may import any folder on
# a lower floor, none on its own floor or above.
FLOORS: tuple[tuple[str, ...], ...] = (
    # words every layer shares: plain records, errors, deadlines, channels, the config schema
    ("single_controller", "types", "errors", "deadlines", "channels", "config", "startup_trace"),
    # contracts and pure parts: worker protocols, the GRPO math, prompts and rewards, environments,
    # the replay buffer's ledgers and storage, checkpoints
    ("protocols", "algorithm", "data", "envs", "replay", "checkpoint"),
    # the engines behind the protocols; the staleness sampler over the ledger; the step in one screen
    ("backends", "samplers", "step"),
    # the checks a config passes before start (they ask the engines); the controller's run state
    ("preflight", "state"),
    # the pumps over the run state; elastic workers
    ("pumps", "elastic"),
    ("device_turns",),  # colocated turns, over the elastic workers
    ("controller",),
    # runs sharing a pool of workers, a controller each
    ("pool",),
    # processes and commands: Ray, the driver, the CLI
    ("runtime",),
    ("bench", "__main__"),
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _resolve(name: str) -> str | None:
    """The project module an import names (a name imported from a package may be a submodule)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return {m for m in (_resolve(n) for n in found) if m is not None}


def _folder(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "single_controller":
        return parts[0]
    return parts[1] if len(parts) > 1 else parts[0]


def _all_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import of a project module, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PACKAGES:
                out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def test_every_folder_has_a_floor_and_imports_only_folders_below_it():
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    unplaced = sorted({_folder(m) for m in MODULES} - floor.keys())
    assert not unplaced, f"folders without a floor in FLOORS: {unplaced}"
    upward = []
    for m, path in MODULES.items():
        for line, module, names in _all_imports(path):
            targets = {_resolve(f"{module}.{n}") or _resolve(module) for n in names} or {_resolve(module)}
            for target in targets - {None}:
                mine, theirs = _folder(m), _folder(target)
                if mine != theirs and floor[theirs] >= floor[mine]:
                    upward.append(f"{path.relative_to(ROOT)}:{line}: {mine} (floor {floor[mine]}) imports {target}")
    assert not upward, "imports that do not run down a floor:\n" + "\n".join(sorted(set(upward)))


def test_no_private_name_is_imported_from_another_folder():
    bad = []
    for m, path in MODULES.items():
        for line, module, names in _all_imports(path):
            for n in names:
                if n.startswith("_") and _folder(module) != _folder(m):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {module}.{n}")
    assert not bad, "private names imported across folders:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    graph = {m: _imports(p, top_level_only=False) - {m} for m, p in MODULES.items()}
    # a package's __init__ importing nothing, the cycle search runs over modules alone
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _engine_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["single_controller", "backends"] and len(parts) > 2:
        return parts[2] if parts[2] in ENGINES else None
    return None


def test_no_backend_imports_another():
    bad = []
    for m, path in MODULES.items():
        mine = _engine_of(m)
        if mine is None:
            continue
        for n in _imports(path, top_level_only=False):
            theirs = _engine_of(n)
            if theirs is not None and theirs != mine:
                bad.append(f"{m} imports {n}")
    assert not bad, "\n".join(bad)


def test_the_algorithm_is_pure():
    forbidden = ("asyncio", "ray", "transfer_queue")
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("single_controller.algorithm"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                root = n.split(".")[0]
                if root in forbidden or (
                    root in PACKAGES and not n.startswith(("single_controller.algorithm", "single_controller.types"))
                ):
                    bad.append(f"{m} imports {n}")
    assert not bad, "\n".join(bad)


def _long_functions() -> list[str]:
    out = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                name = f"{m}.{node.name}"
                if n > MAX_FUNCTION_LINES and name not in LONG_ALLOWED:
                    out.append(f"{name}: {n} lines ({path.relative_to(ROOT)}:{node.lineno})")
    return out


def test_no_function_is_longer_than_60_lines():
    long = _long_functions()
    assert not long, "\n".join(long)


@pytest.mark.parametrize("name", sorted(LONG_ALLOWED))
def test_each_allowed_long_function_still_exists(name):
    functions = {
        f"{m}.{node.name}"
        for m, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    assert name in functions, f"{name} is allowed past {MAX_FUNCTION_LINES} lines but no longer exists"
