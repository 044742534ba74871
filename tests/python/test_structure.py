"""The package's shape, read from its source with ``ast`` (nothing imported): its folders, the arrows between them,
and the rules README "Layout" states. A move that breaks a rule fails here, with the import that broke it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipython_ext" / "gpucleanup"

#: The folders from the bottom up: a module imports from its own folder or from a lower layer, never from its
#: own layer's other folders or from above. The leaves (the package's top-level modules but its faces) are layer 0.
LAYERS = {
    "": 0,  # _native, units, say, unraisable, version
    "frameworks": 1, "protocol": 1,
    "records": 2,
    "engine": 3, "park": 3,
    "dask": 4,
    "in_kernel": 5, "outside": 5,
    "server": 6,
}
#: The package's faces, which may reach any folder (each lazily, in a function): ``import gpucleanup`` and
#: ``python -m gpucleanup``.
FACES = {"gpucleanup", "gpucleanup.__main__"}

#: Every arrow between two folders (``""``: the leaves), as the code has them today.
FOLDER_ARROWS = {
    ("dask", ""), ("dask", "engine"), ("dask", "frameworks"), ("dask", "records"),
    ("engine", ""), ("engine", "frameworks"), ("engine", "records"),
    ("frameworks", ""),
    ("in_kernel", ""), ("in_kernel", "dask"), ("in_kernel", "engine"), ("in_kernel", "frameworks"),
    ("in_kernel", "park"), ("in_kernel", "protocol"), ("in_kernel", "records"),
    ("outside", ""), ("outside", "park"), ("outside", "protocol"), ("outside", "records"),
    ("park", ""), ("park", "protocol"),
    ("records", ""),
    ("server", ""), ("server", "outside"), ("server", "park"), ("server", "protocol"), ("server", "records"),
}


def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(modules: dict) -> dict:
    """module -> {(imported module, line, what it imports from outside the package)}: every import, lazy ones too."""
    out = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    source = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    out[name].add((full if full in modules else source, node.lineno))
            elif isinstance(node, ast.Import):
                out[name].update((alias.name, node.lineno) for alias in node.names)
    return out


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


MODULES = _modules()
IMPORTS = _imports(MODULES)


def _inner_arrows():
    for name, targets in IMPORTS.items():
        for target, line in targets:
            if target in MODULES and target != name and name not in FACES:
                yield name, target, line


def test_every_folder_of_the_package_has_a_layer_and_a_face():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {""}
    for folder in folders:  # a face says what the folder is for
        assert ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())), folder


def test_no_module_imports_from_a_higher_layer_or_a_neighbour_folder_of_its_layer():
    wrong = [f"{name}:{line} imports {target}" for name, target, line in _inner_arrows()
             if _folder(name) != _folder(target) and LAYERS[_folder(target)] >= LAYERS[_folder(name)]]
    assert wrong == []


def test_the_arrows_between_folders_are_the_ones_the_layout_names():
    arrows = {(_folder(name), _folder(target)) for name, target, _ in _inner_arrows() if _folder(name) != _folder(target)}
    assert arrows == FOLDER_ARROWS


def test_the_modules_import_one_another_in_no_circle():
    graph = defaultdict(set)
    for name, target, _ in _inner_arrows():
        # a package's face importing its own modules is not a way back up
        if not (MODULES[target].name != "__init__.py" and target.startswith(name + ".")):
            graph[name].add(target)
    circles = []
    state: dict = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []


def test_the_engine_imports_no_ipython_nothing_of_the_report_and_no_voice():
    # the engine decides; what is said, and how, is the report's and the extension's (say)
    wrong = [f"{name}:{line} imports {target}" for name, targets in IMPORTS.items() if _folder(name) == "engine"
             for target, line in targets
             if target.split(".")[0] == "IPython" or target.startswith(("gpucleanup.records.report", "gpucleanup.say"))]
    assert wrong == []


def test_the_tools_outside_the_kernels_never_load_the_native_library():
    wrong = [f"{name}:{line} imports {target}" for name, targets in IMPORTS.items()
             if _folder(name) in ("outside", "server") for target, line in targets
             if target == "gpucleanup._native"]
    assert wrong == []


def test_the_public_paths_stay_where_the_readme_names_them():
    def exported(folder: str) -> set:
        tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
        return {ast.literal_eval(elt) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets) for elt in node.value.elts}

    # gpucleanup.park.park(pid) / resume(pid), python -m gpucleanup.park; gpucleanup.dask.register(client)
    assert {"park", "resume", "state", "ParkRefused"} <= exported("park")
    assert {"register", "cluster_memory", "GPUCleanupPlugin"} <= exported("dask")
    assert (PACKAGE / "park" / "__main__.py").exists() and (PACKAGE / "__main__.py").exists()
    import gpucleanup.dask
    import gpucleanup.park

    assert gpucleanup.park.park.__module__ == "gpucleanup.park.steps"
    assert gpucleanup.dask.register.__module__ == "gpucleanup.dask.plugin"
