"""Every shell and Python snippet in README.md, docs/ and sample_runs/README.md runs, and prints what the page shows.

A fenced block is a *snippet* when its language is a shell (``bash``, ``sh``, ``shell``,
``console``) or Python. Each one is, in this order:

* a file under ``docs/examples/``, shown verbatim (``docs/cli.md`` shows each ``<command>.sh``):
  ``tests/test_docs_examples.py`` runs those, and checks each Python example's ``.out``;
* or run here, command by command, in a scratch directory holding ``sample_runs/``,
  ``docs/examples/`` and the inputs its page names (``PREPARE``); each command must exit 0 unless
  its comment says ``exit N``, and where a ``console`` block shows output after a ``$`` line the
  command's output must be exactly that (a line ``...`` stands for any number of lines);
* except the commands listed in ``NOT_RUN``, each with the reason it cannot run here.

A new snippet or command that is none of these fails ``test_every_snippet_is_run_or_listed``;
an entry of ``NOT_RUN`` or ``PREPARE`` that no longer names anything in the docs fails too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
#: the pages whose snippets and commands are checked
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "sample_runs" / "README.md"]
SHELLS = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "py", "pycon"}

#: commands the docs show and this test does not run: (page, how the command starts) -> why
NOT_RUN = {
    ("README.md", "pip install -e ."): "installs grpolens; the test runs the checkout itself",
    ("README.md", 'pip install -e ".[dev]"'): "installs grpolens; the test runs the checkout itself",
    ("README.md", "python -m pytest"): "runs the test suite itself (`.ci/run` does, in a fresh clone)",
    ("README.md", "grpolens serve RUN"): "starts a server until stopped: docs/examples/serve.sh is "
                                         "started and answered by tests/test_docs_examples.py",
    ("docs/serve.md", "grpolens serve"): "starts a server until stopped: docs/examples/serve.sh is "
                                         "started and answered by tests/test_docs_examples.py, tests/serve/ "
                                         "drive the dashboard in a browser",
    ("docs/serve.md", "curl "): "asks a dashboard that is running on runs named a and b; "
                                "tests/serve/test_downloads.py fetches the same /csv/ URLs from a served run",
    ("docs/distributed.md", 'pip install "grpolens[ray]"'): "installs an extra (the dev environment has it)",
    ("docs/distributed.md", "grpolens recompute RUN --engine ray"): "starts or joins a Ray cluster; "
                                         "tests/distributed/ run --engine ray on a real local Ray",
    ("docs/distributed.md", "grpolens check RUN --engine ray"): "joins a remote Ray cluster (ray://head)",
    ("docs/distributed.md", "grpolens sweep RUN --engine ray"): "starts Ray; tests/distributed/ run "
                                         "--engine ray on a real local Ray",
    ("docs/distributed.md", "export AWS_ACCESS_KEY_ID"): "credentials for a real bucket",
    ("docs/distributed.md", "grpolens recompute s3://"): "a real S3 bucket; tests/distributed/ run the "
                                         "same commands against a local S3 server (moto)",
    ("docs/distributed.md", "python benchmarks/bench_distributed.py"): "benchmarks of minutes; "
                                         "tests/test_bench_scripts.py runs each on a small input",
    ("docs/distributed.md", "python benchmarks/bench_s3_layers.py"): "a benchmark of minutes; "
                                         "tests/test_bench_scripts.py runs it on a small input",
    ("docs/export.md", "wandb sync"): "uploads to wandb.ai",
    ("docs/export.md", "grpolens export RUN --to wandb --online"): "needs a W&B account and the network",
    ("docs/export.md", "tensorboard --logdir"): "starts TensorBoard's server",
    ("docs/export.md", "mlflow ui"): "starts MLflow's server",
    ("docs/export.md", "grpolens export RUN --to mlflow --tracking-uri http://"): "needs an MLflow server",
    ("docs/export.md", "trackio show"): "starts trackio's dashboard server",
    ("docs/integrations/trl.md", "from grpolens.integrations.trl import GRPOLensTrainer"):
        "a fragment of the user's training script (model, dataset, config are theirs); "
        "tests/integration/ train TRL on CPU through GRPOLensTrainer",
    ("docs/integrations/verl.md", "from grpolens.integrations.verl import VerlCapture"):
        "lines inside verl's actor class (needs verl and a GPU); tests/test_verl_adapter.py "
        "drives VerlCapture with verl-shaped batches",
    ("docs/integrations/verl.md", "batch.batch[VerlCapture.PRE_REJECTION_MASK_KEY]"):
        "a line inside verl's driver (RayPPOTrainer.fit: verl, Ray, GPUs); tests/test_verl_adapter.py "
        "sets the key on verl-shaped batches",
    ("docs/integrations/verl.md", "batch.batch[VerlCapture.OLD_ENTROPY_KEY]"):
        "a line inside verl's driver (RayPPOTrainer.fit: verl, Ray, GPUs); tests/test_verl_adapter.py "
        "sets the key on verl-shaped batches",
    ("docs/integrations/openrlhf.md", "from grpolens.integrations.openrlhf import OpenRLHFCapture"):
        "lines inside OpenRLHF's experience maker, trainer and actor (Ray, DeepSpeed, vLLM); "
        "tests/reference/test_openrlhf_reference.py drives OpenRLHFCapture with the batches OpenRLHF's own "
        "replay buffer collated, tests/test_openrlhf_capture.py with OpenRLHF-shaped experiences",
    ("docs/mutation-testing.md", 'pip install -e ".[dev,mutation]"'): "installs an extra",
    ("docs/mutation-testing.md", "mutmut"): "a mutation run takes hours",
    ("docs/mutation-testing.md", "python - <<'PY'"): "rewrites mutants/mutmut-stats.json, which only a "
                                         "mutation run (hours) makes",
    ("docs/mutation-testing.md", "python tools/mutation_fast_pass.py"): "runs the mutants `mutmut run` "
                                         "generated: hours",
    ("docs/profiles.md", "python -m pytest tests/reference"): "runs part of the test suite itself "
                                         "(it builds the trainers' reference venvs)",
    ("docs/sidecars.md", "grpolens completions path/to/maxent/output_dir"): "a MaxEnt-GRPO output "
                                         "directory of the reader's own; docs/examples/completions.sh "
                                         "reads generated sidecars the same way",
}

#: what a page's snippets expect to find in the directory they run in (run with bash, before)
PREPARE = {
    "README.md": "cp -r sample_runs/trl-tiny RUN && grpolens check RUN --write-golden golden.json -q",
    "docs/profiles.md": "cp -r sample_runs/trl-tiny RUN",
    "docs/integrations/trl.md": "mkdir -p runs && cp -r sample_runs/trl-tiny runs/my-run",
    "docs/export.md": "cp -r sample_runs/trl-tiny RUN",
    "docs/sidecars.md": "cp -r {demo} demo",
}

#: environment a page's snippets assume (GitHub Actions sets GITHUB_STEP_SUMMARY in a job)
ENV = {"docs/check.md": {"GITHUB_STEP_SUMMARY": "step-summary.md"}}

#: pages whose snippets run in a few seconds; the others run several commands each (10-70 s on a
#: loaded 2-core machine) and are marked slow
QUICK_PAGES = {"docs/run-format.md", "sample_runs/README.md"}


@dataclass
class Command:
    text: str                      # as shown, continuation lines joined
    output: list[str] = field(default_factory=list)  # the lines a console block shows after it
    shows_output: bool = False


@dataclass
class Snippet:
    page: str
    line: int
    lang: str
    body: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


#: a fenced block, at the margin or indented inside a list item: (indent, language, body)
FENCED = re.compile(r"^( {0,4})```([\w-]*)[^\n]*\n(.*?)^\1```", re.M | re.S)


def snippets() -> list[Snippet]:
    found = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for m in FENCED.finditer(text):
            lang = m.group(2).lower()
            if lang in SHELLS | PYTHONS:
                body = re.sub(rf"^{m.group(1)}", "", m.group(3), flags=re.M)  # a block inside a list item
                found.append(Snippet(str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, lang, body))
    return found


def untagged_blocks() -> list[str]:
    out = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for m in FENCED.finditer(text):
            if not m.group(2):
                out.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
    return out


def example_shown(snippet: Snippet) -> Path | None:
    """The docs/examples file this snippet shows verbatim, if any."""
    for f in sorted(EXAMPLES.iterdir()):
        if f.suffix in (".sh", ".py") and f.read_text(encoding="utf-8").strip() == snippet.body.strip():
            return f
    return None


def commands(snippet: Snippet) -> list[Command]:
    """The commands of a shell snippet; ``a && b`` is two commands, ``\\`` continues a line."""
    lines = snippet.body.splitlines()
    cmds: list[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if snippet.lang == "console" and not line.startswith("$ "):
            if not cmds:
                raise AssertionError(f"{snippet.id}: output before any `$` line")
            cmds[-1].output.append(line)
            cmds[-1].shows_output = True
            i += 1
            continue
        if snippet.lang == "console":
            line = line[2:]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        if heredoc := re.search(r"<<-?\s*'?(\w+)'?", line):  # the here-document is part of the command
            while i + 1 < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
                line += "\n" + lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        code = line.split(" #", 1)[0] if " #" in line else line
        parts = [p.strip() for p in code.split(" && ")]
        comment = line[len(code):]
        for k, part in enumerate(parts):
            cmds.append(Command(part + (comment if k == len(parts) - 1 else "")))
    return cmds


def not_run_reason(page: str, command: str) -> str | None:
    for (p, start), why in NOT_RUN.items():
        if p == page and command.startswith(start):
            return why
    return None


def is_python_not_run(snippet: Snippet) -> str | None:
    first = next((ln for ln in snippet.body.splitlines() if ln.strip()), "")
    return not_run_reason(snippet.page, first)


def expected_status(command: str) -> int:
    comment = command.split(" #", 1)[1] if " #" in command else ""
    m = re.search(r"\bexit (\d+)\b(?! if)", comment)  # "(exit 1 if not)" describes, it does not expect
    return int(m.group(1)) if m else 0


TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms)\b")


def normalise(text: str, scratch: Path) -> str:
    text = text.replace(str(scratch) + os.sep, "").replace(str(scratch), ".")
    return TIMING.sub("<time>", text)


def matches(shown: list[str], printed: str) -> bool:
    """Exact line-for-line match of the shown output; a line ``...`` stands for any lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if ln.strip() == "..." else re.escape(ln.rstrip()) + r"\n"
                      for ln in shown)
    body = "".join(ln.rstrip() + "\n" for ln in printed.splitlines())
    return re.fullmatch(pattern, body) is not None


def _params():
    out = []
    for s in snippets():
        if s.lang in SHELLS and example_shown(s) is None and any(
                not not_run_reason(s.page, c.text) for c in commands(s)):
            marks = [] if s.page in QUICK_PAGES else [pytest.mark.slow]
            out.append(pytest.param(s, id=s.id, marks=marks))
    return out


def test_every_snippet_is_run_or_listed():
    unaccounted, used_not_run = [], set()
    for s in snippets():
        if example_shown(s) is not None:
            continue
        if s.lang in PYTHONS:
            why = is_python_not_run(s)
            if why is None:
                unaccounted.append(f"{s.id}: a Python snippet that is no docs/examples/*.py file")
            else:
                used_not_run.update(k for k in NOT_RUN if k[0] == s.page and s.body.lstrip().startswith(k[1]))
            continue
        for c in commands(s):
            for key in NOT_RUN:
                if key[0] == s.page and c.text.startswith(key[1]):
                    used_not_run.add(key)
    stale = sorted(set(NOT_RUN) - used_not_run)
    assert not unaccounted, unaccounted
    assert not stale, f"NOT_RUN names commands no page shows any more: {stale}"
    pages = {s.page for s in snippets()}
    for name, table in (("PREPARE", PREPARE), ("ENV", ENV), ("QUICK_PAGES", QUICK_PAGES)):
        assert not set(table) - pages, f"{name} names pages without snippets: {set(table) - pages}"


def inline_commands() -> list[tuple[str, str]]:
    """(page, command) for every code span in prose that starts with ``grpolens ``."""
    out = []
    for path in PAGES:
        text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
        out += [(str(path.relative_to(ROOT)), m.group(1)) for m in re.finditer(r"`(grpolens [^`\n]+)`", text)]
    return out


#: placeholders of a synopsis, not words of the command line
SYNOPSIS = re.compile(r"\[[^\]]*\]|(?<!\S)(?:\.\.\.|…)(?!\S)")


def command_line_problem(code: str) -> str | None:
    """What is wrong with a ``grpolens ...`` line as the CLI would parse it: no such command, no
    such option, or more arguments than the command takes. A fragment (``--only`` without its
    value, a command without its RUN) is fine: the docs name options in passing."""
    import shlex

    from grpolens.cli import command

    code = code.replace("\\|", "|")  # a pipe in a table cell is written \|
    code = re.split(r"\s[>|]\s", SYNOPSIS.sub(" ", code), maxsplit=1)[0]
    try:
        words = shlex.split(code)
    except ValueError:
        words = code.split()
    cmd, rest, ctx = command(), words[1:], None
    while hasattr(cmd, "commands"):
        ctx = type(cmd.context_class(cmd))(cmd, info_name=cmd.name, parent=ctx)
        parsed, rest, _ = cmd.make_parser(ctx).parse_args(rest) if rest and rest[0].startswith("-") \
            else ({}, rest, None)
        if not rest or rest[0] == "COMMAND":
            return None
        sub = cmd.commands.get(rest[0])
        if sub is None:
            return f"no command {rest[0]!r}"
        cmd, rest = sub, rest[1:]
    ctx = type(cmd.context_class(cmd))(cmd, info_name=cmd.name, parent=ctx)
    try:
        _, args, _ = cmd.make_parser(ctx).parse_args(rest)
    except Exception as e:  # noqa: BLE001 - the CLI's own parser, vendored by typer
        if "requires an argument" in str(e) or "requires" in str(e) and "argument" in str(e):
            return None  # an option named without its value
        return f"{cmd.name}: {e}"
    # the parser gives each argument its words; what is left over, click refuses
    return f"{cmd.name}: unexpected extra argument(s) {args}" if args else None


def test_every_grpolens_command_shown_parses():
    """Fast, and for the commands that are not run too: each ``grpolens ...`` line of a snippet and
    each one in a code span of the prose names a real command, real options and no more arguments
    than the command takes (``grpolens metrics entropy`` fails: ``--family entropy``)."""
    wrong = []
    for s in snippets():
        if s.lang not in SHELLS:
            continue
        for c in commands(s):
            code = c.text.split(" #", 1)[0]
            if code.split()[:1] == ["grpolens"] and (why := command_line_problem(code)):
                wrong.append(f"{s.id}: `{code}`: {why}")
    for page, code in inline_commands():
        if why := command_line_problem(code):
            wrong.append(f"{page}: `{code}`: {why}")
    assert not wrong, "\n".join(wrong)


def test_command_line_problem():
    assert command_line_problem("grpolens metrics entropy")
    assert command_line_problem("grpolens metrics --nope")
    assert command_line_problem("grpolens nope RUN")
    assert command_line_problem("grpolens validate RUN more")
    for fine in ("grpolens metrics --family entropy", "grpolens recompute --only", "grpolens serve RUN [RUN ...]",
                 "grpolens tokens RUN --step N --by …", "grpolens metrics --markdown > docs/metrics.md",
                 "grpolens [GLOBAL OPTIONS] COMMAND ...", "grpolens --version", "grpolens check",
                 "grpolens tokens ... \\| head"):
        assert command_line_problem(fine) is None, fine


def test_every_code_block_says_its_language():
    # an untagged block would hide a shell snippet from the tests above
    assert not untagged_blocks(), f"tag these blocks (```text for listings): {untagged_blocks()}"


def test_snippet_parsing():
    s = Snippet("docs/x.md", 1, "console", "$ a --x \\\n    --y  # exit 1\nout 1\n...\nout 2\n$ b && c # note\n")
    cs = commands(s)
    assert [c.text for c in cs] == ["a --x  --y # exit 1", "b", "c # note"]
    assert cs[0].output == ["out 1", "...", "out 2"] and not cs[1].shows_output
    assert expected_status(cs[0].text) == 1 and expected_status(cs[2].text) == 0
    assert expected_status("grpolens parity R  # reproduced? (exit 1 if not)") == 0
    assert matches(cs[0].output, "out 1\nmore\nmore\nout 2\n")
    assert matches(cs[0].output, "out 1\nout 2\n")
    assert not matches(cs[0].output, "out 1\nout 2\nextra\n")
    assert not matches(["only"], "only\nand more\n")
    assert normalise("/x/s/a in 1.93s, 208 ms", Path("/x/s")) == "a in <time>, <time>"
    here = Snippet("docs/x.md", 1, "bash", "python - <<'PY'\nimport os # x\nPY\nb\n")
    assert [c.text for c in commands(here)] == ["python - <<'PY'\nimport os # x\nPY", "b"]


@pytest.fixture(scope="session")
def synthetic_demo(tmp_path_factory) -> Path:
    """One small synthetic run with texts, shared by the snippets that name `demo`."""
    d = tmp_path_factory.mktemp("doc-snippets") / "demo"
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "synth", str(d), "--steps", "4", "--ranks", "2",
                        "--max-len", "64", "--texts", "--seed", "1"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.parametrize("snippet", _params())
def test_shell_snippet_runs_and_prints_what_it_shows(snippet, tmp_path, synthetic_demo):
    scratch = tmp_path / "work"
    scratch.mkdir()
    shutil.copytree(ROOT / "sample_runs", scratch / "sample_runs")
    shutil.copytree(EXAMPLES, scratch / "docs" / "examples")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "grpolens").write_text(f"#!/bin/sh\nexec {sys.executable} -m grpolens.cli \"$@\"\n")
    (shim / "grpolens").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "GRPOLENS_REPO": str(ROOT), "COLUMNS": "120", "WANDB_SILENT": "true"}
    env.update(ENV.get(snippet.page, {}))
    if snippet.page in PREPARE:
        r = subprocess.run(["bash", "-ec", PREPARE[snippet.page].format(demo=synthetic_demo)], cwd=scratch,
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    for c in commands(snippet):
        if not_run_reason(snippet.page, c.text):
            continue
        r = subprocess.run(["bash", "-c", c.text], cwd=scratch, env=env, capture_output=True, text=True,
                           timeout=300)
        printed = r.stdout + r.stderr
        assert r.returncode == expected_status(c.text), \
            f"{snippet.id}: `{c.text}` exited {r.returncode}:\n{printed[-3000:]}"
        if c.shows_output:
            shown = [normalise(ln, scratch) for ln in c.output]
            assert matches(shown, normalise(printed, scratch)), \
                f"{snippet.id}: `{c.text}` printed\n{printed}\nbut the page shows\n" + "\n".join(c.output)
