"""The structure measures of issue #28's "Targets" table, read from the source (AST, nothing imported).

    python benchmarks/tools/structure_metrics.py [--root DIR] [--label NAME] [--out FILE.md]

``--root``: a checkout (its ``mapper/`` is measured; default: this repository). Measures:

* largest file of ``mapper/`` (lines) and largest function or method (lines, decorators included), and how
  many files exceed 600 lines and functions 80 (the targets);
* imports inside function bodies in ``mapper/`` (``TYPE_CHECKING`` blocks excluded), and of them those of
  optional dependencies (the extras of ``pyproject.toml``: triton, ray, boto3, foxglove, open3d ...), which
  are deliberately lazy and do not count against the target; an import of one of the package's Triton
  kernel modules (``kernels/triton_*.py``, which import ``triton`` at module level) counts as one of them;
* raw ``use_triton`` references outside ``mapper/kernels/`` (the import lines excluded) and device-type tests
  outside ``mapper/kernels/`` (``.type == "cuda"``-style comparisons and ``.is_cuda``);
* private ``Map`` fields (``self._x`` assigned in ``map.py``) read outside ``map*.py``;
* modules directly under ``mapper/`` (``__init__.py`` and ``__main__.py`` excluded).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# lazily imported on purpose: optional extras (pyproject.toml) or heavy/optional at run time
OPTIONAL = {
    "triton",
    "ray",
    "boto3",
    "botocore",
    "foxglove",
    "foxglove_sdk",
    "mcap",
    "open3d",
    "playwright",
    "scipy",
    "spconv",
}
DEVICE_TEST = re.compile(r"""\.type\s*[!=]=\s*["'](cuda|cpu)["']|\.is_cuda\b""")


def _function_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(node) if n is not node}
    return inside


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    return skip


def _top_module(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.ImportFrom):
        return "." if node.level else (node.module or "").split(".")[0]
    return node.names[0].name.split(".")[0]


def _triton_module(node: ast.Import | ast.ImportFrom) -> bool:
    """An import of one of the package's Triton kernel modules (``kernels/triton_*.py``): they import
    ``triton`` at module level, so importing one is importing the optional dependency."""
    if isinstance(node, ast.ImportFrom):
        parts = (node.module or "").split(".") + [a.name for a in node.names]
    else:
        parts = [p for a in node.names for p in a.name.split(".")]
    return any(p.startswith("triton_") for p in parts) and (
        isinstance(node, ast.Import) or node.level > 0 or (node.module or "").startswith("mapper")
    )


def measure(root: Path) -> dict:
    pkg = root / "mapper"
    files = sorted(pkg.rglob("*.py"))
    largest_file = max((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files)
    largest_fn = (0, "")
    big_files = sum(len(p.read_text().splitlines()) > 600 for p in files)
    big_fns = 0
    fn_imports, fn_imports_optional, fn_imports_package = 0, 0, 0
    use_triton, device_tests = 0, 0
    for p in files:
        src = p.read_text()
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = node.end_lineno - start + 1
                big_fns += n > 80
                if n > largest_fn[0]:
                    largest_fn = (n, f"{p.relative_to(root)}::{node.name}")
        inside, skip = _function_nodes(tree), _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) in inside and id(node) not in skip:
                top = _top_module(node)
                if top in OPTIONAL or _triton_module(node):
                    fn_imports_optional += 1
                else:
                    fn_imports += 1
                    fn_imports_package += top in (".", "mapper")
        if "kernels" not in p.relative_to(pkg).parts:
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id == "use_triton":
                    use_triton += 1
                elif isinstance(node, ast.Attribute) and node.attr == "use_triton":
                    use_triton += 1
            device_tests += len(DEVICE_TEST.findall(src))
    map_src = (pkg / "map.py").read_text()
    private = set(re.findall(r"\bself\.(_[a-z]\w*)\s*(?::[^=\n]+)?=", map_src))
    private |= set(re.findall(r"\bdef (_[a-z]\w*)\(", map_src))
    private_reads = 0
    if private:
        pat = re.compile(r"\b(?!self\b)\w+\.(" + "|".join(sorted(private)) + r")\b")
        for p in files:
            if p.parent == pkg and p.name.startswith("map"):
                continue
            private_reads += len(pat.findall(p.read_text()))
    top = [p for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    return {
        "largest file (lines)": f"{largest_file[0]} (`{largest_file[1]}`)",
        "largest function (lines)": f"{largest_fn[0]} (`{largest_fn[1]}`)",
        "files over 600 lines": big_files,
        "functions over 80 lines": big_fns,
        "imports inside function bodies (optional deps excluded)": fn_imports,
        "of them of the package itself (`mapper.*`)": fn_imports_package,
        "imports inside function bodies of optional deps (lazy on purpose)": fn_imports_optional,
        "raw `use_triton` outside `kernels/`": use_triton,
        "device-type tests outside `kernels/`": device_tests,
        "private `Map` fields read outside `map*.py`": private_reads,
        "modules directly under `mapper/`": len(top),
    }


def _commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True)
        return out.stdout.decode().strip() or "?"
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, action="append", help="checkout(s) to measure (default: this one)")
    ap.add_argument("--label", action="append", help="a column label per --root")
    ap.add_argument("--out", type=Path, help="write the markdown table here too")
    a = ap.parse_args(argv)
    roots = a.root or [ROOT]
    labels = a.label or [f"{r.name} ({_commit(r)})" for r in roots]
    cols = [measure(r) for r in roots]
    lines = [
        "| measure | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(cols),
        *(f"| {k} | " + " | ".join(str(c[k]) for c in cols) + " |" for k in cols[0]),
    ]
    text = "\n".join(lines)
    sys.stdout.write(text + "\n")
    if a.out:
        cmd = shlex.join(["python", "benchmarks/tools/structure_metrics.py", *(argv or sys.argv[1:])])
        a.out.write_text(
            f"# Structure measures of issue #28 (source scan, no hardware dependence)\n\n"
            f"- date: {datetime.date.today().isoformat()}\n- command: `{cmd}`\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
