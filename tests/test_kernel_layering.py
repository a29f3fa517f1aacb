"""The package's layering, read from the source (AST, nothing imported): kernels import nothing above them
(only ``mapper.errors`` / ``mapper._validation``), and no module of ``mapper/kernels`` imports a module that
imports it back (a torch reference and its Triton kernel in particular), at module level or inside a
function, except under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
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
