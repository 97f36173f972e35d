"""verl's KL-Cov and Clip-Cov losses (grpolens/metrics/verl_cov.py) against an independent numpy
transcription of verl 0.9.1's formulas, on random ragged steps and edge cases, plus hand-worked
examples. verl's own code judges them in tests/reference/test_verl_reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grpolens
from grpolens.metrics.verl_cov import clip_cov_choice, covariance, kl_cov_choice
from tests.metrics.test_verl_actor import verl_run

NAN = np.nan


def values(run) -> dict:
    df = grpolens.recompute(run, profile="verl", write=False)
    return {k: v for k, v in df.row(0, named=True).items() if k.startswith("actor/") and v is not None}


def reference(logp, old, adv, calls, mode: str, policy: dict, clip=(0.2, 0.2)) -> dict:
    """verl's compute_policy_loss_kl_cov / _clip_cov per call (token-mean, one mini-batch, one rank),
    written from its source: flattened valid tokens row by row, float32 covariance, torch.topk for
    KL-Cov's choice; Clip-Cov only where its candidates are no more than clip_num (no draw)."""
    logp, old, adv = (np.asarray(x, dtype=np.float32) for x in (logp, old, adv))
    valid = ~np.isnan(logp)
    N = valid.sum()
    pg, kls, fracs = 0.0, [], []
    for _, rows in calls:
        m = valid[rows]
        lp, od, a = logp[rows][m], old[rows][m], adv[rows][m]
        n = len(lp)
        d = (lp - od).astype(np.float64)
        r = np.exp(d)
        if n:
            cov = (a - np.float32(a.sum(dtype=np.float32) / np.float32(n))) * (lp - np.float32(lp.sum(dtype=np.float32) / np.float32(n)))
        if mode == "kl_cov":
            L = -a * r
            if n:
                k = max(1, int(n * policy.get("kl_cov_ratio", 0.0002)))
                top = torch.topk(torch.tensor(cov), k).indices.numpy()
                L[top] += policy.get("ppo_kl_coef", 0.1) * np.abs(d[top])
            kls.append(np.abs(d).sum() / (n + 1e-8))
        else:
            l1, l2 = -a * r, -a * np.clip(r, 1 - clip[0], 1 + clip[1])
            L = np.maximum(l1, l2)
            if n:
                cand = (l2 <= l1) & (cov > policy.get("clip_cov_lb", 1.0)) & (cov < policy.get("clip_cov_ub", 5.0))
                clip_num = max(int(policy.get("clip_cov_ratio", 0.0002) * n), 1)
                assert cand.sum() <= clip_num, "the reference covers the draw-free case only"
                L[cand] = 0.0
                fracs.append(cand.sum() / (n + 1e-8))
            else:
                fracs.append(0.0)
            kls.append(-d.sum() / (n + 1e-8))
        pg += L.sum() / N
    out = {"actor/pg_loss": pg, "actor/loss": pg, "actor/ppo_kl": float(np.mean(kls))}
    if mode == "clip_cov":
        out["actor/pg_clipfrac"] = float(np.mean(fracs))
    return out


def ragged(rng, B: int, T: int, ties: bool = False):
    lens = rng.integers(1, T + 1, B)
    valid = np.arange(T)[None] < lens[:, None]
    old = -rng.exponential(1.0, (B, T))
    logp = old + rng.normal(0, 0.3, (B, T))
    # log-probs are <= 0; with ties, many clamped to exactly 0 (equal within a row)
    logp = np.minimum(logp, 0.0) if ties else -np.abs(logp)
    # advantages on a grid of 1/8: their float32 sums are exact in any order, so verl's means are
    # these (a call of one row with an arbitrary advantage is left to test_kl_cov_one_row_...)
    adv = np.repeat(np.round(rng.normal(0, 1, B) * 8)[:, None] / 8, T, 1)
    nanify = lambda x: np.where(valid, x, NAN)  # noqa: E731
    return nanify(logp), nanify(old), nanify(adv)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", [{}, {"kl_cov_ratio": 0.1}, {"kl_cov_ratio": 0.3, "ppo_kl_coef": 1.0}])
def test_kl_cov_matches_the_reference_on_ragged_steps(tmp_path, seed, policy):
    rng = np.random.default_rng(seed)
    B = 8
    logp, old, adv = ragged(rng, B, 7, ties=seed % 2 == 1)
    calls = [(0, [0, 1, 2]), (0, [3]), (0, [4, 5, 6, 7])]
    run = verl_run(tmp_path / "run", {"policy_loss": {"loss_mode": "kl_cov", **policy}}, logp, old, adv, calls)
    got, want = values(run), reference(logp, old, adv, calls, "kl_cov", policy)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_kl_cov_hand_worked(tmp_path):
    # one call, tokens a = [1, 1, −1], logp = [−1, −0.5, −0.2]: Ā = 1/3, l̄ = −0.5667, cov = [−0.289,
    # 0.044, −0.489]: k = max(1, int(3 · 0.0002)) = 1 picks token 2 (d = 0.1): L = −A·e^d + 0.1·|d|
    # = [−1, −e^0.1 + 0.01, e^0.1]; pg_loss = Σ L / 3 = −0.99 / 3; ppo_kl = mean |d| = 0.2 / 3
    logp, old, adv = [[-1.0, -0.5], [-0.2, NAN]], [[-1.0, -0.6], [-0.3, NAN]], [[1.0, 1.0], [-1.0, NAN]]
    v = values(verl_run(tmp_path / "a", {"policy_loss": {"loss_mode": "kl_cov"}}, logp, old, adv, [(0, [0, 1])]))
    assert v == pytest.approx({"actor/pg_loss": -0.33, "actor/loss": -0.33, "actor/ppo_kl": 0.2 / 3}, rel=1e-6)
    # ppo_kl_coef 1: the chosen token's penalty is |d| = 0.1
    v = values(verl_run(tmp_path / "b", {"policy_loss": {"loss_mode": "kl_cov", "ppo_kl_coef": 1.0}}, logp, old, adv,
                        [(0, [0, 1])]))
    assert v["actor/pg_loss"] == pytest.approx(-0.9 / 3, rel=1e-6)


def test_kl_cov_edge_cases(tmp_path):
    # a call of one token (k = 1: it), a call whose only row has no loss token (verl: no top-k, L = 0),
    # zero advantages (every covariance 0: torch.topk's tie rule picks), equal log-probs
    logp = [[-0.5, -0.5, -0.5], [-0.7, NAN, NAN], [-1.0, -2.0, NAN], [-0.3, -0.3, -0.9]]
    old = [[-0.4, -0.9, -0.5], [-0.2, NAN, NAN], [-1.1, -2.0, NAN], [-0.3, -0.5, -0.6]]
    adv = [[0.0, 0.0, 0.0], [1.5, NAN, NAN], [0.5, 0.5, NAN], [0.0, 0.0, 0.0]]
    mask = [[True] * 3, [True] * 3, [False] * 3, [True] * 3]
    calls = [(0, [0]), (0, [1]), (0, [2]), (0, [3])]
    policy = {"kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0}
    run = verl_run(tmp_path / "run", {"policy_loss": {"loss_mode": "kl_cov", **policy}}, logp, old, adv, calls, mask=mask)
    lp = np.where(np.array(mask), np.array(logp), NAN)
    want = reference(lp, old, adv, calls, "kl_cov", policy)
    assert values(run) == pytest.approx(want, rel=1e-6)


def test_kl_cov_tie_needs_the_rows_order(tmp_path):
    # two rows of one group (the same advantage) with equal log-probs: Ā = 1/3, l̄ = −0.8, cov =
    # [0.467, 0.467 | 0.467, −0.8 | 0.267, 0.933]; k = int(6 · 0.34) = 2 takes 0.933 and one of the three
    # tied 0.467 (rows 0 and 1), with different |d|: verl breaks the tie by the rows' place in the
    # micro-batch, which a shuffled run does not record
    logp = [[-0.1, -0.1], [-0.1, -2.0], [-1.0, -1.5]]
    old = [[-0.3, -0.1], [-0.6, -2.0], [-1.0, -1.5]]
    adv = [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]
    calls = [(0, [0, 1, 2])]
    policy = {"loss_mode": "kl_cov", "kl_cov_ratio": 0.34, "ppo_kl_coef": 1.0}
    ordered = values(verl_run(tmp_path / "a", {"policy_loss": policy}, logp, old, adv, calls))
    want = reference(logp, old, adv, calls, "kl_cov", policy)["actor/pg_loss"]
    assert ordered["actor/pg_loss"] == pytest.approx(want)
    shuffled = values(verl_run(tmp_path / "b", {"policy_loss": policy, "shuffle": True}, logp, old, adv, calls))
    assert "actor/pg_loss" not in shuffled and "actor/loss" not in shuffled
    assert shuffled["actor/ppo_kl"] == ordered["actor/ppo_kl"]  # not a matter of the choice
    # verl's dynamic batching regroups rows by length: the order is not the run's either
    dynamic = values(verl_run(tmp_path / "c", {"policy_loss": policy, "use_dynamic_bsz": True}, logp, old, adv, calls))
    assert "actor/pg_loss" not in dynamic


def test_kl_cov_one_row_with_an_arbitrary_advantage_is_left_to_verls_rounding(tmp_path):
    # every token of the call has A = x: verl's Ā is x only up to its float32 sum's rounding, and
    # whether A − Ā is 0, above or below decides between its tie order, the highest and the lowest
    # log-probs; x = 0.1 (not a float32 sum of its copies exact) leaves pg_loss empty, x = 0.5 does not
    logp, old = [[-0.1, -2.0, -0.7, -1.2]], [[-0.3, -1.0, -0.7, -1.1]]
    x = values(verl_run(tmp_path / "a", {"policy_loss": {"loss_mode": "kl_cov"}}, logp, old, [[0.1] * 4], [(0, [0])]))
    assert set(x) == {"actor/ppo_kl"}
    half = values(verl_run(tmp_path / "b", {"policy_loss": {"loss_mode": "kl_cov"}}, logp, old, [[0.5] * 4], [(0, [0])]))
    assert half["actor/pg_loss"] == pytest.approx(reference(logp, old, [[0.5] * 4], [(0, [0])], "kl_cov", {})["actor/pg_loss"])


def test_kl_cov_choice_and_covariance_bound():
    a, lp = np.array([1.0, 1.0, -1.0], np.float32), np.array([-1.0, -0.5, -0.2], np.float32)
    c, err = covariance(a, lp)
    np.testing.assert_allclose(c, [2 / 3 * -1.3 / 3, 2 / 3 * 0.2 / 3, -4 / 3 * 1.1 / 3], rtol=1e-6)
    assert kl_cov_choice(a, lp, 0.0002, True).chosen.tolist() == [1]
    assert kl_cov_choice(np.zeros(0), np.zeros(0), 0.1, True).count == 0
    # values on a coarse grid sum exactly in float32 in any order: verl's covariance is this one
    g = np.array([0.5, 1.0, -0.25, 2.0], np.float32)
    assert not covariance(g, g).__getitem__(1).any()
    # arbitrary float32 values: verl's sum may round otherwise, within the bound
    r = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    c, err = covariance(r, r[::-1].copy())
    assert (err > 0).all() and (err < 1e-4 * (np.abs(c) + 1)).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy, clip", [({"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05}, (0.2, 0.2)),
                                          ({"clip_cov_ratio": 0.9, "clip_cov_lb": 0.01, "clip_cov_ub": 1.0}, (0.1, 0.28))])
def test_clip_cov_matches_the_reference_on_ragged_steps(tmp_path, seed, policy, clip):
    # clip_num >= every call's candidates: verl zeroes them all, no draw
    rng = np.random.default_rng(seed)
    logp, old, adv = ragged(rng, 8, 7, ties=seed % 2 == 1)
    calls = [(0, [0, 1, 2]), (0, [3]), (0, [4, 5, 6, 7])]
    actor = {"policy_loss": {"loss_mode": "clip_cov", **policy}, "clip_ratio_low": clip[0], "clip_ratio_high": clip[1]}
    got = values(verl_run(tmp_path / "run", actor, logp, old, adv, calls))
    want = reference(logp, old, adv, calls, "clip_cov", policy, clip)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


CLIP_COV_CALL = dict(logp=[[-0.1, -3.0, -0.2], [-3.1, -0.1, NAN]], old=[[-0.1, -3.0, -0.2], [-3.1, -0.1, NAN]],
                     adv=[[2.0, 2.0, 2.0], [-2.0, -2.0, NAN]], calls=[(0, [0, 1])])


def test_clip_cov_hand_worked(tmp_path):
    # on-policy (r = 1, L = −A = [−2, −2, −2, 2, 2]); Ā = 0.4, l̄ = −1.3: cov = [1.92, −2.72, 1.76, 4.32,
    # −2.88]; lb 1.8: candidates tokens 1 and 4 (1.92, 4.32), clip_num = int(0.6 · 5) = 3 >= 2: both zeroed,
    # pg_loss = (−2 − 2 + 2) / 5, pg_clipfrac = 2 / 5, ppo_kl 0
    actor = {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.6, "clip_cov_lb": 1.8}}
    v = values(verl_run(tmp_path / "a", actor, **CLIP_COV_CALL))
    assert v == pytest.approx({"actor/pg_loss": -0.4, "actor/loss": -0.4, "actor/pg_clipfrac": 0.4, "actor/ppo_kl": 0.0})
    # clip_num 1 (verl's default ratio): one of the two, verl's draw: pg_loss and loss left empty, the
    # count is still 1 / 5
    actor["policy_loss"]["clip_cov_ratio"] = 0.0002
    v = values(verl_run(tmp_path / "b", actor, **CLIP_COV_CALL))
    assert v == pytest.approx({"actor/pg_clipfrac": 0.2, "actor/ppo_kl": 0.0})


def test_clip_cov_edge_cases(tmp_path):
    # a call without a loss token (clip_num 1, no candidate, clip fraction 0), a single token
    # (covariance 0: no candidate), zero advantages (covariance 0), a token PPO's clip already binds
    # (r = e^0.5 > 1.2 with A > 0: never a candidate, though its covariance is in range)
    logp = [[-0.5, -0.5, -0.5], [-0.7, NAN, NAN], [-1.0, -2.0, NAN], [-0.01, -3.0, -0.9]]
    old = [[-0.4, -0.9, -0.5], [-0.2, NAN, NAN], [-1.1, -2.0, NAN], [-0.51, -3.0, -0.9]]
    adv = [[0.0, 0.0, 0.0], [1.5, NAN, NAN], [0.5, 0.5, NAN], [3.0, 3.0, -3.0]]
    mask = [[True] * 3, [True] * 3, [False] * 3, [True] * 3]
    calls = [(0, [0]), (0, [1]), (0, [2]), (0, [3])]
    policy = {"clip_cov_ratio": 0.5, "clip_cov_lb": 0.5}
    run = verl_run(tmp_path / "run", {"policy_loss": {"loss_mode": "clip_cov", **policy}}, logp, old, adv, calls,
                   mask=mask)
    lp = np.where(np.array(mask), np.array(logp), NAN)
    assert values(run) == pytest.approx(reference(lp, old, adv, calls, "clip_cov", policy), rel=1e-6)
    a, l = np.array([3.0, 3.0, -3.0], np.float32), np.array([-0.01, -3.0, -0.9], np.float32)
    assert covariance(a, l)[0][0] > 0.5  # in range, but clipped by the ratio:
    assert clip_cov_choice(a, l, np.array([True, False, False]), {**policy, "clip_cov_ub": 5.0}).count == 0


def test_equal_gains_settle_a_draw_or_a_tie(tmp_path):
    # Clip-Cov, clip_num 1 of two candidates (cov 1.92 and 1.76 in (1.7, 4)), both on-policy tokens of
    # row 0 (L = −2 each): whichever verl draws, pg_loss = (−2·3 + 2·2 + 2) / 5 = 0
    actor = {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_lb": 1.7, "clip_cov_ub": 4.0}}
    v = values(verl_run(tmp_path / "a", actor, **CLIP_COV_CALL))
    assert v == pytest.approx({"actor/pg_loss": 0.0, "actor/loss": 0.0, "actor/pg_clipfrac": 0.2, "actor/ppo_kl": 0.0})
    # KL-Cov, rows shuffled: the tied tokens (row 0 and row 1, log-prob −0.1, A = 1) all have |d| = 0.2,
    # so the unrecorded order does not matter
    logp, old = [[-0.1, -0.1], [-0.1, -2.0], [-1.0, -1.5]], [[-0.3, -0.3], [-0.3, -2.0], [-1.0, -1.5]]
    adv = [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]
    policy = {"loss_mode": "kl_cov", "kl_cov_ratio": 0.34, "ppo_kl_coef": 1.0}
    v = values(verl_run(tmp_path / "b", {"policy_loss": policy, "shuffle": True}, logp, old, adv, [(0, [0, 1, 2])]))
    assert v["actor/pg_loss"] == pytest.approx(reference(logp, old, adv, [(0, [0, 1, 2])], "kl_cov", policy)["actor/pg_loss"])


def test_clip_cov_expectation_over_the_draw_hand_worked(tmp_path):
    # Σ L = −2·3 + 2·2 = −2; candidates tokens 1, 3, 4 (cov 1.92, 1.76, 4.32 in (1.7, 5); L = −2, −2, 2),
    # clip_num 1: zeroing one leaves Σ L = 0, 0 or −4, verl's draw; the expectation is (0 + 0 − 4) / 3 / 5
    actor = {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_lb": 1.7}}
    row = grpolens.recompute(verl_run(tmp_path / "a", actor, **CLIP_COV_CALL), profile="verl", write=False).row(0, named=True)
    assert row["actor/pg_loss"] is None and row["grpolens/pg_loss_random_calls"] == 1.0
    assert row["grpolens/pg_loss_expected"] == pytest.approx(-4 / 3 / 5)
    # without a draw (clip_num 3: all three zeroed, Σ L = 0) it is pg_loss itself; under KL-Cov no such key
    actor["policy_loss"]["clip_cov_ratio"] = 0.6
    row = grpolens.recompute(verl_run(tmp_path / "b", actor, **CLIP_COV_CALL), profile="verl", write=False).row(0, named=True)
    assert row["grpolens/pg_loss_expected"] == row["actor/pg_loss"] == 0.0
    row = grpolens.recompute(verl_run(tmp_path / "c", {"policy_loss": {"loss_mode": "kl_cov"}}, **CLIP_COV_CALL),
                             profile="verl", write=False).row(0, named=True)
    assert row.get("grpolens/pg_loss_expected") is None
