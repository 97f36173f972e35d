"""``grpolens sweep``: every grid point in one pass, each equal to a recompute with that config."""

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.metrics import engine
from grpolens.analysis.sweep import COLUMNS, parse_params, sweep
from tests.refdata import random_calls, write_run


def close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)


@pytest.mark.parametrize("level,base", [("token", [0.9, 1.1]), ("sequence", [0.75, 1.3])])
def test_sweep_equals_separate_recomputes(tmp_path, monkeypatch, level, base):
    rng = np.random.default_rng(3 if level == "token" else 4)
    calls = random_calls(rng, spread=0.45, nonfinite=0.03)
    cfg = {"level": level, "mode": "both", "lower": base[0], "upper": base[1], "veto_upper": 1.6}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": cfg}, parts=2, rng=rng)
    params = parse_params([f"rollout_is.upper={base[1]},{base[1] * 1.5}", "rollout_is.veto_lower=0.7,none",
                           "rollout_is.mode=both,icepop"])
    reads = []
    real = engine.read_tokens
    monkeypatch.setattr(engine, "read_tokens", lambda path, columns=engine.READ_COLUMNS: reads.append(path) or real(path, columns))
    df = sweep(run, params)
    assert len(reads) == len(fmt.list_shards(run, fmt.TOKENS))  # one pass, whatever the grid size
    monkeypatch.setattr(engine, "read_tokens", real)
    assert df.height == 2 * 8 and sorted(df["point"].unique().to_list()) == list(range(8))
    for point in range(8):
        sub = df.filter(pl.col("point") == point).sort("step")
        over = {"upper": sub["rollout_is.upper"][0], "veto_lower": sub["rollout_is.veto_lower"][0],
                "mode": sub["rollout_is.mode"][0]}
        ref = grpolens.recompute(run, overrides={"rollout_is": over}, write=False).sort("step")
        for k in COLUMNS:
            name = f"rollout_is/{k}"
            want = ref[name].to_list() if name in ref.columns else [None] * ref.height
            assert all(close(a, b) for a, b in zip(sub[k].to_list(), want)), (point, k, sub[k].to_list(), want)
    # the grid changes outcomes (otherwise the comparison above proves little)
    assert df["rejected/token_fraction"].n_unique() > 2 and df["veto/seq_fraction"].n_unique() > 1


def test_mask_band_follows_the_swept_band(tmp_path):
    calls = random_calls(np.random.default_rng(8), spread=0.45)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "mask", "threshold": [0.9, 1.1]}})
    df = sweep(run, parse_params(["rollout_is.upper=1.1,1.5"]))
    a, b = (df.filter(pl.col("point") == i)["mask/token_fraction"].sum() for i in (0, 1))
    assert a > b > 0


def test_param_errors(tmp_path):
    for bad, match in [(["upper=2"], "cannot be swept"), (["rollout_is.epsilon=1"], "cannot be swept"),
                       (["rollout_is.upper=2", "rollout_is.upper=3"], "given twice"), (["rollout_is.upper=abc"], "not a number"),
                       (["rollout_is.upper"], "expected"), ([], "at least one")]:
        with pytest.raises(UserError, match=match):
            parse_params(bad)
    calls = random_calls(np.random.default_rng(0))
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"threshold": [0.5, 2.0]}})
    with pytest.raises(UserError, match=r"grid point rollout_is.upper=0.4.*inverted"):
        sweep(run, parse_params(["rollout_is.upper=3,0.4"]))
    norollout = write_run(tmp_path / "plain", random_calls(np.random.default_rng(0), rollout=False))
    with pytest.raises(UserError, match="rollout_logp"):
        sweep(norollout, parse_params(["rollout_is.upper=2"]))


def test_cli_writes_table_and_chart(tmp_path, capsys):
    from grpolens.cli import main

    calls = random_calls(np.random.default_rng(1), spread=0.45)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"threshold": [0.8, 1.25]}})
    main(["sweep", str(run), "--param", "rollout_is.upper=1.25,2", "--param", "rollout_is.veto_lower=1e-3,0.8",
          "--level", "sequence", "--mode", "truncate", "--html", str(tmp_path / "s.html")])
    out = capsys.readouterr().out
    assert "4 grid point(s), 2 step(s)" in out and "removed" in out
    df = pl.read_parquet(run / "grpolens" / "sweep.parquet")
    assert df.height == 8 and set(df.columns) >= {"step", "point", "rollout_is.upper", "rollout_is.veto_lower", *COLUMNS}
    assert df["truncated_fraction"].is_not_null().all()
    html = (tmp_path / "s.html").read_text()
    assert "plotly" in html and "upper=1.25, veto_lower=0.001" in html
