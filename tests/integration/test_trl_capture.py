"""What GRPOLensTrainer records from real TRL training, checked against independent sources:
training is bit-identical without it, ids survive TRL's shuffle and reuse, the captured
log-probs equal a plain forward pass of the saved model, and the manifest carries TRL's config."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # real TRL training on CPU

import polars as pl  # noqa: E402

STRIDE = 1_000_000


def _tables(run):
    tokens = pl.read_parquet(run / "tokens" / "*" / "*.parquet", hive_partitioning=False)
    samples = pl.read_parquet(run / "samples" / "*" / "*.parquet", hive_partitioning=False)
    return tokens, samples


def test_training_is_unchanged(trl_run):
    """Same seed with and without grpolens: identical logged losses and grad norms at every step
    and bit-identical final weights (so identical gradients at every step)."""
    with_gl, without = trl_run("dapo"), trl_run("dapo", "--no-grpolens")
    a = json.loads((with_gl / "result.json").read_text())
    b = json.loads((without / "result.json").read_text())
    assert a["losses"] == b["losses"] and len(a["losses"]) == 4
    assert a["params_sha256"] == b["params_sha256"]
    assert not (without / "run").exists()
    import torch

    final_a, final_b = torch.load(with_gl / "params.pt"), torch.load(without / "params.pt")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    # the weights did move (the comparison above is not between two untrained models)
    from safetensors.torch import load_file

    start = load_file(str(with_gl / "model" / "model.safetensors"))
    assert any(not torch.equal(start[k], final_a[k]) for k in start if k in final_a)


def test_ids_steps_and_micro_batches(trl_run):
    out = trl_run("dapo")
    tokens, samples = _tables(out / "run")
    logged = [json.loads(line) for line in (out / "run" / "grpolens" / "trl_log.jsonl").read_text().splitlines()]
    gen_steps = sorted(r["step"] for r in logged if "num_tokens" in r)
    # samples are written at the step TRL logs their generation metrics; 2 loss calls per step
    assert sorted(samples["step"].unique().to_list()) == gen_steps == [1, 3]
    assert sorted(tokens["step"].unique().to_list()) == [1, 2, 3, 4]
    assert tokens.group_by("step").agg(pl.col("micro_batch").n_unique())["micro_batch"].to_list() == [2, 2, 2, 2]
    # ids: step * 1e6 + index; groups of num_generations=4 consecutive ids
    assert (samples["sample_id"] // STRIDE == samples["step"]).all()
    assert (samples["group_id"] == samples["step"] * STRIDE + (samples["sample_id"] % STRIDE) // 4).all()
    assert samples["sample_id"].n_unique() == samples.height == 32
    # every completion is trained on in its generation step and reused once in the next (num_iterations=2)
    seen = tokens.select("step", "sample_id").unique()
    for sid, step in samples.select("sample_id", "step").iter_rows():
        assert sorted(seen.filter(pl.col("sample_id") == sid)["step"].to_list()) == [step, step + 1]
    # within a step the two micro-batches hold different completions (the shuffle split them)
    per_mb = tokens.select("step", "micro_batch", "sample_id").unique()
    assert per_mb.group_by("step", "sample_id").len()["len"].max() == 1


def test_rows_follow_their_ids_through_the_shuffle(trl_run):
    """Each token row agrees with the samples row of its id: advantage, length, EOS and token count.
    A mix-up by TRL's shuffle would pair rows with the wrong completion."""
    out = trl_run("dapo")
    tokens, samples = _tables(out / "run")
    eos = json.loads((out / "model" / "generation_config.json").read_text())["eos_token_id"]
    seqs = tokens.group_by("step", "micro_batch", "sample_id").agg(
        pl.len().alias("n"), pl.col("advantage").first().alias("adv"), pl.col("advantage").n_unique().alias("n_adv"),
        pl.col("token_id").sort_by("pos").last().alias("last_token"), pl.col("pos").max().alias("max_pos"))
    joined = seqs.join(samples, on="sample_id", how="left")
    assert joined["completion_len"].null_count() == 0
    assert (joined["n_adv"] == 1).all()
    assert np.allclose(joined["adv"].to_numpy(), joined["advantage"].to_numpy(), rtol=0, atol=0)
    assert (joined["n"] == joined["completion_len"]).all() and (joined["max_pos"] == joined["n"] - 1).all()
    assert ((joined["last_token"] == eos) == ~joined["truncated"]).all()
    assert joined["truncated"].any() and (~joined["truncated"]).any()


def test_captured_logps_equal_a_plain_forward_pass(trl_run):
    """At step 1 (no optimizer step yet) the current, old and reference log-probs and the entropy
    that entered TRL's loss equal log_softmax(logits / T) of the saved initial model."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.integration.trl_tiny import build_tokenizer

    out = trl_run("dr_grpo")  # temperature 0.7: every log-prob is of logits / T
    tokens, samples = _tables(out / "run")
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    tok = build_tokenizer()
    temp = json.loads((out / "run" / "grpolens.json").read_text())["config"]["temperature"]
    assert temp == 0.7
    step1 = tokens.filter(pl.col("step") == 1).sort("sample_id", "pos")
    checked = 0
    for sid, prompt, plen in samples.filter(pl.col("step") == 1).select("sample_id", "prompt", "prompt_len").iter_rows():
        rows = step1.filter(pl.col("sample_id") == sid)
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        assert len(ids) == plen
        comp = rows["token_id"].to_list()
        with torch.no_grad():
            logits = model(torch.tensor([ids + comp])).logits[0, len(ids) - 1:-1].float() / temp
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all[torch.arange(len(comp)), torch.tensor(comp)].numpy()
        ent = -(logp_all.exp() * logp_all).sum(-1).numpy()
        for col in ("logp", "old_logp", "ref_logp"):
            np.testing.assert_allclose(rows[col].to_numpy(), logp, rtol=0, atol=2e-5, err_msg=col)
        np.testing.assert_allclose(rows["entropy"].to_numpy(), ent, rtol=0, atol=2e-5)
        checked += 1
    assert checked == 16


def test_manifest_records_trl_config(trl_run):
    out = trl_run("gspo")
    m = json.loads((out / "run" / "grpolens.json").read_text())
    import trl

    assert m["trainer"] == {"name": "trl", "version": trl.__version__}
    c = m["config"]
    assert (c["loss_type"], c["importance_sampling_level"], c["epsilon"], c["epsilon_high"], c["beta"]) == \
        ("grpo", "sequence", 0.01, 0.015, 0.04)
    assert (c["gradient_accumulation_steps"], c["steps_per_generation"], c["num_iterations"]) == (2, 2, 2)
    assert c["reward_weights"] == {"count_a": 1.0, "brevity": 1.0} and c["rollout_is"] is None
    assert c["use_bias_correction_kl"] is True and c["trl_args"]["max_completion_length"] == 12
    m_is = json.loads((trl_run("is_token_truncate") / "run" / "grpolens.json").read_text())
    assert m_is["config"]["rollout_is"]["vllm_importance_sampling_mode"] == "token_truncate"
    _, samples = _tables(trl_run("dr_grpo") / "run")
    assert samples["reward/sometimes_none"].null_count() > 0  # None rewards stored as null


def test_rollout_logps_recorded_with_simulated_engine(trl_run):
    tokens, _ = _tables(trl_run("is_sequence_mask") / "run")
    assert tokens["rollout_logp"].null_count() == 0
    d = (tokens["rollout_logp"] - tokens["old_logp"]).abs()
    assert 0 < d.mean() < 0.2  # the simulated engine differs from the trainer by N(0, 0.05) noise


def test_tokenizer_json_decodes_the_recorded_ids_to_trl_text(trl_run):
    """The run's tokenizer.json is the training tokenizer: the recorded token ids of every
    completion decode to exactly the text TRL itself decoded (the samples' completion column), and
    the views decode with it, reusing a step's completions at the next step by sample_id."""
    from tokenizers import Tokenizer

    from grpolens.analysis.sidecars import build_steps
    from grpolens.run.decode import make_decoder

    run = trl_run("dapo") / "run"
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    tokens, samples = _tables(run)
    gen = tokens.join(samples.select("step", "sample_id"), on=["step", "sample_id"])  # rows at the generating step
    first = gen.sort("rank", "micro_batch").unique(["sample_id", "pos"], keep="first").sort("sample_id", "pos")
    ids = first.group_by("sample_id", maintain_order=True).agg("token_id")
    texts = dict(samples.select("sample_id", "completion").iter_rows())
    assert ids.height == samples.height
    for sid, tids in ids.iter_rows():
        assert tok.decode(tids, skip_special_tokens=True) == texts[sid]
    decode, source = make_decoder(run, {})
    assert source == "tokenizer.json" and decode(int(first["token_id"][0])) == tok.decode([int(first["token_id"][0])])
    # step 2 generated nothing (samples at steps 1 and 3 only) but trains on step 1's completions
    table = build_steps(run, [2])
    trained = set(tokens.filter(pl.col("step") == 2)["sample_id"].to_list())
    assert set(table["sample_id"].to_list()) == trained and set(table["generated_at_step"].to_list()) == {1}
    assert all(t == texts[s] for s, t in table.select("sample_id", "completion").iter_rows())
