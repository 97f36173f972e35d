"""The verl adapter on batches built the way verl's actor sees them (verl itself is not installed).

A step is simulated as in ``DataParallelPPOActor.update_policy``: ``begin_step(data)``, then
``data.select(keys)``, a shuffled split into mini-batches, a split into micro-batches, a forward
per micro-batch (here: random log-probs and entropies) and ``log_micro_batch``. The run is then
checked against the padded arrays with numpy: row identity, masks, and a few metrics recomputed
by grpolens against their formulas.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import grpolens
from grpolens.integrations.verl import VerlCapture, group_id_of, verl_config
from grpolens.run.validate import validate_run

EOS, PAD = 2, 0


def make_batch(rng: np.random.Generator, n_groups=3, group=4, prompt_w=5, resp_w=7, rejected_row=1):
    """A verl-style DataProto: left-padded prompts, right-padded responses, per-token tensors."""
    B = n_groups * group
    p_len = rng.integers(2, prompt_w + 1, B)
    r_len = rng.integers(1, resp_w + 1, B)
    r_len[0] = resp_w  # one response that fills the width
    prompts = torch.full((B, prompt_w), PAD)
    responses = torch.full((B, resp_w), PAD)
    attn = torch.zeros(B, prompt_w + resp_w, dtype=torch.int64)
    for i in range(B):
        prompts[i, prompt_w - p_len[i]:] = torch.tensor(rng.integers(3, 50, p_len[i]))
        toks = rng.integers(3, 50, r_len[i])
        if r_len[i] < resp_w or i % 2:  # most end with EOS; row 0 (full width, even) does not
            toks[-1] = EOS
        responses[i, : r_len[i]] = torch.tensor(toks)
        attn[i, prompt_w - p_len[i]:prompt_w + r_len[i]] = 1
    resp_attn = attn[:, prompt_w:].clone()
    response_mask = resp_attn.clone()
    response_mask[rejected_row] = 0  # rollout rejection: a real response that does not count in the loss

    def tok(scale=1.0, shift=0.0):
        return (torch.tensor(rng.normal(shift, scale, (B, resp_w)), dtype=torch.float32) * resp_attn)

    scores = torch.zeros(B, resp_w)
    score = rng.integers(0, 2, B).astype(float)
    for i in range(B):
        scores[i, r_len[i] - 1] = score[i]
    adv = torch.tensor(rng.normal(size=B), dtype=torch.float32)[:, None] * response_mask
    # log-probs at most -0.5, so that the noisy ref/rollout/current ones below stay log-probs (<= 0)
    old = -torch.tensor(0.5 + rng.exponential(1.0, (B, resp_w)), dtype=torch.float32) * resp_attn
    batch = {
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attn, "responses": responses,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": response_mask,
        "old_log_probs": old, "ref_log_prob": old + tok(0.1), "rollout_log_probs": old + tok(0.05),
        "advantages": adv, "token_level_scores": scores, "token_level_rewards": scores * 0.5,
    }
    group_uids = [f"uid-{g}-{rng.integers(1 << 30)}" for g in range(n_groups)]
    uids = np.array([u for u in group_uids for _ in range(group)], dtype=object)
    non_tensor = {"uid": uids, "acc": score.astype(bool), "score": score,
                  "pred": np.array(["x"] * B, dtype=object), "index": np.arange(B)}
    return SimpleNamespace(batch=batch, non_tensor_batch=non_tensor, meta_info={"global_steps": 7})


def update_policy(capture, data, rng, mini=6, micro=2, keys_extra=True):
    """verl's loop shape: select keys, shuffle, mini-batches, micro-batches, forward, record."""
    capture.begin_step(data)
    keys = ["responses", "response_mask", "input_ids", "attention_mask", "position_ids", "old_log_probs",
            "advantages", "ref_log_prob", "rollout_log_probs"]
    if keys_extra:
        keys.append(VerlCapture.SAMPLE_ID_KEY)
    selected = {k: data.batch[k] for k in keys}
    perm = torch.tensor(rng.permutation(len(selected["responses"])))
    selected = {k: v[perm] for k, v in selected.items()}
    forwards = []
    for m0 in range(0, len(perm), mini):
        for u0 in range(m0, m0 + mini, micro):
            mb = {k: v[u0:u0 + micro] for k, v in selected.items()}
            valid = mb["attention_mask"][:, -mb["responses"].shape[1]:].float()
            log_prob = mb["old_log_probs"] + torch.tensor(rng.normal(0, 0.05, valid.shape), dtype=torch.float32) * valid
            entropy = torch.tensor(rng.uniform(0.5, 3.0, valid.shape), dtype=torch.float32) * valid
            capture.log_micro_batch(mb, log_prob=log_prob, entropy=entropy)
            forwards.append((mb, log_prob, entropy))
    capture.end_step()
    return forwards


@pytest.fixture
def recorded(tmp_path):
    rng = np.random.default_rng(0)
    data = make_batch(rng)
    run = tmp_path / "run"
    cap = VerlCapture(run, config=verl_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": True,
                                                "kl_loss_coef": 0.01, "loss_agg_mode": "token-mean"}),
                      rank=0, world_size=1, eos_token_id=EOS)
    forwards = update_policy(cap, data, rng)
    cap.close()
    return run, data, forwards


def _read(run, table):
    import polars as pl

    return pl.read_parquet(run / table / "*" / "*.parquet", hive_partitioning=False)


def test_samples_from_the_verl_batch(recorded):
    run, data, _ = recorded
    s = _read(run, "samples").sort("sample_id")
    b, nt = data.batch, data.non_tensor_batch
    W = b["responses"].shape[1]
    lens = b["attention_mask"][:, -W:].sum(-1).numpy()
    assert s["step"].unique().to_list() == [7]  # meta_info["global_steps"]
    assert (s["sample_id"].to_numpy() == 7 * 1_000_000 + np.arange(len(lens))).all()
    assert (s["completion_len"].to_numpy() == lens).all()
    assert (s["prompt_len"].to_numpy() == b["attention_mask"][:, :-W].sum(-1).numpy()).all()
    last = b["responses"][torch.arange(len(lens)), torch.tensor(lens) - 1].numpy()
    assert (s["truncated"].to_numpy() == ((lens == W) & (last != EOS))).all() and s["truncated"].any()
    assert (s["group_id"].to_numpy() == np.array([group_id_of(u) for u in nt["uid"]])).all()
    assert s["group_id"].n_unique() == 3
    np.testing.assert_array_equal(s["reward"].to_numpy(), b["token_level_scores"].sum(-1).numpy())
    np.testing.assert_array_equal(s["reward/acc"].to_numpy(), nt["acc"].astype(float))
    assert "reward/pred" not in s.columns and "reward/index" not in s.columns and "reward/uid" not in s.columns
    np.testing.assert_array_equal(s["advantage"].to_numpy(), b["advantages"][:, 0].numpy())


def test_tokens_follow_their_rows(recorded):
    """Each stored token equals the original batch row of its sample id, whatever the shuffle."""
    run, data, forwards = recorded
    t = _read(run, "tokens")
    b = data.batch
    W = b["responses"].shape[1]
    valid = b["attention_mask"][:, -W:].bool().numpy()
    assert t.height == valid.sum()
    assert t.group_by("step", "micro_batch").len().height == len(forwards) == 6
    for row in range(len(valid)):
        r = t.filter(t["sample_id"] == 7 * 1_000_000 + row).sort("pos")
        n = valid[row].sum()
        assert r.height == n
        for col, key in (("old_logp", "old_log_probs"), ("ref_logp", "ref_log_prob"),
                         ("rollout_logp", "rollout_log_probs"), ("advantage", "advantages")):
            np.testing.assert_array_equal(r[col].to_numpy(), b[key][row, :n].numpy(), err_msg=col)
        assert (r["token_id"].to_numpy() == b["responses"][row, :n].numpy()).all()
        assert (r["mask"].to_numpy() == b["response_mask"][row, :n].bool().numpy()).all()
    assert not t.filter(t["sample_id"] == 7 * 1_000_000 + 1)["mask"].any()  # the rejected row


def test_recompute_on_the_adapters_run(recorded):
    """entropy, KL to the reference and reward against numpy on the padded arrays."""
    run, data, forwards = recorded
    df = grpolens.recompute(run, write=False)
    ent_num = ent_den = kl_num = 0.0
    for mb, logp, ent in forwards:
        m = mb["response_mask"].double()
        ent_num += float((ent.double() * m).sum())
        ent_den += float(m.sum())
        x = mb["ref_log_prob"].double() - logp.double()
        kl_num += float(((torch.exp(x) - x - 1) * m).sum())
    row = df.row(0, named=True)
    assert row["step"] == 7
    assert row["entropy"] == pytest.approx(ent_num / ent_den, rel=1e-6)
    assert row["kl/k3"] == pytest.approx(kl_num / ent_den, rel=1e-5)
    assert row["reward/mean"] == pytest.approx(float(data.batch["token_level_scores"].sum(-1).double().mean()), rel=1e-12)


def test_missing_id_key_is_a_clear_error(tmp_path):
    rng = np.random.default_rng(1)
    cap = VerlCapture(tmp_path / "run", rank=0, world_size=1)
    with pytest.raises(KeyError, match="select_keys"):
        update_policy(cap, make_batch(rng), rng, keys_extra=False)
    cap.close()
    with pytest.raises(RuntimeError, match="begin_step"):
        VerlCapture(tmp_path / "run2", rank=0, world_size=1).log_micro_batch({}, log_prob=torch.zeros(1, 1))


def test_ranks_and_steps_get_distinct_ids(tmp_path):
    rng = np.random.default_rng(2)
    run = tmp_path / "run"
    for rank in (0, 1):
        cap = VerlCapture(run, rank=rank, world_size=2)
        for step in (1, 2):
            d = make_batch(rng)
            d.meta_info = {}
            cap.begin_step(d, step=step)
            cap.end_step()
        cap.close()
    s = _read(run, "samples")
    assert s["sample_id"].n_unique() == s.height == 2 * 2 * 12
    assert s.group_by("step", "rank").len().height == 4


def test_disabled_writes_nothing_but_keeps_ids(tmp_path):
    rng = np.random.default_rng(3)
    cap = VerlCapture(tmp_path / "run", rank=0, world_size=1, enabled=False)
    update_policy(cap, make_batch(rng), rng)
    cap.close()
    assert not (tmp_path / "run").exists()


def test_verl_config_mapping():
    c = verl_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": True, "kl_loss_coef": 0.001,
                     "policy_loss": {"loss_mode": "gspo"}},
                    {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}})
    assert (c["epsilon"], c["epsilon_high"], c["beta"], c["importance_sampling_level"]) == (0.2, 0.28, 0.001, "sequence")
    assert c["rollout_is"] == {"rollout_is": "token", "rollout_is_threshold": 2.0}
    assert verl_config({"use_kl_loss": False, "kl_loss_coef": 0.1})["beta"] == 0.0
    from grpolens.run.config import check_config
    from grpolens.run.format import CONFIG_DEFAULTS

    check_config({**CONFIG_DEFAULTS, **c})  # a config grpolens accepts


def test_module_does_not_import_verl(monkeypatch):
    """Re-executing the module with every `verl` import made to fail: it loads all the same."""
    import importlib

    import grpolens.integrations.verl as mod

    class NoVerl:
        def find_spec(self, name, path=None, target=None):
            if name == "verl" or name.startswith("verl."):
                raise ImportError("verl must not be imported by grpolens.integrations.verl")
            return None

    monkeypatch.setattr(sys, "meta_path", [NoVerl(), *sys.meta_path])
    importlib.reload(mod)
    assert not any(m == "verl" or m.startswith("verl.") for m in sys.modules)


def test_pre_rejection_mask_and_old_entropy_are_kept(tmp_path):
    """The two optional batch keys verl's driver does not keep: the response mask before rollout
    rejection (stored as ``rollout_rejected`` = before & ~after) and the old-log-prob pass'
    entropies (``old_entropy``), each token from its own row whatever the shuffle."""
    rng = np.random.default_rng(4)
    data = make_batch(rng, rejected_row=1)
    b = data.batch
    W = b["responses"].shape[1]
    before = b["attention_mask"][:, -W:].clone()
    b[VerlCapture.PRE_REJECTION_MASK_KEY] = before
    b[VerlCapture.OLD_ENTROPY_KEY] = torch.tensor(rng.uniform(0.1, 2.0, (len(before), W)), dtype=torch.float32) * before
    run = tmp_path / "run"
    cap = VerlCapture(run, config=verl_config({}, {"rollout_correction": {"rollout_is": "token"}}), rank=0, world_size=1)
    update_policy(cap, data, rng)
    cap.close()
    t = _read(run, "tokens")
    for row in range(len(before)):
        r = t.filter(t["sample_id"] == 7 * 1_000_000 + row).sort("micro_batch", "pos")
        n = int(before[row].sum())
        want = (before[row, :n].bool() & ~b["response_mask"][row, :n].bool()).numpy()
        assert (r["rollout_rejected"].to_numpy() == want).all()
        np.testing.assert_array_equal(r["old_entropy"].to_numpy(), b[VerlCapture.OLD_ENTROPY_KEY][row, :n].numpy())
    assert t.filter(t["sample_id"] == 7 * 1_000_000 + 1)["rollout_rejected"].all()  # the rejected row
    report = validate_run(run)
    assert report.ok, report.problems
    # the rollout-correction metrics count the tokens before rejection: every real token here
    row = grpolens.recompute(run, write=False).row(0, named=True)
    assert row["rollout_is/valid_tokens"] == before.sum().item()
    assert row["rollout_is/valid_tokens"] > b["response_mask"].sum().item()


def test_without_the_optional_keys_nothing_is_invented(recorded):
    run, data, _ = recorded
    t = _read(run, "tokens")
    assert "rollout_rejected" not in t.columns and "old_entropy" not in t.columns
    row = grpolens.recompute(run, write=False).row(0, named=True)
    assert row["rollout_is/valid_tokens"] == data.batch["response_mask"].sum().item()


def test_optional_key_of_the_wrong_shape_is_a_clear_error(tmp_path):
    rng = np.random.default_rng(5)
    data = make_batch(rng)
    data.batch[VerlCapture.PRE_REJECTION_MASK_KEY] = torch.ones(3, 2)
    cap = VerlCapture(tmp_path / "run", rank=0, world_size=1)
    with pytest.raises(ValueError, match=VerlCapture.PRE_REJECTION_MASK_KEY):
        cap.begin_step(data)
    cap.close()


@pytest.mark.parametrize("keep_mask", [False, True])
def test_rejection_without_the_mask_before_it_says_so(tmp_path, keep_mask):
    rng = np.random.default_rng(6)
    data = make_batch(rng)
    if keep_mask:
        W = data.batch["responses"].shape[1]
        data.batch[VerlCapture.PRE_REJECTION_MASK_KEY] = data.batch["attention_mask"][:, -W:].clone()
    corr = {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}
    cap = VerlCapture(tmp_path / "run", config=verl_config({}, {"rollout_correction": corr}), rank=0, world_size=1)
    update_policy(cap, data, rng)
    cap.close()
    notes = grpolens.recompute(tmp_path / "run", profile="verl", write=False, result=True).notes
    said = [n for n in notes if n.startswith("no rollout_rejected in this run")]
    assert len(said) == (0 if keep_mask else 1)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_logs_the_loss_side_rollout_correction(tmp_path, loss_type):
    """verl's bypass mode does its rollout correction inside the loss, per micro-batch: no
    driver-side rollout_corr/* (verl logs none), actor/rollout_corr/* and actor/* instead (the
    values are checked against verl's own code in tests/reference); REINFORCE reports no clip
    fractions; nothing is said to be missing."""
    rng = np.random.default_rng(7)
    data = make_batch(rng)
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"]  # apply_bypass_mode
    corr = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": True, "loss_type": loss_type}
    cap = VerlCapture(tmp_path / "run", config=verl_config({"ppo_mini_batch_size": 3, "rollout_n": 4},
                                                           {"rollout_correction": corr}), rank=0, world_size=1)
    update_policy(cap, data, rng)
    cap.close()
    res = grpolens.recompute(tmp_path / "run", profile="verl", write=False, result=True)
    got = {k for k, v in res.metrics.row(0, named=True).items() if v is not None}
    assert not [k for k in got if k.startswith("rollout_corr/")]
    assert {"actor/rollout_corr/rollout_is_mean", "actor/rollout_corr/kl", "actor/pg_loss", "actor/ppo_kl"} <= got
    assert ("actor/pg_clipfrac" in got) == (loss_type == "ppo_clip")
    assert not [n for n in res.notes if "bypass" in n]


def test_batch_normalize_reaches_the_config_and_a_bad_value_is_one_line():
    from grpolens.functional.rollout_is import ISConfig
    from grpolens.errors import UserError
    from grpolens.run.config import check_config as _check
    from grpolens.run.format import CONFIG_DEFAULTS

    check_config = lambda cfg: _check({**CONFIG_DEFAULTS, **cfg})  # noqa: E731
    corr = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}
    assert ISConfig.from_cfg(check_config(verl_config({}, {"rollout_correction": corr}))).batch_normalize
    # verl normalises only weights it computes: nothing without rollout_is
    assert not ISConfig.from_cfg(check_config(verl_config({}, {"rollout_correction": {**corr, "rollout_is": None}}))).batch_normalize
    # off (verl's default) where IS is on: the normalised config leaves the key out, which reads as false
    for off in ({"rollout_is_batch_normalize": False}, {}):
        plain = {k: v for k, v in corr.items() if k != "rollout_is_batch_normalize"} | off
        isc = ISConfig.from_cfg(check_config(verl_config({}, {"rollout_correction": plain})))
        assert isc.configured and not isc.batch_normalize
    with pytest.raises(UserError, match="rollout_is.batch_normalize.*true or false"):
        check_config({"rollout_is": {"rollout_is": "token", "rollout_is_threshold": 2.0, "batch_normalize": "yes"}})


def test_bypass_batch_normalize_shares_the_factor_of_calls_made_together(tmp_path):
    """verl all-reduces the bypass-mode loss' weight mean over the ranks' k-th calls: a two-rank
    run gets one factor per group of calls made together, the mean of their weights together
    (values against verl's own code: tests/reference)."""
    corr = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": True, "loss_type": "reinforce",
            "rollout_is_batch_normalize": True}
    cfg = verl_config({"ppo_mini_batch_size": 6, "rollout_n": 4}, {"rollout_correction": corr})
    for r in range(2):
        rng = np.random.default_rng(20 + r)
        data = make_batch(rng)
        data.batch["old_log_probs"] = data.batch["rollout_log_probs"]
        cap = VerlCapture(tmp_path / "run", config=cfg, rank=r, world_size=2)
        update_policy(cap, data, rng)
        cap.close()
    res = grpolens.recompute(tmp_path / "run", profile="verl", write=False, result=True)
    row = res.metrics.row(0, named=True)
    assert row["actor/pg_loss"] is not None and row["actor/rollout_corr/rollout_is_batch_norm_factor"] is not None
    assert not [n for n in res.notes if "batch_normalize" in n]


def test_legacy_trainer_needs_its_response_length():
    """verl's legacy trainer (trainer.use_v1: false) pads responses to rollout.response_length,
    which -norm aggregation divides by; the default trainer pads to the longest response."""
    assert "verl_rollout" not in verl_config({}, {}, rollout={"response_length": 64}, trainer={"use_v1": True})
    assert verl_config({}, {}, rollout={"response_length": 64}, trainer={"use_v1": False})["verl_rollout"] == {"response_length": 64}
    with pytest.raises(ValueError, match="rollout.response_length"):
        verl_config({}, {}, trainer={"use_v1": False})
