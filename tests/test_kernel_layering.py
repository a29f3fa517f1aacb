"""The package's layering, read from the source (AST, nothing imported): kernels import nothing above them
(only ``mapper.errors`` / ``mapper._validation``), and no module of ``mapper/kernels`` imports a module that
imports it back (a torch reference and its Triton kernel in particular), at module level or inside a
function, except under ``TYPE_CHECKING``. Then the whole package: every module sits on a floor of
``docs/architecture.md`` and imports nothing above it, and no modules import each other around a loop."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "mapper" / "kernels"
ALLOWED_ABOVE = {"errors", "_validation"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(sibling kernel modules, modules above kernels) that ``path`` imports (TYPE_CHECKING blocks
    excluded)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    siblings, above = set(), set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        if node.level == 1:
            if node.module:
                siblings.add(node.module.split(".")[0])
            else:
                siblings |= {a.name for a in node.names}
        else:
            above.add((node.module or "").split(".")[0])
    return siblings, above


def test_kernels_import_nothing_above_them():
    bad = {}
    for path in sorted(KERNELS.glob("*.py")):
        _, above = _imports(path)
        if above - ALLOWED_ABOVE:
            bad[path.name] = sorted(above - ALLOWED_ABOVE)
    assert not bad, bad


def test_no_import_cycles_between_kernel_modules():
    graph = {p.stem: _imports(p)[0] for p in KERNELS.glob("*.py")}
    cycles = sorted((a, b) for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ()))
    assert not cycles, cycles


def test_the_checker_sees_function_level_imports(tmp_path):
    """The checker itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    p = tmp_path / "m.py"
    p.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"
        "def f():\n    from .b import y\n    from ..layers import z\n"
    )
    assert _imports(p) == ({"b"}, {"layers"})


# ------------------------------------------------------------------------------------ the whole package
# The floors of docs/architecture.md (api -> map -> integrators -> layers -> grid -> kernels, above a base of
# errors/validation/settings): a module imports only from its own floor or the ones below, at module level or
# inside a function (TYPE_CHECKING blocks excepted), and no two modules import each other, directly or around
# a loop. The floors are read from the document, so the picture and the test cannot drift apart.
PACKAGE = KERNELS.parent
DOC = PACKAGE.parent / "docs" / "architecture.md"

# Known violations, each with why it stands; the test fails on any violation not listed here, and on an entry
# here that no longer occurs (so the list only shrinks).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
ALLOWED_CYCLES: dict[frozenset[str], str] = {
    # the warm-up builds a throwaway Map to run the frame path once, and Map() runs the warm-up: map.py
    # imports warmup at module level, warmup imports Map inside warm_up(); breaking it means passing the map
    # factory in
    frozenset({"map", "warmup"}): "Map() calls warm_up(), which builds a Map",
    # the cluster's ingress app and its sharded reads call each other: ingress imports shards at module
    # level, shards imports ingress's Route/WorkerLost inside 3 functions (issue #28: the cluster becomes a
    # MapBackend behind the one set of routes, which removes the loop)
    frozenset({"cluster.ingress", "cluster.shards"}): "the cluster's second HTTP API (issue #28)",
}


def floors(doc: Path = DOC) -> list[tuple[str, list[str]]]:
    """``[(floor, [module patterns])]`` from the fenced block after the ``<!-- floors`` comment, top first."""
    text = doc.read_text()
    start = text.index("<!-- floors")
    block = text[text.index("```", start) :].split("\n")[1:]
    out = []
    for line in block:
        if line.startswith("```"):
            break
        name, *mods = line.split()
        out.append((name, mods))
    return out


def module_names() -> dict[str, Path]:
    """Every module of the package, dotted below ``mapper`` (``"__init__"`` for the package itself)."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE).with_suffix("").parts
        if rel[-1] == "__init__" and len(rel) > 1:
            rel = rel[:-1]
        out[".".join(rel)] = p
    return out


def floor_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """Height of ``module``'s floor (0 = the bottom), by the longest matching pattern; None if unlisted."""
    best, height = -1, None
    for i, (_, pats) in enumerate(table):
        for pat in pats:
            hit = module.startswith(pat.rstrip("/").replace("/", ".") + ".") or module == pat.rstrip("/")
            if hit and len(pat) > best:
                best, height = len(pat), len(table) - 1 - i
    return height


def package_imports(path: Path, module: str, mods: set[str]) -> set[str]:
    """The package's modules that ``path`` (module ``module``) imports, relative or absolute, at module
    level or in a function (TYPE_CHECKING blocks excluded); ``from . import x`` names module ``x``."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    here = [] if module == "__init__" else module.split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                targets = [("mapper." + ".".join(base) if base else "mapper", [a.name for a in node.names])]
            else:
                targets = [(node.module or "", [a.name for a in node.names])]
        else:
            continue
        for target, names in targets:
            if target != "mapper" and not target.startswith("mapper."):
                continue
            rel = target[len("mapper.") :] if target != "mapper" else ""
            subs = [f"{rel}.{n}" if rel else n for n in names]
            hits = [s for s in subs if s in mods]
            out |= set(hits) if hits else {rel or "__init__"}
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = module_names()
    return {m: package_imports(p, m, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_floor():
    table = floors()
    assert [n for n, _ in table] == ["api", "map", "integrators", "layers", "grid", "kernels", "base"]
    missing = sorted(m for m in module_names() if floor_of(m, table) is None)
    assert not missing, f"give these modules a floor in docs/architecture.md: {missing}"


def test_no_upward_imports():
    table = floors()
    bad = {}
    name = {len(table) - 1 - i: n for i, (n, _) in enumerate(table)}
    for m, deps in import_graph().items():
        for d in deps:
            if floor_of(d, table) is not None and floor_of(d, table) > floor_of(m, table):
                bad[(m, d)] = f"{name[floor_of(m, table)]} imports {name[floor_of(d, table)]}"
    new = {k: v for k, v in bad.items() if k not in ALLOWED_UPWARD}
    assert not new, new
    gone = set(ALLOWED_UPWARD) - set(bad)
    assert not gone, f"fixed, drop from ALLOWED_UPWARD: {gone}"


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_the_package():
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert not new, new
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not gone, f"fixed, drop from ALLOWED_CYCLES: {gone}"


def test_the_package_checker_on_a_toy_package(tmp_path, monkeypatch):
    """The checker itself, on a package with one upward import inside a function, a cycle, a TYPE_CHECKING
    import (ignored), ``from . import x`` and an absolute import."""
    pkg = tmp_path / "mapper"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .map import Map\n")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "k.py").write_text("def f():\n    from ..map import Map\n")
    (pkg / "map.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import errors\nfrom mapper.kernels import k\n"
        "if TYPE_CHECKING:\n    from .api import app\n"
    )
    (pkg / "errors.py").write_text("import mapper.map\n")
    doc = tmp_path / "arch.md"
    doc.write_text("<!-- floors -->\n```text\napi __init__\nmap map\nkernels kernels/\nbase errors\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    table = floors(doc)
    assert [n for n, _ in table] == ["api", "map", "kernels", "base"]
    g = import_graph()
    assert g == {
        "__init__": {"map"},
        "errors": {"map"},
        "kernels": set(),
        "kernels.k": {"map"},
        "map": {"errors", "kernels.k"},
    }
    assert floor_of("kernels.k", table) == 1 and floor_of("map", table) == 2 and floor_of("x", table) is None
    assert sorted(map(sorted, cycles(g))) == [["errors", "kernels.k", "map"]]


def test_the_map_imports_no_triton():
    """A CPU install has no Triton: importing the package, the map, the grid and the service must not load it
    (the ``kernels/triton_*`` modules are imported only when a call chooses them). A fresh interpreter, since
    this one may have loaded Triton already; the check fails the same way if a ``triton_*`` module is pulled
    in at module level."""
    code = (
        "import sys, mapper, mapper.map, mapper.grid, mapper.api.app, mapper.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'triton'\n"
        "             or m.startswith('mapper.') and '.triton_' in m)\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_torch_only_modules_import_without_the_service_stack():
    """The GPU machines run the library's tests on torch alone (no fastapi, pydantic, uvicorn, httpx,
    websockets): the map, the CLI and the sharding logic import without them; those imports stay inside the
    functions that serve (a fresh interpreter with the packages made unimportable)."""
    code = (
        "import sys\n"
        "for m in ('fastapi', 'pydantic', 'pydantic_settings', 'uvicorn', 'httpx', 'websockets', 'triton'):\n"
        "    sys.modules[m] = None\n"
        "import mapper, mapper.map, mapper.cli, mapper.cluster.shards, mapper.cluster.worker\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
