"""Layering (DESIGN §2: dependencies point down): forbidden import edges and import cycles.

Dynamic check: every module of fxpar (``fxpar/``, ``passes/`` as ``fxpar.passes``, ``cost/``
as ``fxpar.cost``) is imported in a fresh interpreter (one process started for the test, one
``fork`` of it per module, as many at a time as there are cores, so each import starts from the same clean ``sys.modules`` with only
third-party libraries loaded) and the fxpar modules that the import loaded are checked against
the rules below. The top-level ``fxpar/__init__.py`` re-exports the whole public API, so it is
replaced by an empty package in the child: what is measured is the module's own imports.

Static check: no cycle among module-level imports (``ast``; imports inside functions are
allowed, they run after every module has loaded; ``if TYPE_CHECKING:`` blocks are skipped).
Inside the packages of ``NO_CYCLES_EVEN_IN_FUNCTIONS`` imports in function bodies count too: a
function-level import there is no way around a cycle (the schedule IR once imported its own
package's generators and validator that way).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# where each package's files live (setup.py: package_dir)
PACKAGE_DIRS = {"fxpar": ROOT / "fxpar", "fxpar.passes": ROOT / "passes", "fxpar.cost": ROOT / "cost"}


def _modules() -> dict[str, Path]:
    """``{module name: file}`` of every module under the three package dirs (no imports)."""
    out: dict[str, Path] = {}
    for pkg, base in PACKAGE_DIRS.items():
        for dirpath, dirnames, filenames in os.walk(base):  # symlinked dirs are not entered
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))
                           and (Path(dirpath) / d / "__init__.py").exists()
                           and not (Path(dirpath) / d).is_symlink()]
            rel = Path(dirpath).relative_to(base).parts
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                parts = (pkg, *rel) + (() if f == "__init__.py" else (f[:-3],))
                out[".".join(parts)] = Path(dirpath) / f
    return dict(sorted(out.items()))


MODULES = _modules()

#: (modules the rule applies to: a prefix, "x.*" = x and below) -> forbidden prefixes
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("fxpar.cost", ("fxpar.solver", "fxpar.runtime", "fxpar.passes", "fxpar.planner", "ortools")),
    ("fxpar.passes", ("fxpar.planner", "fxpar.solver", "ortools")),
    ("fxpar.runtime", ("fxpar.planner", "fxpar.solver", "ortools")),
    ("fxpar.plan_data", ("fxpar.solver", "fxpar.planner", "ortools")),
    ("fxpar.solver", ("fxpar.planner", "fxpar.strategies", "fxpar.passes", "fxpar.runtime")),
    ("fxpar.strategies", ("fxpar.planner", "fxpar.solver", "ortools")),
    ("fxpar.layers", ("fxpar.planner", "fxpar.solver", "fxpar.passes", "fxpar.runtime")),
    ("fxpar.spec", ("fxpar.strategies", "fxpar.planner", "fxpar.solver", "fxpar.passes",
                    "fxpar.runtime")),
    ("fxpar.units", ("fxpar.",)),
    # pipeline schedules and the simulator: plain data over fxpar.errors and fxpar.cost (no torch
    # at all: tests/test_schedule.py checks their imports statically)
    ("fxpar.schedule", ("fxpar.planner", "fxpar.solver", "fxpar.passes", "fxpar.runtime", "ortools")),
    ("fxpar.sim", ("fxpar.planner", "fxpar.solver", "fxpar.passes", "fxpar.runtime", "ortools")),
    # cross-mesh resharding (issue #11): the planner never runs collectives (the runtime imports
    # it, not the other way round); its cost functions see bytes, device ids and a cluster only
    ("fxpar.resharding", ("fxpar.runtime", "fxpar.planner", "fxpar.solver", "fxpar.passes", "ortools")),
    ("fxpar.cost.reshard_cross", ("fxpar.resharding", "fxpar.mesh", "fxpar.spec")),
]

def _applies(rule: str, mod: str) -> bool:
    return mod == rule or mod.startswith(rule + ".")


_CHILD = r"""
import importlib, json, os, select, sys, types
root, names = sys.argv[1], json.loads(sys.argv[2])
import numpy, networkx, torch  # noqa: F401, E401  third-party, preloaded once (not ortools)
import torch._dynamo, torch.distributed.tensor, torch.export, torch.fx  # noqa: F401, E401
res, pending, running = {}, list(names), {}   # running: read fd -> [module, pid, bytes so far]
while pending or running:
    while pending and len(running) < (os.cpu_count() or 1):   # a fork per core at a time
        name = pending.pop(0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: a clean fxpar namespace, then the one import
            os.close(r)
            stub = types.ModuleType("fxpar")
            stub.__path__ = [os.path.join(root, "fxpar")]
            sys.modules["fxpar"] = stub
            try:
                importlib.import_module(name)
                out = {"loaded": sorted(m for m in sys.modules if m.startswith(("fxpar.", "ortools")))}
            except BaseException as e:  # noqa: BLE001
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        running[r] = [name, pid, b""]
    for r in select.select(list(running), [], [])[0]:
        chunk = os.read(r, 1 << 16)
        if chunk:
            running[r][2] += chunk
            continue
        name, pid, data = running.pop(r)   # end of file: the child has written all and exited
        os.close(r)
        os.waitpid(pid, 0)
        res[name] = json.loads(data)
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    """``{module: {"loaded": [modules loaded by importing it]} or {"error": ...}}``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), json.dumps(list(MODULES))],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_CASES = [(mod, bad) for mod in MODULES for rule, bads in RULES if _applies(rule, mod)
          for bad in bads]


@pytest.mark.slow
@pytest.mark.parametrize("mod,bad", [pytest.param(m, b, id=f"{m}-/->{b}") for m, b in _CASES])
def test_forbidden_edge(loaded, mod, bad):
    got = loaded[mod]
    assert "error" not in got, f"importing {mod} alone failed: {got['error']}"
    if bad == "fxpar.":  # imports nothing of fxpar: only itself
        hits = [m for m in got["loaded"] if m.startswith("fxpar.") and m != mod]
    else:
        hits = [m for m in got["loaded"] if m == bad or m.startswith(bad + ".")]
    assert not hits, f"importing {mod} loads {hits[:8]} (forbidden: {bad})"


@pytest.mark.slow
@pytest.mark.parametrize("mod", list(MODULES))
def test_module_imports_alone(loaded, mod):
    assert "error" not in loaded[mod], f"importing {mod} alone failed: {loaded[mod]['error']}"


@pytest.mark.slow
def test_the_check_sees_a_forbidden_edge():
    """The dynamic check is not vacuous: the planner does load the solver and OR-Tools."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), json.dumps(["fxpar.planner.intra_op"])],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    got = json.loads(p.stdout.strip().splitlines()[-1])["fxpar.planner.intra_op"]["loaded"]
    assert "fxpar.solver.ilp" in got and any(m.startswith("ortools") for m in got)


def _all_imports(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in a file (function bodies too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_cost_reshard_cross_is_pure():
    """``cost/reshard_cross.py`` prices transfers from numbers: no process groups, not even inside
    a function (the dynamic check above only sees fxpar modules and module-level imports)."""
    names = _all_imports(PACKAGE_DIRS["fxpar.cost"] / "reshard_cross.py")
    bad = sorted(n for n in names if n.startswith(("torch.distributed", "fxpar.runtime", "fxpar.planner",
                                                   "fxpar.solver", "fxpar.resharding")))
    assert not bad, f"cost/reshard_cross.py imports {bad}"
    assert "fxpar.cost.comm" in names  # the check reads the file it means to


# ---------------------------------------------------------------------------------------------
# static: no cycle among module-level imports
# ---------------------------------------------------------------------------------------------
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(path: Path, name: str, is_pkg: bool, *, in_functions: bool = False,
                          modules=None) -> set[str]:
    """fxpar modules imported when ``name`` executes (function bodies excluded unless
    ``in_functions``), among ``modules`` (default: every fxpar module)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    package = name if is_pkg else name.rpartition(".")[0]
    modules = MODULES if modules is None else modules

    def visit(stmts):
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and in_functions:
                visit(s.body)
                continue
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(s, ast.If) and _is_type_checking(s.test):
                visit(s.orelse)
                continue
            if isinstance(s, ast.Import):
                out.update(a.name for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                base = s.module or ""
                if s.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (s.level - 1)]
                    base = ".".join(parts + ([s.module] if s.module else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in s.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(s, field, None)
                if isinstance(sub, list) and not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(sub)

    visit(tree.body)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module-level import edges between fxpar modules (the re-exporting top-level ``fxpar``
    package left out, as in the dynamic check)."""
    g = {}
    for name, path in MODULES.items():
        if name == "fxpar":
            continue
        g[name] = _module_level_imports(path, name, path.name == "__init__.py") - {"fxpar"}
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _package_cycle(comp: list[str], g) -> bool:
    """A cycle only between a package ``__init__`` re-exporting its own submodules and those
    submodules (``fxpar.solver`` <-> ``fxpar.solver.reduce``): Python runs the package first,
    so it is no cycle at import time."""
    pkgs = {m for m in comp if MODULES[m].name == "__init__.py"}
    for m in comp:
        for w in g[m] & set(comp):
            inner = any(w == p or m == p for p in pkgs) and (w.startswith(m + ".") or m.startswith(w + "."))
            if not inner:
                return False
    return True


def test_no_import_cycle():
    g = import_graph()
    bad = [c for c in _cycles(g) if not _package_cycle(c, g)]
    assert not bad, f"module-level import cycles: {bad}"


#: packages whose modules import each other without a cycle even counting function bodies (and
#: without the module-level check's allowance for a submodule importing its own package, whose
#: ``__init__`` imports it back)
NO_CYCLES_EVEN_IN_FUNCTIONS = ("fxpar.schedule", "fxpar.sim", "fxpar.split", "fxpar.resharding", "fxpar.cost",
                               "fxpar.runtime", "fxpar.passes", "fxpar.solver", "fxpar.strategies")


def strict_graph(modules: dict[str, Path], prefixes=NO_CYCLES_EVEN_IN_FUNCTIONS) -> dict[str, set[str]]:
    """Import edges, function bodies included, between the modules under ``prefixes``."""
    keep = {m: p for m, p in modules.items() if any(_applies(x, m) for x in prefixes)}
    return {name: _module_level_imports(path, name, path.name == "__init__.py", in_functions=True, modules=keep)
            for name, path in keep.items()}


def test_no_import_cycle_even_in_functions():
    bad = _cycles(strict_graph(MODULES))
    assert not bad, f"import cycles (function-level imports included): {bad}"


def test_strict_check_sees_a_function_level_cycle(tmp_path):
    """A submodule importing its own package inside a function (the package imports it back)
    is a cycle for the strict check, not for the module-level one; a package re-exporting its
    submodules alone is none."""
    pkg = tmp_path / "sched"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from sched.actions import Action\nfrom sched.gen import gen\n")
    (pkg / "actions.py").write_text("class Action:\n    def build(self):\n        from sched import gen\n")
    (pkg / "gen.py").write_text("from sched.actions import Action\ngen = None\n")
    mods = {"sched": pkg / "__init__.py", "sched.actions": pkg / "actions.py", "sched.gen": pkg / "gen.py"}
    loose = {n: _module_level_imports(p, n, p.name == "__init__.py", modules=mods) for n, p in mods.items()}
    assert _cycles(loose) == []
    assert _cycles(strict_graph(mods, ("sched",))) == [["sched", "sched.actions", "sched.gen"]]
    (pkg / "actions.py").write_text("class Action:\n    pass\n")
    assert _cycles(strict_graph(mods, ("sched",))) == []


def test_cycle_check_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]
    assert "fxpar.api" in import_graph() and "fxpar.planner" in import_graph()["fxpar.api"]
