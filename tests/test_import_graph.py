"""The package's import graph: the library never imports an application, and no module imports
one that imports it back (directly or through others), nor does a subpackage.

Every `import` / `from ... import` of a `megatron_mea` module counts: at module level, inside a
function (a lazy import is still a dependency), under `if __name__ == "__main__":` and in a
package's `__main__.py` (what `python -m` runs is a module like any other: a circle through it
is still a circle). Edges go to the module imported, or to its package where the name is not a
module of its own.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_mea")
# The applications (megatron_mea/apps and the console scripts over them, megatron_mea/cli); the
# rest of the package is the library.
APPLICATIONS = ("apps", "cli")


def _module_files():
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    return modules


def _imported_names(tree):
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))


def import_graph():
    """{module: the package's modules it imports}."""
    modules = _module_files()
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        targets = set()
        for name in _imported_names(tree):
            if name.startswith("megatron_mea"):
                while name not in modules:  # `from package import name`: the package
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def is_application(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in APPLICATIONS


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_the_package(graph):
    # A parse that found nothing would pass every test below.
    assert len(graph) > 100
    assert "megatron_mea.model.args" in graph["megatron_mea.model.gpt"]
    assert "megatron_mea.model.gpt" in graph["megatron_mea.apps.training.loop"]
    assert "megatron_mea.cpu.runner" in graph["megatron_mea.cpu.__main__"]
    assert is_application("megatron_mea.apps.evaluation") and not is_application("megatron_mea.model.gpt")


def test_the_library_imports_no_application(graph):
    upward = sorted((module, target) for module, targets in graph.items()
                    if not is_application(module)
                    for target in targets if is_application(target))
    assert upward == []


def test_no_module_imports_one_that_imports_it_back(graph):
    assert cycles(graph) == []


def packages_with_subpackages(graph):
    """The package and each of its packages that has packages of its own (`checkpoint`, `apps`,
    `integrations`, ...): the levels at which parts are placed as wholes."""
    packages = {module for module in graph
                if os.path.basename(_module_files()[module]) == "__init__.py"}
    return sorted(package for package in packages
                  if any(other.rsplit(".", 1)[0] == package for other in packages))


def part_cycles(graph, package):
    """The circles among the parts of `package` (its subpackages and modules, each taken as a
    whole), by the imports between modules inside it."""
    depth = package.count(".") + 2

    def part(module):
        return ".".join(module.split(".")[:depth])

    inside = package + "."
    parts = {}
    for module, targets in graph.items():
        if module.startswith(inside):
            parts.setdefault(part(module), set()).update(
                part(target) for target in targets
                if target.startswith(inside) and part(target) != part(module))
    return cycles({name: parts.get(name, set()) for name in parts})


def test_no_part_of_the_package_imports_one_that_imports_it_back(graph):
    # At every level: the subpackages and modules of the package, then of each subpackage with
    # subpackages of its own. A reader places a package as a whole (cpu/ stood both above and
    # below gpt.py while its runner imported gpt and gpt imported it; checkpoint/torch_dist and
    # checkpoint/megatron_lm imported each other, which this test, one level deep only then,
    # did not see: checked at every level, it failed on that arrow).
    levels = packages_with_subpackages(graph)
    assert {"megatron_mea", "megatron_mea.checkpoint", "megatron_mea.apps"} <= set(levels)
    assert {package: part_cycles(graph, package) for package in levels} == {
        package: [] for package in levels}


def test_a_circle_between_two_subpackages_would_be_found():
    # checkpoint/ as it stood before issue 50: torch_dist's model_only read Megatron-LM's
    # arguments with megatron_lm.reading, which found the checkpoint with torch_dist.checks.
    before = {
        "p.checkpoint.torch_dist.model_only": {"p.checkpoint.megatron_lm.reading",
                                               "p.checkpoint.torch_dist.checks"},
        "p.checkpoint.megatron_lm.reading": {"p.checkpoint.torch_dist.checks"},
        "p.checkpoint.torch_dist.checks": set(),
    }
    assert cycles(before) == []  # no module circle: only the parts tie a knot
    assert part_cycles(before, "p.checkpoint") == [
        ["p.checkpoint.megatron_lm", "p.checkpoint.torch_dist"]]


def test_imports_under_the_main_guard_count():
    tree = ast.parse('import os\n'
                     'if __name__ == "__main__":\n'
                     '    from megatron_mea.cpu.runner import main\n'
                     '    main()\n')
    assert "megatron_mea.cpu.runner" in set(_imported_names(tree))


def test_a_cycle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
