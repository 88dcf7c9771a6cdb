"""Imports run one way (DESIGN, "Known debts"): megalite's modules import each other in no circle, at the top or
inside a function, and neither do its packages (transformer/, moe/, ...). The circles DESIGN listed (arguments /
validation, config / mup, iteration_plan / microbatches, the pipeline schedules / interleaved, transformer / moe)
are paid and cannot come back; a new one fails here with its path."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megalite"
KERNELS = PACKAGE.parent / "kernels"


def _imports(package=PACKAGE):
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # "from .x import y" (megalite/data): resolved against this module's package
                    anchor = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:  # "from megalite.pipeline import run" names a module too
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _a_circle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        path.pop()
        return None
    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    graph = _imports()
    assert len(graph) > 100 and "megalite.pipeline.run" in graph["megalite.pipeline.schedules"]
    circle = _a_circle(graph)
    assert circle is None, "an import circle: " + " -> ".join(circle)
    # (the check finds one where there is one)
    graph["megalite.batching.microbatches"].add("megalite.batching.iteration_plan")
    assert _a_circle(graph) is not None


def test_no_package_imports_itself_through_others():
    """megalite.transformer imports megalite.moe (its MoE layers), never the reverse (the MLP's activation is a
    leaf, mlp_activation.py); and so on for every subpackage."""
    graph = _imports()
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}

    def package(module):
        parts = module.split(".")
        return parts[1] if len(parts) > 2 and parts[1] in packages else None
    between = {p: set() for p in packages}
    for a, imported in graph.items():
        for b in imported:
            if package(a) and package(b) and package(a) != package(b):
                between[package(a)].add(package(b))
    assert "moe" in between["transformer"]
    circle = _a_circle(between)
    assert circle is None, "packages importing each other: " + " -> ".join(circle)


def test_the_kernels_import_each_other_in_no_circle():
    """kernels/ too (its dispatch once imported the self-check at its bottom, which imports every kernel, each of
    which imports the dispatch)."""
    graph = _imports(KERNELS)
    assert len(graph) > 15 and "kernels._dispatch" in graph["kernels.layer_norm"]
    circle = _a_circle(graph)
    assert circle is None, "an import circle in kernels/: " + " -> ".join(circle)
    graph["kernels._dispatch"].add("kernels.layer_norm")  # (the check finds one where there is one)
    assert _a_circle(graph) is not None


def test_the_command_line_is_the_outermost_layer():
    """Nothing in megalite imports megalite.cli but megalite.cli itself (the entry points, tools/ and benchmarks/
    do); the one exception is named with its reason and may only go."""
    allowed = {("megalite.training.setup", "megalite.cli.megatron_args")}  # a Megatron checkpoint's saved args read
    # through megalite's own parser and checks (--load of a Megatron-LM run); goes once each flag is declared with
    # its typed section in megalite/config
    graph = _imports()
    found = {(a, b) for a, imported in graph.items() for b in imported
             if b.startswith("megalite.cli") and not a.startswith("megalite.cli")}
    assert found <= allowed, f"modules below the command line import it: {sorted(found - allowed)}"
