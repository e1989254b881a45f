"""The package's import graph (read with ast: every import, those inside functions and under TYPE_CHECKING too)
has no cycle between modules, and imports point one way: cluster -> actors -> engine -> models -> kernels (a
module imports from its own folder or folders to its right); protos, the generated API, imports nothing of the
package and only cluster imports it; train may import engine, models and kernels, and nothing imports train."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("cluster", "actors", "engine", "models", "kernels")
ALLOWED = {folder: set(LAYERS[i:]) for i, folder in enumerate(LAYERS)}
ALLOWED["cluster"].add("protos")
ALLOWED["protos"] = {"protos"}
ALLOWED["train"] = {"train", "engine", "models", "kernels"}


def _modules() -> dict[str, Path]:
    """Dotted module name (without the dspark_serve prefix) -> file, for every module of the package."""
    mods = {}
    for folder in ALLOWED:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imported(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement reaches inside the package (relative ones resolved from `package`)."""
    if isinstance(node, ast.Import):
        return [a.name.removeprefix("dspark_serve.") for a in node.names if a.name.startswith("dspark_serve.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    elif (node.module or "").startswith("dspark_serve."):
        module = node.module.removeprefix("dspark_serve.")
    else:
        return []
    return [module] + [f"{module}.{a.name}" for a in node.names]  # `from pkg import module` names a module


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for child in node.body for n in ast.walk(child))
    return inside


def import_graph(runtime_only: bool = False) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}; with runtime_only, imports under TYPE_CHECKING are left out."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = {}
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree) if runtime_only else set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = _imported(node, package)
            targets = [n for n in names[1:] if n in mods] or names[:1]
            for target in targets:
                while target and target not in mods:  # `from pkg.module import name`: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert graph["engine.core.executor"]["engine.core.pipeline"] > 0  # relative imports resolve
    assert "kernels.config" in graph["engine.draft_side"]  # absolute ones too
    assert "kernels.markov_walk" in graph["engine.draft_side"]  # and those inside functions
    runtime = import_graph(runtime_only=True)  # and those under TYPE_CHECKING
    assert "actors.pair_config" in graph["actors.verifier_actor"]
    assert "actors.pair_config" not in runtime["actors.verifier_actor"]


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_imports_point_one_way():
    wrong = [f"{module} -> {target} (line {line})" for module, edges in import_graph().items()
             for target, line in edges.items() if target.split(".")[0] not in ALLOWED[module.split(".")[0]]]
    assert wrong == []


def test_a_cycle_and_a_wrong_direction_are_found():
    graph = {"engine.a": {"engine.b": 1}, "engine.b": {"engine.c": 1}, "engine.c": {"engine.a": 1}, "engine.d": {}}
    assert _cycles(graph) == [["engine.a", "engine.b", "engine.c"]]
    assert "actors" not in ALLOWED["engine"] and "engine" in ALLOWED["actors"] and "protos" not in ALLOWED["actors"]
