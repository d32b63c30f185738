"""The package's layout shows its design: each part imports only the layers below it,
no module imports in a circle, and no module reaches into another's private names.

The order of the layers (bottom first) is ``LAYERS``; ``docs/design/layout.md`` says what
each one is for. Imports inside functions count as imports (a circle dodged by a
function-level import is still a circle); imports under ``if TYPE_CHECKING:`` do not
(they never run)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hostreduce"

# Bottom first. A unit may import units of lower layers only; units in one layer are
# siblings and do not import each other.
LAYERS: list[set[str]] = [
    {"errors", "_files", "version"},
    {"config", "timeline", "progress"},
    {"cluster", "transport"},
    {"processes"},
    {"reducers", "elastic"},
    {"ps"},
    {"streaming"},
    {"host"},
    {"ps_training", "tf_strategy"},
    {"strategies"},
    {"estimator", "ops"},
    {"horovod", "tf_adapter"},
    {"distribute", "hccl"},
    {"launch", "testing"},
    {"__init__", "__main__"},
]
# What may not import TensorFlow at module level (the engines and the ps service run,
# and are tested, without it).
NO_TENSORFLOW = {"errors", "_files", "config", "timeline", "progress", "cluster", "transport", "processes", "reducers", "elastic", "ps",
                 "streaming", "launch", "testing"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _level(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"{unit!r} is in no layer of LAYERS: place it in the order")


class _Import:
    def __init__(self, target: str, name: str | None, line: int, top: bool) -> None:
        self.target, self.name, self.line, self.top = target, name, line, top


def _imports(module: str) -> list[_Import]:
    """Every hostreduce import of ``module``, resolved to the module it loads."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[_Import] = []

    def resolve(base: str, name: str | None) -> tuple[str, str | None]:
        if name is not None and f"{base}.{name}" in MODULES:
            return f"{base}.{name}", None
        return base, name

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                for sub in child.orelse:
                    visit(sub, top)
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base == "hostreduce" or base.startswith("hostreduce."):
                    for alias in child.names:
                        target, name = resolve(base, alias.name)
                        found.append(_Import(target, name, child.lineno, top))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "hostreduce" or alias.name.startswith("hostreduce."):
                        found.append(_Import(alias.name, None, child.lineno, top))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            else:
                visit(child, top)

    visit(ast.parse(path.read_text(encoding="utf-8")), True)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_unit_has_a_layer():
    for module in MODULES:
        _level(_unit(module))


def test_imports_only_run_down():
    upward = []
    for module, imports in GRAPH.items():
        mine = _unit(module)
        for imp in imports:
            theirs = _unit(imp.target)
            if theirs != mine and _level(theirs) >= _level(mine):
                upward.append(f"{MODULES[module].relative_to(ROOT)}:{imp.line}: {module} -> {imp.target} "
                              f"({mine!r} may not import {theirs!r})")
    assert not upward, "imports that do not run down the layers:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = {module: sorted({imp.target for imp in imports if imp.target != module and imp.target in MODULES})
             for module, imports in GRAPH.items()}
    state: dict[str, str] = {}
    loops: list[str] = []

    def visit(module: str, trail: list[str]) -> None:
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            loops.append(" -> ".join(trail[trail.index(module):] + [module]))
            return
        state[module] = "open"
        for dep in graph[module]:
            # A package's __init__ importing its own modules is how it exports names;
            # a module importing its package's __init__ back would close a loop, and does.
            visit(dep, trail + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
    assert not loops, "import circles:\n" + "\n".join(loops)


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def test_no_reach_into_private_names():
    reaches = []
    for module, imports in GRAPH.items():
        for imp in imports:
            where = f"{MODULES[module].relative_to(ROOT)}:{imp.line}: {module}"
            if imp.name is not None and _private(imp.name):
                reaches.append(f"{where} imports {imp.name} from {imp.target}")
            # A private module belongs to its package: only modules inside that package
            # (or below it) import it.
            parts = imp.target.split(".")
            for i, part in enumerate(parts):
                owner = ".".join(parts[:i])
                if _private(part) and not (module == owner or module.startswith(owner + ".")):
                    reaches.append(f"{where} imports the private module {imp.target}")
                    break
    assert not reaches, "imports of another module's private names:\n" + "\n".join(reaches)


def test_exceptions_live_in_errors():
    """``errors.py`` is the only home of exception classes, all under HostReduceError."""
    import hostreduce.errors as errors

    elsewhere = []
    for module, path in MODULES.items():
        if module == "hostreduce.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Interrupt")) for b in bases):
                    elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}")
    assert not elsewhere, "exception classes outside errors.py:\n" + "\n".join(elsewhere)
    for name in dir(errors):
        value = getattr(errors, name)
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__:
            assert issubclass(value, errors.HostReduceError), name


@pytest.mark.timeout(300)
def test_lower_layers_import_without_tensorflow():
    """Every module of the engine and service layers imports alone, and none of them
    loads TensorFlow (so the ring and the ps run, and are tested, without it)."""
    names = sorted(m for m in MODULES if _unit(m) in NO_TENSORFLOW and not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            "bad = []\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    if 'tensorflow' in sys.modules: bad.append(name); break\n"
            "print(bad)\n")
    # One interpreter per unit: a module that loads TensorFlow is named, and each
    # unit's modules import in an order that does not hide a missing import.
    units = sorted({_unit(m) for m in names})
    for unit in units:
        group = [m for m in names if _unit(m) == unit]
        res = subprocess.run([sys.executable, "-c", code, *group], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, (unit, res.stderr[-2000:])
        assert res.stdout.strip() == "[]", f"{unit}: imports TensorFlow at module level: {res.stdout.strip()}"


def test_every_public_unit_is_an_attribute_of_the_package():
    """``import hostreduce`` then ``hostreduce.X`` reaches every public unit (imported on
    first access), so a script ported by renaming its import (``import hostreduce as npu``)
    finds ``npu.distribute``, ``npu.hccl``, ... without importing them by name."""
    import hostreduce

    public = {_unit(m) for m in MODULES} - {"__init__", "__main__"}
    public = {u for u in public if not _private(u)}
    assert public <= set(dir(hostreduce)), sorted(public - set(dir(hostreduce)))
