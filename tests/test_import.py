"""``grpolens import``: verl rollout JSONL dumps and MaxEnt rich-completion sidecars -> samples table.

Fixtures (``tests/data/import/``, written by hand for these tests):

* ``verl-rollouts/1.jsonl``: two prompts x 3 completions, scores 1/0/1 each, ``acc`` (bool),
  ``pred`` (text) and ``gts`` (text);
* ``verl-rollouts/2.jsonl``: two prompts x 2 completions interleaved (verl's balance_batch
  reorders rows), one completion with ``score: null``;
* ``maxent/rich_completions/rich_completions_step_00000{3,4}.json``: bare ``NaN`` literals,
  ``reward/accuracy`` and ``reward/format``; step 4 without prompt indices (-1).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

import grpolens
from grpolens.cli import main

DATA = Path(__file__).parent / "data" / "import"
VERL = DATA / "verl-rollouts"
MAXENT = DATA / "maxent"


def _samples(run: Path) -> pl.DataFrame:
    return pl.read_parquet(run / "samples" / "*" / "*.parquet", hive_partitioning=False).sort("sample_id")


def _run(*args) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_verl_jsonl(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run("import", "verl-jsonl", VERL, out) == 0
    printed = capsys.readouterr().out
    assert "imported 10 completions over 2 step(s)" in printed
    assert "CANNOT give" in printed and "no policy metrics" in printed and "characters" in printed
    s = _samples(out)
    assert s["step"].to_list() == [1] * 6 + [2] * 4
    assert s["sample_id"].to_list() == [1_000_000 + i for i in range(6)] + [2_000_000 + i for i in range(4)]
    # groups: by prompt text within the step; step 2's rows are interleaved A B A B
    assert s["group_id"].to_list() == [1_000_000] * 3 + [1_000_003] * 3 + [2_000_000, 2_000_001, 2_000_000, 2_000_001]
    assert s["reward"].to_list() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.5, None, 0.0]
    assert s["reward/acc"].to_list() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, None, 0.0]
    assert not [c for c in s.columns if c in ("reward/pred", "reward/gts", "reward/score", "reward/step")]
    assert s["completion_len"].to_list() == [1, 1, 4, 2, 2, 11, 1, 5, 27, 5]  # characters
    assert not s["truncated"].any()
    assert s["prompt"][0] == "Solve 2+2. [bold]Answer[/bold]:"  # kept verbatim (untrusted text)
    m = json.loads((out / "grpolens.json").read_text())
    assert m["trainer"]["name"] == "verl" and m["imported"]["per_token_data"] is False
    assert m["imported"]["length_unit"] == "characters" and not list(out.glob("tokens/**/*.parquet"))


def test_recompute_on_an_imported_run(tmp_path):
    """Samples-side metrics work; hand-computed: step 1 rewards 1,0,1 | 1,0,1 -> mean 4/6, no
    zero-std group; step 2 rewards 1,(null) | 0.5,0 -> mean 0.5, reward/acc mean 1/3."""
    out = tmp_path / "run"
    assert _run("import", "verl-jsonl", VERL, out) == 0
    df = grpolens.recompute(out, write=False)
    r1, r2 = df.row(0, named=True), df.row(1, named=True)
    assert r1["reward/mean"] == pytest.approx(4 / 6) and r2["reward/mean"] == pytest.approx(0.5)
    assert r1["reward/frac_zero_std"] == 0.0
    assert r2["rewards/acc/mean"] == pytest.approx(1 / 3)
    assert r1["completions/length/mean"] == pytest.approx((1 + 1 + 4 + 2 + 2 + 11) / 6)
    for name in ("entropy", "kl/k3", "clip/region", "policy/approx_kl"):
        if name in df.columns:
            assert df[name].null_count() == df.height  # no per-token data: nothing made up


def test_verl_token_lengths_and_truncation_with_a_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "run"
    assert _run("import", "verl-jsonl", VERL, out, "--tokenizer", path, "--max-response-length", 3) == 0
    s = _samples(out)
    # whitespace words (and punctuation) per completion: "13 is prime" = 3, "c-a-t" = c - a - t = 5, "six and then some more text" = 6
    assert s["completion_len"].to_list() == [1, 1, 1, 1, 1, 3, 1, 5, 6, 5]
    assert s["truncated"].to_list() == [l >= 3 for l in s["completion_len"].to_list()]
    assert json.loads((out / "grpolens.json").read_text())["imported"]["truncation_known"] is True


def test_maxent_sidecars_with_nan_literals(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run("import", "maxent-sidecars", MAXENT, out) == 0
    printed = capsys.readouterr().out
    # columns with values and no home are listed (q_mass is all NaN in this file: nothing is lost)
    assert "update_weight_raw" in printed and "advantages as the trainer logged them" in printed
    s = _samples(out)
    assert s["step"].to_list() == [3, 3, 3, 3, 4, 4, 4]
    # step 3: (step, prompt_index); step 4 has prompt_index -1: runs of equal prompt text q q r
    assert s["group_id"].to_list() == [3_000_000, 3_000_000, 3_000_001, 3_000_001, 4_000_000, 4_000_000, 4_000_002]
    assert s["reward"].to_list() == [1.0, 0.0, 0.5, 0.5, None, 2.0, 1.0]
    assert s["reward/accuracy"].to_list() == [1.0, 0.0, None, 0.5, None, 1.0, 1.0]
    assert s["reward/format"].to_list() == [0.0, 0.0, 0.5, None, 1.0, 1.0, 0.0]
    adv = s["advantage"].to_list()
    assert adv[:4] == pytest.approx([0.7071, -0.7071, 0.0, 0.0]) and all(math.isnan(a) for a in adv[4:])
    assert s["completion"].to_list() == ["a", "bb", "ccc", "dddd", "x", "yy", "zzz"]
    df = grpolens.recompute(out, write=False)
    assert df.row(0, named=True)["reward/frac_zero_std"] == 0.5  # group p1: 0.5, 0.5


def test_maxent_output_dir_or_sidecar_dir_and_key(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run("import", "maxent-sidecars", MAXENT / "rich_completions", a) == 0
    assert _samples(a).height == 7
    two = tmp_path / "two"
    two.mkdir()
    for f in (MAXENT / "rich_completions").iterdir():
        (two / f.name).write_bytes(f.read_bytes())
        (two / f.name.replace("rich_completions", "completions")).write_bytes(f.read_bytes())
    with pytest.raises(Exception, match="--key"):
        grpolens.adapters.importers.import_maxent_sidecars(two, b)
    assert not b.exists()
    assert _run("import", "maxent-sidecars", two, b, "--key", "completions") == 0


@pytest.mark.parametrize("content, message", [
    ('{"input": "p", "output": "o", "score": 1, "step": 1}\n{"input": "p", "out', "1.jsonl:2: not valid JSON"),
    ('{"input": "p", "score": 1, "step": 1}\n', "missing or non-text 'output'"),
    ('[1, 2]\n', "expected a JSON object"),
])
def test_bad_verl_files_fail_cleanly(tmp_path, capsys, content, message):
    src = tmp_path / "dump"
    src.mkdir()
    (src / "1.jsonl").write_text(content)
    out = tmp_path / "run"
    assert _run("import", "verl-jsonl", src, out) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".run.import-*"))


def test_bad_sidecar_and_existing_output(tmp_path, capsys):
    src = tmp_path / "side"
    src.mkdir()
    (src / "rich_completions_step_000001.json").write_text('{"columns": ["step", "completion"], "data": [[1]]}')
    assert _run("import", "maxent-sidecars", src, tmp_path / "x") == 2
    assert "data row 0 has 1 values for 2 columns" in capsys.readouterr().err
    out = tmp_path / "run"
    assert _run("import", "verl-jsonl", VERL, out) == 0
    assert _run("import", "verl-jsonl", VERL, out) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert _run("import", "verl-jsonl", VERL, out, "--overwrite") == 0
    other = tmp_path / "notarun"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert _run("import", "verl-jsonl", VERL, other, "--overwrite") == 2
    assert (other / "keep.txt").read_text() == "mine"


def test_unknown_source_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "import", "wandb", str(VERL), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown source 'wandb'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("content", ["{not json", "panics"])
def test_a_tokenizer_json_that_does_not_load_is_one_line_naming_it(tmp_path, capsys, content):
    """A tokenizer.json the library refuses, by an error or by a panic in its Rust code (a
    BaseException), is a user error naming the file, not a traceback; nothing is written."""
    pytest.importorskip("tokenizers")
    from tests.run.validate.test_joins import _panicking_tokenizer_json

    path = tmp_path / "tokenizer.json"
    path.write_text(_panicking_tokenizer_json() if content == "panics" else content)
    out = tmp_path / "run"
    assert _run("import", "verl-jsonl", VERL, out, "--tokenizer", path) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer: {path} is not a tokenizers JSON file (" in " ".join(err.split())
    assert "Traceback" not in err
    assert not out.exists()
