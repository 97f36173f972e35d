"""Every third-party module the repository imports is declared in pyproject.toml.

A package installed by hand in the development environment makes the suite pass here and fail on a
fresh machine (hypothesis did exactly that). The imports are read with ``ast`` (nothing is run) from
grpolens/, tests/, benchmarks/, tools/, sample_runs/, the Python files and ```python blocks under docs/ and the
README, and the ``python -c`` snippets of docs/examples/*.sh; ``pytest.importorskip("x")`` and
``importlib.import_module("x")`` with a literal name count as imports too (a skip is a silent hole).
Each top-level module is mapped to the distribution that provides it here (importlib.metadata) and must
be reachable from what its directory's users install:

- grpolens/: the core dependencies or an optional extra other than ``dev`` (the extra whose feature
  needs it: a user installs ``grpolens[hook]``, never ``grpolens[dev]``);
- tools/ (development tools, e.g. the mutation-testing pass): the core plus ``dev`` and ``mutation``,
  what docs/mutation-testing.md installs;
- everything else (tests, benchmarks, examples, sample-run scripts): the core plus ``dev``, which is
  what the README's test command installs.

A requirement of a declared distribution counts (pip installs it), following extras only where the
declaration asks for them.
"""
from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("grpolens", "tests", "benchmarks", "tools", "sample_runs", "docs")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(spec: str) -> tuple[str, frozenset[str], str | None]:
    """(distribution, extras asked for, the extra this requirement belongs to) of a PEP 508 string."""
    head, _, marker = spec.partition(";")
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", head)
    assert m, f"unparsable requirement {spec!r}"
    extras = frozenset(_norm(e) for e in (m.group(2) or "").split(",") if e.strip())
    in_extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    return _norm(m.group(1)), extras, _norm(in_extra.group(1)) if in_extra else None


def _installed_closure(specs: list[str]) -> set[str]:
    """Distributions pip brings in for these requirements (transitively, extras only where requested).
    A requirement of our own distribution (``grpolens[hook]`` in an extra) expands to that extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = _norm(project["name"])
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [_requirement(s)[:2] for s in specs]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name == own:
            for extra in extras:
                todo += [_requirement(s)[:2] for s in project["optional-dependencies"].get(extra, [])]
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            dep, dep_extras, in_extra = _requirement(spec)
            if in_extra is None or in_extra in extras:
                todo.append((dep, dep_extras))
    return {name for name, _ in seen}


def _literal_import_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in ("importorskip", "import_module"):
                yield node.args[0].value, node.lineno


def _imports(source: str):
    """(module, line) for every absolute import in a piece of Python source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
    yield from _literal_import_calls(tree)


def _python_sources():
    """(path relative to the root, Python source, line offset) of everything scanned."""
    for d in SCANNED:
        for f in sorted((ROOT / d).rglob("*.py")):
            if f.parent == ROOT / "tests" / "reference" and f.stem.endswith("_driver"):
                continue  # run by a trainer's own venv; its packages are pinned in requirements-<trainer>.txt
            yield f.relative_to(ROOT), f.read_text(encoding="utf-8"), 0
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = f.read_text(encoding="utf-8")
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            yield f.relative_to(ROOT), m.group(1), text[:m.start()].count("\n") + 1
    for f in sorted((ROOT / "docs" / "examples").glob("*.sh")):
        for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            words = shlex.split(line, comments=True) if re.match(r"\s*python3?\s+-c\s", line) else []
            if len(words) >= 3:
                yield f.relative_to(ROOT), words[2], lineno - 1


def _own_modules() -> set[str]:
    """Our packages, plus the stems of our scripts and helpers (tests put some of them on sys.path)."""
    own = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    own |= {f.stem for d in SCANNED for f in (ROOT / d).rglob("*.py")}
    return own


def test_every_imported_third_party_module_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = list(project["dependencies"])
    extras = project["optional-dependencies"]
    for_package = _installed_closure(core + [s for name, specs in extras.items() if name != "dev" for s in specs])
    for_development = _installed_closure(core + list(extras["dev"]))
    for_tools = _installed_closure(core + list(extras["dev"]) + list(extras["mutation"]))
    providers = metadata.packages_distributions()
    own = _own_modules()

    problems, scanned = [], 0
    for path, source, offset in _python_sources():
        scanned += 1
        try:
            found = list(_imports(source))
        except SyntaxError as e:
            problems.append(f"{path}:{offset + (e.lineno or 0)}: not valid Python ({e.msg})")
            continue
        in_package = path.parts[0] == "grpolens"
        in_tools = path.parts[0] == "tools"
        allowed = for_package if in_package else for_tools if in_tools else for_development
        for module, line in found:
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in own or top == "__future__":
                continue
            where = f"{path}:{offset + line}"
            dists = {_norm(d) for d in providers.get(top, [])}
            if not dists and in_tools:
                # the tools' extra (mutation) is not installed by the README's test command: a module
                # that is not installed here counts by its own name (mutmut's distribution is mutmut)
                dists = {_norm(top)}
            if not dists:
                problems.append(f"{where}: module {top!r} is not installed here; declare its distribution "
                                "in pyproject.toml")
            elif not dists & allowed:
                needed = ("the core dependencies or the extra whose feature needs it" if in_package
                          else "the 'dev' or 'mutation' extra" if in_tools
                          else "the 'dev' extra (what the README's test command installs)")
                problems.append(f"{where}: module {top!r} comes from {', '.join(sorted(dists))}, "
                                f"not declared in pyproject.toml ({needed})")
    assert scanned > 100, f"only {scanned} sources scanned: the scan lost its way"
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_the_scan_sees_imports_of_every_kind():
    """The scanner itself: plain, from-, nested, importorskip and import_module imports are all found."""
    source = ("import a.b\nfrom c.d import e\ndef f():\n    import g\n"
              "pytest.importorskip('h')\nimportlib.import_module('i.j')\nfrom . import k\n")
    assert [m for m, _ in _imports(source)] == ["a.b", "c.d", "g", "h", "i.j"]


def test_closure_follows_requirements_and_only_requested_extras():
    # pytest requires pluggy; dash's 'testing' extra brings selenium only when asked for
    assert "pluggy" in _installed_closure(["pytest>=8"])
    assert "selenium" not in _installed_closure(["dash"])
    assert "selenium" in _installed_closure(["dash[testing]"])
