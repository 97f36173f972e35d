"""Every documented example is a file, and each one runs (typer-style); the Python ones print what
their ``.out`` file says, and are the snippets the docs show, verbatim."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.sample_runs import copy_sample_runs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.sh"))
#: examples that start a server: run them until they say they are listening, then stop them
SERVERS = {"serve.sh"}
#: each example runs several commands end to end in fresh processes
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    env = dict(os.environ)
    # the examples call `grpolens`; make sure it is this checkout's, whatever PATH says
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "grpolens").write_text(f"#!/bin/sh\nexec {sys.executable} -m grpolens.cli \"$@\"\n")
    (shim / "grpolens").chmod(0o755)
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    env["GRPOLENS_REPO"] = str(ROOT)
    copy_sample_runs(tmp_path / "sample_runs")
    if script.name in SERVERS:
        import re

        port = int(re.search(r"--port (\d+)", script.read_text()).group(1))
        # its own process group: terminating bash alone would leave the server it started holding the port
        proc = subprocess.Popen(["bash", "-eu", str(script)], cwd=tmp_path, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            import time, urllib.request

            deadline = time.time() + 90
            while time.time() < deadline:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                    break
                except OSError:
                    assert proc.poll() is None, proc.stdout.read()
                    time.sleep(0.5)
            else:
                pytest.fail("the serve example did not start listening within 90 s")
        finally:
            import signal

            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        return
    r = subprocess.run(["bash", "-eu", "-o", "pipefail", str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


PY_EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
#: the page that shows each Python example verbatim
SHOWN_IN = {"readme_hook.py": "README.md", "hook_loop.py": "docs/hook.md",
            "token_metrics.py": "docs/token-metrics.md", "explain_api.py": "docs/explain.md"}
#: examples whose page also shows what they print (a ```text block right after the snippet)
SHOWS_OUTPUT = {"token_metrics.py"}


@pytest.mark.parametrize("script", PY_EXAMPLES, ids=lambda p: p.name)
def test_python_example_prints_its_output(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    copy_sample_runs(tmp_path / "sample_runs")  # the examples read the bundled runs
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script.name} failed:\n{r.stderr[-3000:]}"
    assert r.stdout == script.with_suffix(".out").read_text(), r.stdout


def test_python_examples_are_the_docs_snippets():
    assert sorted(p.name for p in PY_EXAMPLES) == sorted(SHOWN_IN)
    for name, page in SHOWN_IN.items():
        blocks = [b.split("```", 1)[0] for b in (ROOT / page).read_text().split("```python\n")[1:]]
        assert (ROOT / "docs" / "examples" / name).read_text() in blocks, f"{page} does not show docs/examples/{name}"
        if name in SHOWS_OUTPUT:
            text = (ROOT / page).read_text()
            code = (ROOT / "docs" / "examples" / name).read_text()
            after = text.split("```python\n" + code + "```", 1)[1]
            shown = after.split("```text\n", 1)[1].split("```", 1)[0]
            assert "```" not in after.split("```text\n", 1)[0], f"{page}: no output block right after {name}"
            assert shown == (ROOT / "docs" / "examples" / name).with_suffix(".out").read_text(), \
                f"{page} shows another output than docs/examples/{name} prints"
