"""``--storage-option`` on a command whose locations are all local is refused with one line (exit 2)
before anything is read or written: silently ignoring it would let a user believe an endpoint or a
credential was in use. With an s3:// location among the command's, it applies (tests/distributed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from grpolens.cli import command, main

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "tiny"
COMMANDS = sorted(name for name, cmd in command().commands.items()
                  if any(p.name == "storage_option" for p in cmd.params))


def test_every_run_command_takes_the_option():
    # the list below must not silently shrink: a new RUN command shares the option
    assert {"validate", "recompute", "parity", "tokens", "completions", "sidecars", "check", "serve", "sweep",
            "export", "explain", "doctor"} <= set(COMMANDS)


def _args(name: str, run: Path) -> list[str]:
    extra = {"tokens": ["--step", "0"], "completions": ["--step", "0"], "export": ["--to", "tensorboard"],
             "sweep": ["--param", "rollout_is.threshold=2"], "serve": ["--port", "8059"],
             "explain": ["--metric", "kl", "--step", "1"]}
    return [name, str(run), *extra.get(name, [])]


@pytest.mark.parametrize("name", COMMANDS)
def test_refused_on_a_local_run(name, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("grpolens"))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(SystemExit) as e:
        main([*_args(name, run), "--storage-option", "endpoint_url=http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    lines = err.strip().splitlines()
    assert len(" ".join(lines).split("error:")) == 2, err  # one error, no traceback
    joined = " ".join(err.split())
    assert "--storage-option applies to s3:// locations only" in joined and str(run) in joined, err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written


def test_names_every_local_location(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["recompute", str(SAMPLE), "--out", str(tmp_path / "o"), "--storage-option", "region=eu-west-1"])
    err = " ".join(capsys.readouterr().err.split())
    assert f"RUN {SAMPLE}" in err and "--out" in err
    assert not (tmp_path / "o").exists()


def test_not_refused_when_a_location_is_remote():
    from grpolens.commands.storage_option import refuse_unless_remote

    refuse_unless_remote(["region=x"], {"RUN": "./run", "--out": "s3://b/out"})  # the output is remote: it applies
    refuse_unless_remote(["region=x"], {"PATHS": ["./a", "s3://b/r"], "--baseline": None})
    refuse_unless_remote([], {"RUN": "./run"})  # not given: nothing to refuse
