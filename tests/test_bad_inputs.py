"""The bad-input corpus (tests/bad_inputs.py) through validate and through the commands that read
the run: each case is refused by both with the same message, one line, exit 2 for a reader and 1
for validate, and nothing of the run changed; each neighbour on the good side passes both."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.bad_inputs import CASES, OK, make_good_run


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from grpolens.analysis.recompute import recompute

    run = make_good_run(tmp_path_factory.mktemp("good") / "run")
    recompute(run)  # outputs and cache exist: a refusing command must leave them as they are
    return run


def _copy(good: Path, tmp_path: Path) -> Path:
    return shutil.copytree(good, tmp_path / "run", symlinks=True)


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.parent.rglob("*")) if p.is_file()}


def said(r) -> tuple[int, str]:
    """A ``cli`` fixture's result as ``(exit code, what it printed on one line)``: rich wraps a long
    message, and a message is checked whatever its width."""
    return r.code, " ".join((r.err + r.out).split())


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_and_recompute_refuse_with_one_message(good, tmp_path, cli, monkeypatch, name):
    from grpolens.run.validate import validate_run

    monkeypatch.setenv("COLUMNS", "1000")
    case = CASES[name]
    run = _copy(good, tmp_path)
    case.breaks(run)
    errors = validate_run(run).errors
    hits = [e for e in errors if (e.path, e.column) == (case.path, case.column) and case.message in e.message]
    assert hits, errors
    rc, err = said(cli("validate", run))
    assert rc == 1 and case.message in err and "Traceback" not in err
    before = _snapshot(run)
    rc, err = said(cli("recompute", run, "-q", "--full"))
    assert rc == 2 and case.message in err and "Traceback" not in err, err[-2000:]
    assert _snapshot(run) == before, "a refused recompute changed the run or wrote outputs"


@pytest.mark.parametrize("name", sorted(OK))
def test_the_neighbour_on_the_good_side_passes(good, tmp_path, cli, name):
    from grpolens.run.validate import validate_run

    run = _copy(good, tmp_path)
    OK[name](run)
    assert validate_run(run).ok, validate_run(run).errors
    rc, err = said(cli("recompute", run, "-q"))
    assert rc == 0, err[-2000:]


# -- class 1: names that become paths ----------------------------------------------------------
@pytest.mark.parametrize("name, why", [
    ("../../../ESCAPED/deep", "contains '/'"), ("/etc", "contains '/'"), ("..", "special directory name"),
    (".", "special directory name"), ("a\\b", "contains '\\'"), ("a\x00b", "control character"),
    ("", "is empty"), ("  ", "is empty"), (".hidden", "starts with '.'"), ("x" * 256, "256 bytes long"),
    ("é" * 128, "256 bytes long"), (5, "must be a string"),
])
def test_a_name_that_is_no_path_component_is_refused(name, why):
    from grpolens.errors import UserError
    from grpolens.run.names import child, name_problem

    assert why in name_problem(name)
    with pytest.raises(UserError, match=r"^--name: .* cannot name a file or directory: it "):
        child("/tmp", name, "--name")


@pytest.mark.parametrize("name", ["x" * 255, "é" * 127, "run @ rollout_is.upper=3", "a..b", "exp-1"])
def test_a_name_that_is_one_path_component_is_kept(name):
    from grpolens.run.names import child

    assert child("/tmp", name, "--name") == Path("/tmp") / name


@pytest.mark.parametrize("how", ["run_name", "--name"])
def test_export_writes_nothing_outside_for_a_traversing_name(good, tmp_path, cli, how):
    pytest.importorskip("tensorboard")
    from tests.bad_inputs import _manifest

    run = _copy(good, tmp_path)
    logdir = tmp_path / "a" / "b" / "c" / "logs"
    args = ["export", run, "--to", "tensorboard", "--logdir", logdir, "-q"]
    if how == "run_name":
        _manifest(run, lambda m: m.update(run_name="../../../ESCAPED/deep"))
    else:
        args += ["--name", "../../../ESCAPED/deep"]
    rc, err = said(cli(*args))
    assert rc == 2 and "'../../../ESCAPED/deep' cannot name a file or directory: it contains '/'" in err
    assert err.startswith("error: --name:" if how == "--name" else "error: the run name (run_name in")
    assert not (tmp_path / "a" / "ESCAPED").exists() and not list(tmp_path.rglob("ESCAPED"))
    assert not logdir.exists() or not any(logdir.rglob("*"))


def test_validate_warns_of_a_run_name_that_cannot_name_a_directory(good, tmp_path):
    from grpolens.run.validate import validate_run
    from tests.bad_inputs import _manifest

    run = _copy(good, tmp_path)
    _manifest(run, lambda m: m.update(run_name="../x"))
    report = validate_run(run)
    assert report.ok and any("run_name '../x' cannot name a directory" in w.message for w in report.warnings)


# -- class 2: counts ---------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, listed", [(9, True), (10, False), (100_000, False)])
def test_missing_ranks_are_summarised_per_step(good, tmp_path, world_size, listed):
    """A world_size of 100,000 with one rank on disk: one error per step, not 99,999 (and cheap).
    Up to 8 missing ranks are named one by one."""
    from grpolens.run.validate import validate_run
    from tests.bad_inputs import _manifest

    run = _copy(good, tmp_path)
    _manifest(run, lambda m: m.update(world_size=world_size))
    report = validate_run(run)
    missing = [e for e in report.errors if "missing (no shards and no completion marker" in e.message]
    if listed:
        assert len(missing) == 3 * (world_size - 1)
        assert missing[0].message.startswith("step 0 rank 1: missing")
    else:
        assert len(missing) == 3
        assert missing[0].message.startswith(f"step 0: {world_size - 1:,} ranks (1-{world_size - 1}) missing")
        assert missing[0].path == "complete/step=00000000.rank=00001.json"
    (unfinished,) = [w for w in report.warnings if "no finished record" in w.message]
    assert f"rank(s) 1{'' if world_size == 2 else ', 2' if world_size == 3 else '-' + str(world_size - 1)}:" \
        in unfinished.message


def test_describe_spans_cuts_after_eight():
    from grpolens.run.format import absent_spans, describe_spans

    assert absent_spans({1, 3}, 6) == [(0, 0), (2, 2), (4, 5)]
    assert describe_spans(absent_spans({1, 3}, 6)) == "0, 2, 4, 5"
    spans = absent_spans(range(1, 40, 2), 40)  # 0, 2, 4, ..., 38: twenty single ranks
    assert describe_spans(spans) == "0, 2, 4, 6, 8, 10, 12, 14 and 12 more"
    assert describe_spans(spans[:8]) == "0, 2, 4, 6, 8, 10, 12, 14"


def test_a_footer_micro_batch_range_of_two_billion_costs_nothing(good, tmp_path):
    """The statistics say micro_batch spans 0..2**31-1: the footer check keeps the range, never
    the set of its values (which took 100 GB before)."""
    import struct

    import pyarrow.parquet as pq

    from grpolens.run.validate import check_before_reading
    from tests.bad_inputs import TOK
    from tests.parquet_footer import set_statistics

    run = _copy(good, tmp_path)
    i = pq.ParquetFile(run / TOK).schema_arrow.get_field_index("micro_batch")
    set_statistics(run / TOK, i, max_value=struct.pack("<i", 2**31 - 1))
    assert check_before_reading(run).ok


# -- class 6 and 7: unknown keys, duplicate keys -----------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--set", "epsilon_hihg=0.5"], "--set: unknown config key 'epsilon_hihg' (did you mean 'epsilon_high'?)"),
    (["--set", "bta=0.1"], "--set: unknown config key 'bta' (did you mean 'beta'?)"),
    (["--set", "zzzz=1"], "--set: unknown config key 'zzzz'"),
    (["--set", "rollout_is.uper=3"], "unknown setting(s) uper (did you mean 'upper'?)"),
])
def test_an_unknown_key_in_set_is_an_error_naming_the_closest(good, tmp_path, cli, args, message):
    run = _copy(good, tmp_path)
    rc, err = said(cli("recompute", run, "-q", *args))
    assert rc == 2 and message in err and "Traceback" not in err
    assert not (run / "grpolens" / "variants").exists() or not any((run / "grpolens" / "variants").iterdir())


def test_a_key_of_the_runs_own_manifest_may_be_set(good, tmp_path, cli):
    run = _copy(good, tmp_path)  # reward_funcs: the synthetic trainer's own key, not grpolens'
    rc, err = said(cli("recompute", run, "-q", "--set", 'reward_funcs=["a","b"]', "--set", "epsilon_high=0.3"))
    assert rc == 0, err


@pytest.mark.parametrize("suffix, text", [(".json", '{"epsilon_hihg": 0.5}'), (".toml", "epsilon_hihg = 0.5\n"),
                                          (".toml", "[config]\nepsilon_hihg = 0.5\n")])
def test_an_unknown_key_in_a_config_file_is_an_error(good, tmp_path, cli, suffix, text):
    run = _copy(good, tmp_path)
    f = tmp_path / f"what-if{suffix}"
    f.write_text(text)
    rc, err = said(cli("recompute", run, "-q", "--config", f))
    assert rc == 2 and f"--config {f}: unknown config key 'epsilon_hihg' (did you mean 'epsilon_high'?)" in err


def test_a_config_file_nested_too_deeply_is_one_line(good, tmp_path, cli):
    run = _copy(good, tmp_path)
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    rc, err = said(cli("recompute", run, "-q", "--config", f))
    assert rc == 2 and f"--config: {f} is nested too deeply to read" in err and "Traceback" not in err


@pytest.mark.parametrize("kind, text, message", [
    ("yaml", "rule:\n  - metric: kl/k3/mean\n    max: 1\n    max: 2\n",
     "r.yaml:4: invalid YAML: duplicate key 'max' (first at line 3)"),
    ("yaml", "rule:\n  - metric: kl/k3/mean\n    max: 1\nrule: []\n", "r.yaml:4: invalid YAML: duplicate key 'rule' (first at line 1)"),
    ("toml", "[[rule]]\nmetric = 'kl/k3/mean'\nmax = 1\nmax = 2\n", "invalid TOML"),
    ("yaml", "rule:\n  - metric: kl/k3/mean\n    mx: 1\n", "unknown key 'mx' (did you mean 'max'?)"),
    ("yaml", "rule: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
])
def test_rules_files_refuse_duplicate_and_unknown_keys(kind, text, message):
    pytest.importorskip("yaml")
    from grpolens.check.rules import parse_rules
    from grpolens.errors import UserError

    with pytest.raises(UserError) as e:
        parse_rules(text, kind=kind, source=f"r.{kind}")
    assert message in e.value.message and "\n" not in e.value.message


def test_a_yaml_merge_key_may_override():
    pytest.importorskip("yaml")
    from grpolens.check.rules import parse_rules

    text = "rule:\n  - metric: kl/k3\n    max: 1\n    <<: {max: 2}\n"
    assert parse_rules(text, kind="yaml").rules[0].max == 1.0


# -- class 9: no tracebacks --------------------------------------------------------------------
@pytest.mark.parametrize("var, value, message", [
    ("GRPOLENS_THREADS", "abc", "GRPOLENS_THREADS: expected a whole number from 1 to 1,024, got 'abc'"),
    ("GRPOLENS_WORKERS", "abc", "GRPOLENS_WORKERS: expected a whole number from 1 to 1,024, got 'abc'"),
    ("GRPOLENS_WORKERS", "0", "GRPOLENS_WORKERS: expected a whole number from 1 to 1,024, got '0'"),
    ("GRPOLENS_WORKERS", "1025", "got '1025'"),
])
def test_a_bad_environment_variable_is_one_line(good, tmp_path, cli, monkeypatch, var, value, message):
    run = _copy(good, tmp_path)
    monkeypatch.setenv(var, value)
    monkeypatch.setenv("COLUMNS", "1000")
    workers = ["--workers", "1"] if var == "GRPOLENS_THREADS" else []
    rc, err = said(cli("recompute", run, "-q", "--full", *workers))
    assert rc == 2 and message in err and "Traceback" not in err, err


def _tmpfs_works(where: Path) -> bool:
    import subprocess

    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
                       capture_output=True, timeout=60)
    return r.returncode == 0


@pytest.mark.parametrize("spare_kb", [4, 16, 64, 256])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(good, tmp_path, spare_kb):
    """A real full disk: the run on a small tmpfs (a user and mount namespace) with a few KB spare,
    recompute fails at some write -- each size a different one -- with the path and the reason,
    exit 2, no traceback, no temporary file left; or it fits and succeeds."""
    import os
    import shlex
    import subprocess
    import sys

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _tmpfs_works(mnt):
        pytest.skip("no unprivileged user and mount namespaces here (unshare -rm)")
    src = tmp_path / "src"
    shutil.copytree(good, src, ignore=shutil.ignore_patterns("grpolens"))
    used_kb = sum(-(-p.stat().st_size // 4096) * 4 for p in src.rglob("*") if p.is_file()) + 64  # pages, dirs
    q = shlex.quote
    script = (f"mount -t tmpfs -o size={used_kb + spare_kb}k tmpfs {q(str(mnt))} && cp -r {q(str(src))} {q(str(mnt / 'run'))} "
              f"&& {q(sys.executable)} -m grpolens.cli recompute {q(str(mnt / 'run'))} -q --workers 1; rc=$?; "
              f"find {q(str(mnt))} -name '*.tmp*' -o -name '.grpolens-tmp-*'; exit $rc")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "COLUMNS": "1000"}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert r.stdout == "", f"temporary files left: {r.stdout}"
    if r.returncode:
        assert r.returncode == 2 and "No space left on device" in r.stderr, (r.returncode, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_ctrl_c_while_starting_is_one_line_and_130():
    """SIGINT before a command runs (the imports of start-up): no traceback, exit 130."""
    import subprocess
    import sys

    code = ("import os, signal, sys; sys.argv = ['grpolens']; import grpolens.cli; "
            "os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(5)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert (r.returncode, r.stderr) == (130, "error: interrupted\n")


def test_ctrl_c_in_a_command_is_one_line_and_130(good, cli, monkeypatch):
    from grpolens.run import validate

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate_run", interrupted)
    rc, err = said(cli("validate", good))
    assert (rc, err) == (130, "error: interrupted")


def test_ctrl_c_met_again_in_a_clean_up_is_still_one_line_and_130(good):
    """A KeyboardInterrupt raised where Python can only print it (an object finalised, a generator
    closed while the first one unwinds; about 1 in 10 Ctrl-Cs into a recompute) adds no traceback."""
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['grpolens', 'validate', sys.argv[1]]; import grpolens.cli as cli\n"
            "from grpolens.run import validate\n"
            "class Finalised:\n"
            "    def __del__(self): raise KeyboardInterrupt\n"
            "def interrupted(*a, **k):\n"
            "    held = Finalised(); raise KeyboardInterrupt\n"
            "validate.validate_run = interrupted; cli.main()")
    r = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert (r.returncode, r.stderr) == (130, "error: interrupted\n")


# -- class 10: numbers a tracker cannot take are said, not dropped -------------------------------
def _source_with(tmp_path: Path, values: dict[str, list[float]]):
    import math

    import polars as pl

    from grpolens.analysis.recompute import to_jsonl
    from grpolens.export.base import ExportSource

    df = pl.DataFrame({"step": [0, 1, 2], **values})
    df.write_parquet(tmp_path / "metrics.parquet")
    rows = [json_row for json_row in map(__import__("json").loads, to_jsonl(df).splitlines())]
    assert all(math.isfinite(v) for r in rows for v in r.values())  # what metrics.jsonl holds
    return ExportSource(tmp_path, "run", "grpolens", tmp_path, rows)


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow"])
def test_an_infinite_metric_is_named_not_silently_dropped(tmp_path, tracker):
    from grpolens.export import ExportOptions, export_run, exporter_class
    from grpolens.export.base import describe_not_exported

    pytest.importorskip(tracker)

    source = _source_with(tmp_path, {"loss": [0.5, float("inf"), 0.25], "kl": [float("nan"), 0.1, -float("inf")],
                                     "entropy": [1.0, 1.0, 1.0]})
    options = ExportOptions(logdir=tmp_path / "tb", tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    out = export_run(source, exporter_class(tracker)(source, options))
    assert out["exported"] == 3
    assert out["not_exported"] == [(0, "kl", pytest.approx(float("nan"), nan_ok=True)), (1, "loss", float("inf")),
                                   (2, "kl", -float("inf"))]
    line = describe_not_exported(out["not_exported"])
    assert line == ("3 value(s) not exported, as trackers take finite numbers only: kl at step 0 (NaN), loss at step 1 "
                    "(+inf), kl at step 2 (-inf) (grpolens recompute shows them)")
    assert describe_not_exported(out["not_exported"], limit=2).endswith("loss at step 1 (+inf) and 1 more "
                                                                        "(grpolens recompute shows them)")


def test_a_finite_run_reports_nothing_missing(tmp_path):
    source = _source_with(tmp_path, {"loss": [0.5, 1e308, -1e-308]})
    assert source.nonfinite == []


def test_no_pattern_reads_a_non_ascii_digit_as_a_number():
    r"""``\d`` in a str pattern and ``str.isdigit()`` accept every Unicode digit, which ``int()``
    then reads: a folder ``step=٠٠٠٠٠٠٠١`` was step 1. Names read from a run, a file or an option
    are matched with ``[0-9]`` (or ``re.ASCII``), and isdigit() only after isascii()."""
    import re

    root = Path(__file__).resolve().parents[1] / "grpolens"
    bad = []
    for p in sorted(root.rglob("*.py")):
        if "serve" in p.relative_to(root).parts:  # the dashboard's (issue #28 item 8, its owner's)
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\\d", line) and "re.ASCII" not in line and "(?a)" not in line and not line.lstrip().startswith("#"):
                bad.append(f"{p.relative_to(root)}:{n}")
            if ".isdigit()" in line and ".isascii()" not in line:
                bad.append(f"{p.relative_to(root)}:{n}")
    assert not bad, bad
