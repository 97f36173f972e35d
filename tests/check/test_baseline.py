"""Golden files (``grpolens.check.baseline``): what is written, what is read back, and every
refusal in full; a baseline directory that is not a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpolens.check.baseline import read_golden
from grpolens.errors import UserError

from tests.check.golden_files import GOLDEN, golden_file


def test_golden_json_encodes_non_finite_values_and_leaves_out_missing_steps():
    import datetime as dt

    import polars as pl

    import grpolens
    from grpolens.check.baseline import golden_json
    from grpolens.run.format import read_manifest

    run = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"
    df = pl.DataFrame({"step": [3, 0, 1, 2, 4], "m": [float("-inf"), 1.5, float("nan"), float("inf"), None],
                       "other": [0.0] * 5})
    g = golden_json(df, ["m"], run=run, overrides=None, rules_source="rules.toml")
    assert g["metrics"] == {"m": {"values": {"0": 1.5, "1": "nan", "2": "inf", "3": "-inf"}}}  # step 4: no value
    assert g["steps"] == [0, 1, 2, 3, 4] and g["overrides"] == {} and g["rules"] == "rules.toml"
    assert (g["format"], g["version"], g["grpolens_version"]) == ("grpolens-golden", 1, grpolens.__version__)
    assert (g["run"], g["run_name"]) == (str(run), read_manifest(run).run_name)
    created = dt.datetime.fromisoformat(g["created"])
    assert created.utcoffset() == dt.timedelta(0) and created.microsecond == 0
    assert golden_json(df, ["m"], run=run, overrides={"epsilon": 0.1}, rules_source="x")["overrides"] == {"epsilon": 0.1}


def test_golden_file_is_written_one_value_a_line_in_the_order_given(tmp_path):
    from grpolens.check.baseline import write_golden

    write_golden(tmp_path / "g.json", {"b": 1, "a": [2]})
    assert (tmp_path / "g.json").read_text() == '{\n "b": 1,\n "a": [\n  2\n ]\n}\n'
    with pytest.raises(UserError) as e:
        write_golden(tmp_path / "nowhere" / "g.json", {})
    assert e.value.message == f"--write-golden: directory {tmp_path / 'nowhere'} does not exist"


def test_golden_file_is_read_back(tmp_path):
    import math

    p = golden_file(tmp_path, GOLDEN)
    b = read_golden(p)
    # the steps the golden lists, step 4 without a value included (what the coverage rule counts)
    assert b.label == f"{p} (golden of exp-1)" and b.steps == [0, 1, 2, 3, 4] and b.overrides == {"epsilon": 0.1}
    s = b.series["m"]
    assert s.steps.tolist() == [0, 1, 2, 3] and math.isnan(s.values[0])
    assert s.values[1:].tolist() == [1.5, float("inf"), float("-inf")]
    # older or hand-written forms: steps from the values, the run's path for a label, no overrides
    p = golden_file(tmp_path, {**GOLDEN, "run_name": None, "steps": [0, True], "overrides": "x",
                           "metrics": {"m": {"values": {"5": 1, "2": 0}}, "n": {"values": {"7": 1.0}}}})
    b = read_golden(p)
    assert b.label == f"{p} (golden of runs/a)" and b.steps == [2, 5, 7] and b.overrides == {}
    assert b.series["m"].values.tolist() == [0.0, 1.0]
    b = read_golden(golden_file(tmp_path, {**GOLDEN, "run_name": "", "run": None, "steps": "0..3", "version": 0}))
    assert b.label == f"{p} (golden of ?)" and b.steps == [0, 1, 2, 3]
    b = read_golden(golden_file(tmp_path, {k: v for k, v in GOLDEN.items() if k != "steps"}))
    assert b.steps == [0, 1, 2, 3]


@pytest.mark.parametrize("data,msg", [
    ([1], 'not a grpolens golden file (expected "format": "grpolens-golden"; write one with '
          '`grpolens check RUN --write-golden FILE`)'),
    ({**GOLDEN, "format": "grpolens"}, 'not a grpolens golden file (expected "format": "grpolens-golden"; write one '
                                       'with `grpolens check RUN --write-golden FILE`)'),
    ({**GOLDEN, "version": 2}, "golden version 2 is not one this grpolens reads (1)"),
    ({**GOLDEN, "version": "1"}, "golden version '1' is not one this grpolens reads (1)"),
    ({k: v for k, v in GOLDEN.items() if k != "version"}, "golden version None is not one this grpolens reads (1)"),
    ({**GOLDEN, "metrics": [1]}, "'metrics' must be an object of metric -> {\"values\": {step: value}}"),
    ({**GOLDEN, "metrics": {"m": 3}}, 'metrics.m: expected {"values": {step: value}}'),
    ({**GOLDEN, "metrics": {"m": {"vals": {}}}}, 'metrics.m: expected {"values": {step: value}}'),
    ({**GOLDEN, "metrics": {"m": {"values": {"x": 1.0}}}}, "metrics.m: step 'x' is not an integer"),
    ({**GOLDEN, "metrics": {"m": {"values": {"0": "NaN"}}}},
     'metrics.m.values.0: expected a number (or "nan", "inf", "-inf"), got \'NaN\''),
    ({**GOLDEN, "metrics": {"m": {"values": {"2": True}}}},
     'metrics.m.values.2: expected a number (or "nan", "inf", "-inf"), got True'),
    ({**GOLDEN, "metrics": {"m": {"values": {"2": None}}}},
     'metrics.m.values.2: expected a number (or "nan", "inf", "-inf"), got None'),
])
def test_golden_file_refused(tmp_path, data, msg):
    p = golden_file(tmp_path, data)
    with pytest.raises(UserError) as e:
        read_golden(p)
    assert e.value.message == f"--baseline {p}: {msg}"


def test_golden_file_that_is_not_json_or_not_text(tmp_path):
    p = golden_file(tmp_path, '{"format": "grpolens-golden",\n "version": }')
    with pytest.raises(UserError) as e:
        read_golden(p)
    assert e.value.message.startswith(f"--baseline {p}:2: not valid JSON: Expecting value")
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError) as e:
        read_golden(p)
    assert e.value.message.startswith(f"--baseline {p}: cannot read: 'utf-8' codec can't decode")


def test_baseline_directory_that_is_not_a_run(tmp_path):
    from grpolens.check.baseline import load_baseline

    with pytest.raises(UserError) as e:
        load_baseline(tmp_path, None)
    assert e.value.message == f"--baseline: {tmp_path} is a directory but not a grpolens run (no grpolens.json)"
    with pytest.raises(UserError) as e:
        load_baseline(str(tmp_path / "nothing"), None)
    assert e.value.message == f"--baseline: no such run directory or golden file {tmp_path / 'nothing'}"
