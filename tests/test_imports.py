"""The arrows between zoo's rooms go one way: every import in every module of the rooms, the
imports inside functions included, read from the source (nothing is imported)."""

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each room and what it may import besides itself; a name covers its submodules.
ALLOWED = {
    "runtime": ("models", "layers", "ops_cuda", "loaders"),
    "models": ("layers", "loaders"),  # the ops only through the layers
    # the loading declarations models make with layers' Shard/OneOf; the FP8 block and MXFP4 formats the
    # loader dequantises or keeps and the kernels read
    "loaders": ("layers.weights", "ops_cuda.fp8", "ops_cuda.mxfp4"),
    "layers": ("ops_cuda",),
    "ops_cuda": (),
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported project module
    names: tuple[str, ...]  # the names a ``from`` import takes from it
    where: str  # file:line
    statement: str

    def __str__(self):
        return f"{self.where}: {self.statement}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for room in ALLOWED for path in sorted((ROOT / room).rglob("*.py"))}


def project_imports() -> list[Import]:
    """Every import of a project module by a project module, at any depth of the file."""
    found = []
    for source, path in MODULES.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES:
                        found.append(Import(source, alias.name, (), where, ast.unparse(node)))
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                # ``from package import submodule`` imports that submodule; other names come from the module.
                names = [alias.name for alias in node.names if f"{module}.{alias.name}" not in MODULES]
                for alias in node.names:
                    if f"{module}.{alias.name}" in MODULES:
                        found.append(Import(source, f"{module}.{alias.name}", (), where, ast.unparse(node)))
                if names and module in MODULES:
                    found.append(Import(source, module, tuple(names), where, ast.unparse(node)))
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_imports_are_read():
    targets = {(i.source, i.target) for i in project_imports()}
    assert ("models.auto", "loaders") in targets
    assert ("runtime.diff", "models") in targets
    assert ("loaders.load", "layers.weights") in targets


def test_rooms_import_only_the_rooms_below():
    wrong = [
        f"{i}  ({i.source.split('.')[0]} may import {', '.join(ALLOWED[i.source.split('.')[0]]) or 'nothing outside itself'})"
        for i in project_imports()
        if not within(i.target, i.source.split(".")[0])
        and not any(within(i.target, allowed) for allowed in ALLOWED[i.source.split(".")[0]])
    ]
    assert not wrong, "imports against the arrows:\n" + "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    private = [f"{i}  (takes {', '.join(n for n in i.names if n.startswith('_'))})"
               for i in project_imports() if any(n.startswith("_") for n in i.names)]
    assert not private, "imports of private names:\n" + "\n".join(private)


def test_no_import_cycles():
    edges: dict[str, list[Import]] = {}
    for i in project_imports():
        if i.target != i.source:
            edges.setdefault(i.source, []).append(i)
    cycles = [cycle for cycle in strongly_connected(edges) if len(cycle) > 1]
    report = []
    for cycle in cycles:
        report.append(f"cycle among {', '.join(sorted(cycle))}:")
        report += [f"  {i}" for module in sorted(cycle) for i in edges.get(module, []) if i.target in cycle]
    assert not cycles, "import cycles:\n" + "\n".join(report)


def strongly_connected(edges: dict[str, list[Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the module graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(module: str):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for edge in edges.get(module, []):
            if edge.target not in index:
                visit(edge.target)
                low[module] = min(low[module], low[edge.target])
            elif edge.target in on_stack:
                low[module] = min(low[module], index[edge.target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            components.append(component)

    for module in MODULES:
        if module not in index:
            visit(module)
    return components
