"""The command line as a whole: start-up cost, exit codes, and that every command is documented."""

import re
import subprocess
import sys
from pathlib import Path


from grpolens.cli import COMMAND_MODULES, app

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "dash", "plotly", "polars", "pyarrow", "numpy")


def test_help_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from grpolens.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def _commands():
    import typer.main

    group = typer.main.get_command(app)
    return group.commands


def test_every_command_module_registers_a_command():
    names = set(_commands())
    assert len(names) >= len(COMMAND_MODULES)


def test_every_command_and_option_is_documented():
    """Each command and option has help text; docs/cli.md is generated from it and up to date;
    each command has an example file (run by tests/test_docs_examples.py)."""
    from grpolens.cli_docs import cli_markdown

    missing = []
    for name, cmd in _commands().items():
        if len((cmd.help or "").strip()) < 20:
            missing.append(f"help of {name}")
        for p in cmd.params:
            if p.param_type_name == "option" and len((p.help or "").strip()) < 5:
                missing.append(f"help of {name} {p.opts[0]}")
        if not (ROOT / "docs" / "examples" / f"{name}.sh").is_file():
            missing.append(f"docs/examples/{name}.sh")
    assert not missing, f"undocumented: {missing}"
    assert (ROOT / "docs" / "cli.md").read_text() == cli_markdown(), (
        "docs/cli.md is stale: python -m grpolens.cli_docs > docs/cli.md")


def test_readme_commands_are_the_ci_commands():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = [l for b in blocks for l in b.splitlines() if "pytest" in l]
    assert test_cmd, "README has no test command"
    ci_lines = [l.strip() for l in ci.splitlines() if not l.lstrip().startswith("#")]
    assert test_cmd[0].strip() in ci_lines, ".ci/run must run the README's test command verbatim, on a line of its own"
    # ... inside a virtual environment of its own, which a package installed by hand cannot leak into
    venv_at = next((i for i, l in enumerate(ci_lines) if " -m venv " in l), None)
    assert venv_at is not None and venv_at < ci_lines.index(test_cmd[0].strip()), ".ci/run must create a venv first"
    assert "--system-site-packages" not in ci
    assert any(l.startswith("source ") and "/bin/activate" in l for l in ci_lines[venv_at:])
    # the README says how to run only the fast tests
    assert 'python -m pytest -m "not slow"' in readme


def test_unknown_command_and_option_exit_2():
    for args in (["frobnicate"], ["recompute", "--no-such-option"]):
        r = subprocess.run([sys.executable, "-m", "grpolens.cli", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.returncode)
        assert "Traceback" not in r.stderr


def test_long_tests_carry_the_slow_marker():
    """`-m "not slow"` (the README's quick run) leaves out real TRL training, the browser and the
    end-to-end documentation examples: each of those modules is marked slow as a whole."""
    import ast

    whole_modules = [*(ROOT / "tests" / "serve" / "browser").glob("test_*.py"), ROOT / "tests" / "test_docs_examples.py",
                     *[p for p in (ROOT / "tests" / "integration").glob("test_trl_*.py")
                       if "trl_run" in p.read_text()
                       # marks its trainings one by one, keeping one cheap case in the quick run on purpose
                       and p.name != "test_trl_logging_windows.py"]]  # the ones that train (the bundled sample run does not)
    assert len(whole_modules) >= 7
    unmarked = []
    for path in whole_modules:
        tree = ast.parse(path.read_text())
        marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)]
        if not any("pytest.mark.slow" in m for m in marks):
            unmarked.append(path.relative_to(ROOT).as_posix())
    assert not unmarked, f"modules without pytestmark = pytest.mark.slow: {unmarked}"
