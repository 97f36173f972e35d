"""Lists the docs give that the code also knows are compared with the code's own lists.

(The catalogue, the CLI reference and the profiles page are generated; these are the lists that
live in prose: a value the code accepts but no page mentions, or a page naming a value the code no
longer has, fails here.)
"""

import ast
import re
from pathlib import Path

import pytest

from grpolens.run import config as run_config

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _code_spans(page: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", (DOCS / page).read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", ["run-format.md", "rollout-is.md"])
def test_every_rollout_is_mode_is_documented(page):
    missing = [m for m in run_config.IS_MODES if m not in _code_spans(page)]
    assert not missing, f"docs/{page} does not name the rollout-IS mode(s) {missing}"


def test_every_rollout_is_key_and_filter_is_documented():
    spans = _code_spans("rollout-is.md")
    # a key may be shown alone or as the head of a `key: value` / `key=value` example
    words = spans | {re.split(r"[=:\s]", s, 1)[0] for s in spans} | {s.rsplit(".", 1)[-1] for s in spans}
    missing = sorted(k for k in run_config._RIS_KEYS if k not in words and not any(k in s for s in spans))
    assert not missing, f"docs/rollout-is.md does not name the rollout_is key(s) {missing}"
    text = (DOCS / "rollout-is.md").read_text(encoding="utf-8") + (DOCS / "run-format.md").read_text(encoding="utf-8")
    missing = [o for o in run_config.RS_OPTIONS
               if o not in text and not re.search(re.escape(o.rsplit("_", 1)[0]) + r"_k\d(/k\d)*", text)]
    assert not missing, f"neither docs/rollout-is.md nor docs/run-format.md names the rejection filter(s) {missing}"


def test_every_loss_type_is_documented():
    text = (DOCS / "run-format.md").read_text(encoding="utf-8") + (DOCS / "metrics.md").read_text(encoding="utf-8")
    missing = [t for t in run_config.LOSS_TYPES if f"`{t}`" not in text]
    assert not missing, f"docs/run-format.md and docs/metrics.md do not name the loss type(s) {missing}"


def _bounds(rule) -> list[str]:
    """The table's cells for a rule's thresholds, written from the rule itself."""
    g = "{:g}".format
    cells = []
    if rule.early is not None:
        e = rule.early
        cells.append(f"≤ {g(e.factor)} × early + {g(e.abs)}" if rule.direction == "upper"
                     else f"≥ early / {g(e.factor)}" + (f" + {g(e.abs)}" if e.abs else ""))
    if rule.sustained is not None:
        cells.append(f"sustained: {rule.sustained.count} of any {rule.sustained.window} consecutive steps")
    if rule.rel is not None:
        cells.append(f"≤ {g(1 + rule.rel)} b + {g(rule.abs)}" if rule.direction == "upper" else f"≥ {g(1 - rule.rel)} b")
    if rule.max is not None and rule.min is None and rule.max == 0:
        cells.append("= 0")
    if rule.finite:
        cells.append("finite")
    return cells


def test_builtin_check_rules_are_in_the_table():
    """Every built-in rule has a row naming its metric, and the row's thresholds are the rule's
    (factor, floor, sustained window, baseline bounds); the prose's numbers about them too."""
    from grpolens.check.rules import default_rules

    text = (DOCS / "check.md").read_text(encoding="utf-8")
    table = text.split("## Built-in rules", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    missing, wrong = [], []
    rules = default_rules().rules
    for rule in rules:
        row = next((r for r in rows if f"`{rule.metric}`" in r), None)
        if row is None:
            missing.append(f"{rule.name} ({rule.metric})")
            continue
        wrong += [f"{rule.name}: {cell!r} not in {row[:80]!r}…" for cell in _bounds(rule) if cell not in row]
        if rule.early is not None and rule.direction == "upper" and "leaves room" in row:
            assert f"{rule.early.factor:g}× leaves room" in row, row
    assert not missing, f"docs/check.md's built-in rules table lacks {missing}"
    assert not wrong, "docs/check.md's built-in rules table and the rules differ:\n" + "\n".join(wrong)
    flat = re.sub(r"\s+", " ", text)
    fractions = {r.early.fraction for r in rules if r.early is not None}
    assert len(fractions) == 1 and f"first {100 * fractions.pop():g} % of steps" in flat
    clip = [r for r in rules if r.metric in ("clip/low", "clip/high")]
    assert clip and all(r.sustained and r.early for r in clip)
    assert f"keep their floor of {100 * clip[0].early.abs:g} points" in flat
    assert f"only when {clip[0].sustained.count} of some {clip[0].sustained.window} consecutive steps" in flat


def test_dashboard_pages_match_the_layout():
    from grpolens.serve.layout import PAGES

    section = (DOCS / "serve.md").read_text(encoding="utf-8").split("## Pages", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| \*\*([^*]+)\*\* \|", section, re.M)
    assert documented == [label for _, label in PAGES], "docs/serve.md's Pages table and serve/layout.PAGES differ"


def test_every_storage_option_is_documented():
    from grpolens.run.storage import OPTION_KEYS

    text = re.sub(r"\s+", " ", (DOCS / "distributed.md").read_text(encoding="utf-8"))
    listed = text.split("`--storage-option key=value` (", 1)[1].split(")", 1)[0]
    assert re.findall(r"`(\w+)`", listed) == list(OPTION_KEYS), \
        "docs/distributed.md's list of --storage-option keys and run/storage.OPTION_KEYS differ"


def test_every_export_target_is_documented_with_its_extra():
    import tomllib

    from grpolens.export import TRACKERS

    text = (DOCS / "export.md").read_text(encoding="utf-8")
    synopsis = re.search(r"grpolens export RUN --to ([\w|]+)", text)
    assert synopsis and synopsis.group(1).split("|") == list(TRACKERS), "docs/export.md's --to list and TRACKERS differ"
    extras = tomllib.loads((DOCS.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for tracker in TRACKERS:
        assert f'`pip install "grpolens[{tracker}]"`' in text, f"docs/export.md does not say how to install {tracker}"
        assert tracker in extras, f"pyproject.toml has no extra {tracker!r}, which docs/export.md installs"


def test_families_token_metrics_names_exist():
    from grpolens.metrics.registry import FAMILIES, load_families

    load_families()
    first = (DOCS / "token-metrics.md").read_text(encoding="utf-8").split("metric families are recomputed", 1)[0]
    named = re.findall(r"`(\w+)`", first.rsplit("\n\n", 1)[-1])
    assert named and not set(named) - set(FAMILIES), \
        f"docs/token-metrics.md names families {named}; the registry has {list(FAMILIES)}"


def test_trl_versions_the_docs_name_are_the_ones_recorded_and_trained():
    """The TRL releases docs/integrations/trl.md and the trl profile say were run are the recorded
    runs under tests/data/ plus the release the dev extra pins (the one the suite trains)."""
    import tomllib

    from grpolens.metrics.registry import PROFILES, load_families

    recorded = sorted((p.name.split("-", 1)[1] for p in (DOCS.parent / "tests" / "data").glob("trl-*")),
                      key=lambda v: tuple(map(int, v.split("."))))
    project = tomllib.loads((DOCS.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    dev = project["optional-dependencies"]["dev"]
    trained = next(d.split("==", 1)[1] for d in dev if d.startswith("trl=="))
    text = re.sub(r"\s+", " ", (DOCS / "integrations" / "trl.md").read_text(encoding="utf-8"))
    m = re.search(r"Runs trained by TRL \*\*([\d., and]+)\*\* themselves", text)
    assert m and re.findall(r"\d+\.\d+\.\d+", m.group(1)) == recorded, \
        f"trl.md names {m and m.group(1)}; tests/data has {recorded}"
    assert f"the suite trains TRL **{trained}**" in text, f"the dev extra pins trl=={trained}"
    load_families()
    ran = re.search(r"\(run on ([\d., ]+)\)", PROFILES["trl"].reference)
    assert ran and ran.group(1).split(", ") == [*recorded, trained], PROFILES["trl"].reference


# ---------------------------------------------------------------------------------------------------
# The environment variables and exit statuses the code has, found in its source, against the two
# tables docs/cli.md has (grpolens/cli_docs.py writes them from ENVIRONMENT and EXIT_STATUS).

SOURCE = DOCS.parent / "grpolens"


def _modules():
    for path in sorted(SOURCE.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def _environ_names(tree) -> set[str]:
    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and "os.environ" in ast.unparse(n.value)
               for t in n.targets if isinstance(t, ast.Name)}
    return {"os.environ", "environ", *aliases}


def _reads(tree, environ: set[str]):
    """(node, the expression naming the variable) of each read of the environment in ``tree``."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and isinstance(n.func, ast.Attribute) and (
                (n.func.attr == "get" and ast.unparse(n.func.value) in environ) or ast.unparse(n.func) == "os.getenv"):
            yield n, n.args[0]
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and ast.unparse(n.value) in environ:
            yield n, n.slice
        elif isinstance(n, ast.Compare) and any(ast.unparse(c) in environ for c in n.comparators):
            yield n, n.left


def environment_readers(tree) -> set[str]:
    """Functions of the module that read the variable their first parameter names
    (``def env_int(name): ... os.environ.get(name)``): a call ``env_int("X")`` reads ``X``."""
    out = set()
    for f in ast.walk(tree):
        if isinstance(f, ast.FunctionDef) and f.args.args:
            first = f.args.args[0].arg
            if any(isinstance(arg, ast.Name) and arg.id == first for _, arg in _reads(f, _environ_names(tree))):
                out.add(f.name)
    return out


def environment_read(tree, readers: frozenset[str] = frozenset()) -> set[str]:
    """Names the module reads from the environment: ``os.environ.get(X)``, ``os.getenv(X)``,
    ``os.environ[X]``, ``X in os.environ``, the same on a name bound to ``os.environ`` or a copy of
    it, and ``reader(X)`` for a function of ``readers``; ``X`` a string or a module constant
    holding one."""
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}

    def name(node) -> str | None:
        v = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return v if isinstance(v, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", v) else None

    found = {name(arg) for _, arg in _reads(tree, _environ_names(tree))}
    found |= {name(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
              and ast.unparse(n.func).rsplit(".", 1)[-1] in readers}
    return found - {None}


def exit_statuses(tree) -> set[int]:
    """Exit statuses written in the module: ``sys.exit(N)``, ``SystemExit(N)``, ``typer.Exit(N)``
    (or ``code=N``), ``exit_code=N`` given to anything, and what an ``exit_code`` property returns."""

    def ints(nodes):
        return {n.value for n in nodes if isinstance(n, ast.Constant) and type(n.value) is int}

    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            callee = ast.unparse(n.func).rsplit(".", 1)[-1]
            if callee in ("exit", "SystemExit", "Exit"):
                found |= ints(n.args[:1]) | ints(k.value for k in n.keywords if k.arg == "code")
            found |= ints(k.value for k in n.keywords if k.arg == "exit_code")
        elif isinstance(n, ast.FunctionDef) and n.name == "exit_code":
            found |= ints(c for r in ast.walk(n) if isinstance(r, ast.Return) and r.value for c in ast.walk(r.value))
        elif isinstance(n, ast.arguments):
            names = [a.arg for a in n.args[len(n.args) - len(n.defaults):]]
            found |= ints(d for a, d in zip(names, n.defaults) if a == "exit_code")
    return found


def _cli_table(heading: str) -> list[str]:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert f"## {heading}\n" in text, f"docs/cli.md has no {heading} table"
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| variable")
            and not line.startswith("| status")]


def test_every_environment_variable_the_code_reads_is_documented():
    read, modules = {}, list(_modules())
    readers = frozenset().union(*(environment_readers(tree) for _, tree in modules))
    for path, tree in modules:
        for var in environment_read(tree, readers):
            read.setdefault(var, path.relative_to(SOURCE.parent).as_posix())
    documented = {v for row in _cli_table("Environment variables") for v in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    missing = sorted(f"{v} (read in {p})" for v, p in read.items() if v not in documented)
    assert not missing, f"docs/cli.md's Environment variables table (grpolens/cli_docs.py) lacks {missing}"
    stale = sorted(documented - set(read))
    assert not stale, f"docs/cli.md documents variables no code reads: {stale}"


def test_every_exit_status_the_cli_can_return_is_documented():
    returned = {0}  # success
    for _, tree in _modules():
        returned |= exit_statuses(tree)
    documented = {int(row.split(" | ")[0].strip("| ")) for row in _cli_table("Exit status")}
    assert returned == documented, f"the code returns exit statuses {sorted(returned)}; docs/cli.md lists {sorted(documented)}"


def test_every_command_that_exits_1_is_named_in_that_row():
    """A command whose module exits 1 ("found problems") is named in docs/cli.md's row for 1."""

    row = next(r for r in _cli_table("Exit status") if r.startswith("| 1 |"))
    missing = []
    for path in sorted((SOURCE / "commands").glob("*.py")):
        if 1 in exit_statuses(ast.parse(path.read_text(encoding="utf-8"))):
            name = path.stem.rstrip("_")
            if f"`{name}`" not in row and f"`{name} " not in row:
                missing.append(name)
    assert not missing, f"docs/cli.md's exit status 1 row (cli_docs.EXIT_STATUS) does not name {missing}"


def test_the_scans_see_what_they_look_for():
    src = ('import os, sys\nENV = "A_VAR"\ndef f():\n    env = os.environ\n    x = env.get("B_VAR") or os.getenv("C_VAR")\n'
           '    y = os.environ["D_VAR"], os.environ.get(ENV), "E_VAR" in os.environ\n    os.environ["NOT_READ"] = "1"\n'
           '    raise SystemExit(3)\n'
           'def g(exit_code: int = 7):\n    sys.exit(130); typer.Exit(code=4); UserError("x", exit_code=5)\n'
           'class R:\n    @property\n    def exit_code(self):\n        return 6 if self else 0\n')
    tree = ast.parse(src)
    assert environment_read(tree) == {"A_VAR", "B_VAR", "C_VAR", "D_VAR", "E_VAR"}
    helper = ast.parse('import os\ndef env_int(name, lo=1):\n    raw = os.environ.get(name)\n')
    assert environment_readers(helper) == {"env_int"} and environment_read(helper) == set()
    assert environment_read(ast.parse('from x import env_int\nn = errors.env_int("F_VAR", 2)\n'),
                            frozenset({"env_int"})) == {"F_VAR"}
    assert exit_statuses(tree) == {0, 3, 4, 5, 6, 7, 130}


def test_every_family_lives_where_the_readme_says():
    """README's "How it is built": a family's formula is in grpolens/metrics/<family>.py (or the
    package <family>/ it grew into) and its reference in tests/metrics/test_<family>.py; a family
    that lives elsewhere is named there."""
    from grpolens.metrics.registry import FAMILIES, load_families

    load_families()
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## How it is built", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", section))
    root = DOCS.parent
    metrics = root / "grpolens" / "metrics"
    elsewhere = [f for f in FAMILIES if not (((metrics / f"{f}.py").is_file() or (metrics / f / "__init__.py").is_file())
                                             and (root / "tests" / "metrics" / f"test_{f}.py").is_file())]
    home = {m.group(1): path.name for path in (root / "grpolens" / "metrics").glob("*.py")
            for m in re.finditer(r'Family\(\s*"(\w+)"', path.read_text(encoding="utf-8"))}
    unnamed = [f"{f} (in {home.get(f)})" for f in elsewhere if f not in named or f"`{home.get(f)}`" not in section]
    assert not unnamed, ("README's How it is built says where a family's formula and reference live; these "
                         f"live elsewhere, and it does not say where: {unnamed}")


def test_every_argument_of_the_hooks_methods_is_documented():
    """docs/hook.md names, in code spans, every argument of the writer hook's public methods (a new
    keyword of log_samples that no page mentions is a feature nobody finds)."""
    import inspect

    from grpolens.hook import GRPOLensHook

    prose = re.sub(r"^```.*?^```", "", (DOCS / "hook.md").read_text(encoding="utf-8"), flags=re.M | re.S)
    text = " ".join(re.findall(r"`([^`]+)`", prose))  # named as code, not a word of the prose or an example's
    missing = []
    for name, method in inspect.getmembers(GRPOLensHook, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        for p in list(inspect.signature(method).parameters.values())[1:]:
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if not re.search(rf"(?<![\w.]){re.escape(p.name)}(?![\w])", text):
                missing.append(f"{name}({p.name})")
    assert not missing, f"docs/hook.md does not mention these arguments of GRPOLensHook: {missing}"
