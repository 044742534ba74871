"""Structure figures of the Python package, read with ``ast`` (nothing is imported or run).

    python tests/tools/structure_figures.py [PACKAGE_DIR]

For each class of at least 100 lines: its lines, its instance fields (names assigned as
``self.<name>`` in any of its methods) and its private cross-object accesses (``<obj>._name``
where ``<obj>`` is not ``self``/``cls``, read or written: one object reaching into another's
private members). Also the longest function and the longest argument list of the package.
These are the figures the refactors of the engine and the extension are measured by.
"""

from __future__ import annotations

import ast
import pathlib
import sys


def _fields(cls: ast.ClassDef) -> set:
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            out.add(node.attr)
    return out


def _private_reaches(tree: ast.AST) -> list:
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            # module-private names (``_native``, ``os._exit``, ``sys._getframe``) are not objects' members
            if isinstance(node.value, ast.Name) and node.value.id in ("os", "sys", "gpucleanup", "ctypes"):
                continue
            if node.attr in ("_native", "_asdict", "_replace", "_fields", "_make"):
                continue
            out.append((node.lineno, ast.unparse(node)))
    return out


def main(root: pathlib.Path) -> None:
    longest = (0, "")
    widest = (0, "")
    print(f"{'class':44} {'lines':>6} {'fields':>6} {'private reaches':>15}")
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(root.parent)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > longest[0]:
                    longest = (n, f"{rel}:{node.name}")
                args = node.args
                k = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
                k -= 1 if args.args and args.args[0].arg in ("self", "cls") else 0
                if k > widest[0]:
                    widest = (k, f"{rel}:{node.name}")
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines >= 100:
                    print(f"{str(rel) + ':' + node.name:44} {lines:6} {len(_fields(node)):6} "
                          f"{len(_private_reaches(node)):15}")
        reaches = _private_reaches(tree)
        if reaches:
            print(f"  {rel}: {len(reaches)} private cross-object accesses in the file")
    print(f"longest function: {longest[0]} lines ({longest[1]})")
    print(f"longest argument list: {widest[0]} ({widest[1]})")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[2] / "ipython_ext" / "gpucleanup"))
