"""The modules of tofu_tf import each other without a circle.

Two modules that import each other can only be loaded in one order, break
when a third module imports the "wrong" one first, and usually mean a piece
of one belongs in a module of its own (``tofu_tf.semantics.family`` is such a
piece). A circle can hide behind an import written inside a function or under
``if TYPE_CHECKING:``: Python then loads fine, but the two modules still
cannot be understood, or tested, one without the other. So this test reads
every ``import`` statement of the package with ``ast``, wherever it stands,
builds the graph "module -> package modules it imports" and looks for cycles.

An import of ``a.b.c`` counts as an edge to ``a.b.c`` only, not to the
packages ``a`` and ``a.b`` whose ``__init__`` Python runs on the way:
otherwise every package that re-exports its submodules would be a circle.

The package's modules live in two folders: ``tofu_tf/`` and ``strategies/``,
installed as ``tofu_tf.strategies`` (setup.py's ``package_dir``). Between the two,
imports go one way: the strategies import the core, the core never imports them
(``tofu_tf``'s own ``__init__`` names ``TofuStrategy`` lazily, and imports it
under ``if TYPE_CHECKING:`` only).
"""

import ast
import importlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tofu_tf"
STRATEGIES = "tofu_tf.strategies"
# Folder of the repository -> the dotted package it installs as.
FOLDERS = {"tofu_tf": PACKAGE, "strategies": STRATEGIES}

# Circles that stay on purpose, each with the reason; the test fails when one is gone,
# so that the entry is removed with it.
ALLOWED = {
    frozenset({"tofu_tf.plan", "tofu_tf.plan_report"}):
        "Plan.to_html, Plan.to_png and Plan._repr_html_ are the user's way to the report and "
        "import plan_report when called; plan_report reads Plan and format_bytes from plan.",
}


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    found = {}
    for top, package in FOLDERS.items():
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for file in files:
                if file.endswith(".py"):
                    path = os.path.join(folder, file)
                    parts = os.path.relpath(path, os.path.join(ROOT, top))[:-len(".py")].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: str, modules) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # relative: "from . import x", "from ..y import z"
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:        # "from a.b import c" where a.b.c is a module
                    out.add(submodule)
                elif base in modules:           # "from a.b import some_name"
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm,
    iterative: every module of one component can reach every other)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_cycle_finder_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def test_the_graph_sees_imports_written_inside_functions():
    graph = import_graph()
    assert "tofu_tf.semantics.ops" in graph["tofu_tf.semantics.registry"]
    assert "tofu_tf.semantics.family" in graph["tofu_tf.semantics.ops.contraction"]
    assert "tofu_tf.plan_report" in graph["tofu_tf.plan"]       # written inside Plan's methods
    assert "tofu_tf.strategies.numerics" in graph["tofu_tf.strategies.tofu_strategy"]


def test_the_graph_holds_the_strategies_under_their_installed_name():
    graph = import_graph()
    assert {"tofu_tf.strategies", "tofu_tf.strategies.tofu_strategy", "tofu_tf.strategies.keras_hooks"} <= set(graph)
    assert not any(name == "strategies" or name.startswith("strategies.") for name in graph)
    assert "tofu_tf.tf.lowering" in graph["tofu_tf.strategies.tofu_strategy"]


def _is_strategy(name: str) -> bool:
    return name == STRATEGIES or name.startswith(STRATEGIES + ".")


def test_the_core_never_imports_the_strategies():
    graph = import_graph()
    backwards = sorted(f"{name} -> {target}" for name, targets in graph.items()
                       if name != PACKAGE and not _is_strategy(name) for target in targets if _is_strategy(target))
    assert not backwards, f"the core imports tofu_tf.strategies (they import the core, not back): {backwards}"
    # The package's __init__ may: its TYPE_CHECKING imports of the lazy names, seen here.
    assert "tofu_tf.strategies.tofu_strategy" in graph[PACKAGE]


def _type_checking_imports() -> dict[str, str]:
    """Name -> module of the ``from m import name`` lines under ``if TYPE_CHECKING:`` of tofu_tf/__init__.py."""
    path = os.path.join(ROOT, PACKAGE, "__init__.py")
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.dump(statement)
                found.update({alias.asname or alias.name: statement.module for alias in statement.names})
    return found


def test_the_lazy_names_resolve_and_are_listed_by_dir_and_type_checking_imports():
    import tofu_tf
    lazy = tofu_tf._LAZY
    assert _type_checking_imports() == {name: module for name, (module, _) in lazy.items()}
    assert all(name == attr for name, (_, attr) in lazy.items())
    assert set(lazy) <= set(dir(tofu_tf)) and set(lazy) <= set(tofu_tf.__all__)
    for name, (module, attr) in lazy.items():
        assert getattr(tofu_tf, name) is getattr(importlib.import_module(module), attr), name
    assert tofu_tf.TofuStrategy.__module__ == "tofu_tf.strategies.tofu_strategy"


def test_the_ir_classes_are_tofu_tf_ir_s_not_the_top_level_s():
    """``tofu_tf.Graph`` would read like TensorFlow's own ``tf.Graph``: the IR's classes are
    imported from ``tofu_tf.ir``."""
    import tofu_tf
    from tofu_tf import ir
    for name in ("Graph", "Op", "Tensor", "Variable", "Role", "VariableKind"):
        assert hasattr(ir, name)
        assert name not in tofu_tf.__all__ and name not in dir(tofu_tf) and not hasattr(tofu_tf, name), name


def test_the_strategies_folder_is_no_top_level_package():
    """From the repository root (pytest's sys.path) the folder is found as ``strategies`` and
    refuses, rather than loading its modules a second time; installed, there is none."""
    try:
        importlib.import_module("strategies")
    except ModuleNotFoundError as error:
        assert error.name == "strategies"
    except ImportError as error:
        assert "import tofu_tf.strategies" in str(error)
    else:
        raise AssertionError("a top-level strategies package imported")


def test_the_package_has_no_import_circle():
    found = set(circles(import_graph()))
    unexpected = sorted(sorted(c) for c in found - set(ALLOWED))
    assert not unexpected, (
        f"modules that import each other: {unexpected}; move what both need into a module of its own")
    gone = sorted(sorted(c) for c in set(ALLOWED) - found)
    assert not gone, f"these circles are gone: remove them from ALLOWED: {gone}"
