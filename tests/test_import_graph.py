"""The architecture, checked: no module of grpolens imports a layer above its own, and no import cycle.

Layers, lowest first (a module may import its own layer and those below):

    errors, text, plot_config,         leaves: errors, how values and charts show, allocator settings,
    allocator                          pure maths
    functional
    run                                the run on disk: format, validation, config, the run reader
    capture (hook, writer)             what training ranks run
    metrics                            families, registry, engine: closed
    profiles                           one module per trainer; imports families
    plugins, analysis                  loading what extends metrics; recompute, sweep, drill-down, ...
    check, export                      rules over recomputed series; recomputed series into trackers
    serve                              the dashboard
    adapters, integrations             importers, synthetic runs, trainer integrations
    commands, cli                      the command line

Edges are read with ``ast`` from every ``import`` / ``from ... import`` anywhere in a module
(function-level ones too: a lazy import is still a dependency, and a lazy cycle still loops at
runtime) and from importlib targets: any string constant that names a grpolens module, and the
package an f-string like ``f"grpolens.metrics.{name}"`` points into. The package root ``grpolens``
(its ``__version__`` and the lazy ``grpolens.recompute``) is the public face, outside the layers.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "grpolens"

LAYERS = [
    ("grpolens.errors", "grpolens.text", "grpolens.plot_config", "grpolens.allocator", "grpolens.functional"),
    ("grpolens.run",),
    ("grpolens.capture", "grpolens.hook"),
    ("grpolens.metrics",),
    ("grpolens.profiles",),
    ("grpolens.plugins", "grpolens.analysis"),
    ("grpolens.check", "grpolens.export"),
    ("grpolens.serve",),
    ("grpolens.adapters", "grpolens.integrations"),
    ("grpolens.commands", "grpolens.cli", "grpolens.cli_docs"),
]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = ["grpolens", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = modules()


def layer(mod: str) -> int | None:
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best:
                best, found = len(pre), i
    return found


def _target(name: str) -> str | None:
    """The grpolens module an import of ``name`` loads (a package or module that exists)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name if name and name != "grpolens" else None


def edges(mod: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("grpolens"):
                    out.add(_target(a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("grpolens"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(_target(sub if sub in MODULES else node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            out.add(_target(node.value))  # importlib target held as data
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
            if head.startswith("grpolens.") and head.endswith("."):
                out.add(_target(head[:-1]))  # importlib.import_module(f"grpolens.pkg.{name}")
    out.discard(None)
    out.discard(mod)
    return out


GRAPH = {m: edges(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    assert not [m for m in MODULES if m != "grpolens" and layer(m) is None]


def test_no_upward_import():
    bad = [f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)})"
           for src, dsts in GRAPH.items() if src != "grpolens"
           for dst in dsts if layer(dst) > layer(src)]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert not _cycles(), f"import cycles: {_cycles()}"


def test_the_checker_sees_lazy_and_importlib_edges():
    # what the test relies on, shown on modules whose edges are known
    assert "grpolens.analysis.recompute" in GRAPH["grpolens"]  # a lazy import inside __getattr__
    assert "grpolens.commands" in GRAPH["grpolens.cli"]  # importlib.import_module(f"grpolens.commands.{name}")
    assert "grpolens.analysis.drilldown" in GRAPH["grpolens.plugins"]  # a module name held as data
    assert layer("grpolens.metrics.kl") < layer("grpolens.profiles.trl") < layer("grpolens.analysis.recompute")
