"""``grpolens export --explain``: each step a built-in check rule flags, explained, as a tracker
table -- the rows themselves, and the table in a real W&B offline run."""

from __future__ import annotations

import json

import pytest

from grpolens.adapters.synth import synth_run


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("spike") / "run", steps=6, max_len=48, seed=2, inject=["kl-spike@4"])


def test_rows_explain_the_flagged_step(spiked):
    from grpolens.export import explanations

    df = explanations.table(spiked)
    kl = df.filter(df["metric"] == "kl/k3")
    assert set(kl["step"].to_list()) == {4} and set(kl["dimension"].to_list()) == {"token_id", "group", "completion"}
    for dim in ("token_id", "group", "completion"):
        part = kl.filter(kl["dimension"] == dim)
        assert part["contribution"].sum() == pytest.approx(part["delta"][0], rel=1e-9)
    assert kl["headline"][0].startswith("kl/k3 ") and "at step 4 (+" in kl["headline"][0]
    assert explanations.table(spiked, steps=[0, 1]) is None  # only the steps being exported


def test_explain_needs_a_table_type(cli, spiked):
    r = cli("export", spiked, "--to", "tensorboard", "--explain", "-q")
    assert r.code == 2 and "--explain: tensorboard has no table type" in r.err


@pytest.mark.slow  # wandb starts its service process: ~20 s
def test_wandb_offline_run_holds_the_table(cli, spiked, tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    assert cli("export", spiked, "--to", "wandb", "--explain", "-q").code == 0
    files = sorted((spiked / "grpolens" / "wandb").glob("offline-run-*/files/media/table/grpolens/tables/explanations_*.table.json"))
    assert len(files) == 1
    t = json.loads(files[0].read_text())
    rows = [dict(zip(t["columns"], r)) for r in t["data"]]
    assert {r["step"] for r in rows if r["metric"] == "kl/k3"} == {4}
    assert any(r["dimension"] == "token_id" and r["rank"] == 1 for r in rows)
