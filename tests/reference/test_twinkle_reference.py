"""twinkle-kit 0.5.1's own code is the judge of grpolens' ``twinkle`` profile.

For each configuration (Twinkle's defaults first) a seeded ragged step is built: several forwards
(micro-batches) per data-parallel rank, each with Twinkle-layout labels (prompt and padding
``-100``), the forward's log-probs and entropies, ragged per-sample old/ref log-probs and
advantages. ``twinkle_driver.py`` runs Twinkle's loss class, ``LossMetric``, the policy metric and
``CompletionRewardMetric`` on it in the reference venv. The same forwards are written through
grpolens' writer hook (``GRPOLensHook.log_loss_call`` per forward, ``log_samples`` for rewards and
lengths) with the run config a Twinkle user sets, and recomputed with ``--profile twinkle``. Every
value Twinkle logs must be reproduced (float32 arithmetic: rtol 1e-5, atol 1e-6; ``loss`` is
logged by Twinkle as a 4-decimal string, so it must match to that rounding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import grpolens
from grpolens.capture.hook import GRPOLensHook
from tests.reference import refvenv
from tests.reference.conftest import TALLY, check_quoted_tally, close

# slow, and the first test builds the reference venv (minutes; see refvenv.py): beyond the suite's 600 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

RTOL, ATOL = 1e-5, 1e-6


@dataclass
class Case:
    name: str
    loss: str = "GRPOLoss"
    metric: str = "GRPOMetric"
    loss_kwargs: dict = field(default_factory=dict)
    metric_kwargs: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # grpolens run config (what the user records)
    ranks: int = 1
    forwards: int = 2  # per rank
    rows: int = 3  # per forward
    old: bool = True
    ref: bool = False
    seed: int = 0
    drift: float = 0.15
    shift: float = 0.0  # added to every log-ratio logp - old (before the clamp at 0)
    lens: list | None = None  # completion lengths, one per row (else random)
    adv_scale: float = 1.0


CASES = [
    Case("defaults"),
    Case("clip_higher_kl_2ranks", loss_kwargs={"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04},
         metric_kwargs={"epsilon": 0.2, "epsilon_high": 0.28},
         config={"epsilon_high": 0.28, "beta": 0.04}, ranks=2, forwards=3, ref=True, seed=1),
    Case("temperature_0.7", metric_kwargs={"temperature": 0.7}, config={"temperature": 0.7}, ranks=2, seed=2),
    Case("on_policy_no_old_logps", old=False, seed=3),
    Case("gspo", loss="GSPOLoss", metric="GSPOMetric", loss_kwargs={"epsilon": 3e-4, "epsilon_high": 4e-4},
         metric_kwargs={"epsilon": 3e-4, "epsilon_high": 4e-4},
         config={"loss_type": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4}, seed=4, drift=0.01),
    Case("cispo_eps_high_2ranks", loss="CISPOLoss", metric="CISPOMetric", loss_kwargs={"epsilon": 0.2, "epsilon_high": 0.28},
         metric_kwargs={"epsilon": 0.2, "epsilon_high": 0.28}, config={"loss_type": "cispo", "epsilon_high": 0.28},
         ranks=2, seed=5),
    Case("bnpo_entropy_bonus_temperature", loss="BNPOLoss", loss_kwargs={"entropy_coef": 0.01},
         metric_kwargs={"temperature": 1.3}, config={"loss_type": "bnpo", "entropy_coef": 0.01, "temperature": 1.3},
         seed=6),
    Case("drgrpo_kl", loss="DRGRPOLoss", loss_kwargs={"beta": 0.1, "max_completion_length": 16},
         config={"loss_type": "dr_grpo", "beta": 0.1, "max_completion_length": 16}, ref=True, seed=7),
    Case("sapo_cispo_metric", loss="SAPOLoss", metric="CISPOMetric", loss_kwargs={"tau_pos": 1.0, "tau_neg": 1.05},
         config={"loss_type": "sapo", "sapo_temperature_neg": 1.05}, seed=8),
    # PPOLoss: GRPO's clipped objective; its default token-mean is bnpo's aggregation, its
    # seq-mean-token-mean grpo's (docs/profiles.md)
    Case("ppo_token_mean", loss="PPOLoss", config={"loss_type": "bnpo"}, seed=9),
    Case("ppo_seq_mean_token_mean_clip_higher_kl_2ranks", loss="PPOLoss",
         loss_kwargs={"loss_agg_mode": "seq-mean-token-mean", "epsilon_high": 0.28, "beta": 0.02},
         metric_kwargs={"epsilon_high": 0.28}, config={"loss_type": "grpo", "epsilon_high": 0.28, "beta": 0.02},
         ranks=2, ref=True, seed=10),
    # one completion of one token: every count is 1 (a count clamped to 2, a "more than one" test, a
    # std of one value); its log-ratio below 0, so the largest ratio is below 1
    Case("one_token_bnpo", loss="BNPOLoss", config={"loss_type": "bnpo"}, forwards=1, rows=1, lens=[1], shift=-0.5,
         seed=11),
    Case("one_token_temperature_1.3", metric_kwargs={"temperature": 1.3}, config={"temperature": 1.3},
         forwards=1, rows=1, lens=[1], seed=12),
    Case("one_token_cispo_temperature_1.3", loss="CISPOLoss", metric="CISPOMetric", metric_kwargs={"temperature": 1.3},
         config={"loss_type": "cispo", "temperature": 1.3}, forwards=1, rows=1, lens=[1], seed=13),
    # the rates without the advantage gate (CISPOMetric) on T·d, ratios beyond both bounds; two completions
    Case("cispo_temperature_0.7_two_completions", loss="CISPOLoss", metric="CISPOMetric",
         metric_kwargs={"temperature": 0.7}, config={"loss_type": "cispo", "temperature": 0.7}, forwards=1, rows=2,
         seed=31, drift=0.6),
    # the gated rates on T·d with tokens clipped on both sides
    Case("temperature_1.3_clipped_both_sides", metric_kwargs={"temperature": 1.3}, config={"temperature": 1.3},
         seed=15, drift=0.5),
    # DRGRPOLoss' own max_completion_length (1024) when the run does not set one; advantages large enough
    # that ÷1024 and ÷1025 differ in the 4 decimals Twinkle prints the loss with
    Case("drgrpo_default_length", loss="DRGRPOLoss", config={"loss_type": "dr_grpo"}, seed=16, adv_scale=1000.0),
    # a run that calls PPOLoss' token mean "dapo": per forward Σ L / Σ tokens, as bnpo
    Case("ppo_token_mean_as_dapo", loss="PPOLoss", config={"loss_type": "dapo"}, seed=17),
]

#: Known gaps (issue #13), each an xfail-strict marker naming it; removed as they are fixed.
GAPS: dict[str, str] = {}
PRE = 3  # prompt positions (-100) before each response


def build(case: Case) -> tuple[dict, dict, list]:
    """Forwards in Twinkle's layout plus the rows grpolens records."""
    rng = np.random.default_rng(case.seed)
    n = case.ranks * case.forwards * case.rows
    W = 10
    lens = rng.integers(1, W - PRE + 1, n)
    if case.lens is not None:
        lens = np.array(case.lens)
    labels = np.full((n, W), -100, dtype=np.int64)
    for i in range(n):
        labels[i, PRE:PRE + lens[i]] = rng.integers(5, 100, lens[i])
    m = labels != -100
    old = np.where(m, -rng.exponential(1.0, (n, W)), 0.0).astype(np.float32)
    # log-probabilities are <= 0 (grpolens refuses a run that stores positive ones), so perturb then clamp
    logps = np.where(m, np.minimum(old + case.shift + rng.normal(0, case.drift, (n, W)), 0.0), 0.0).astype(np.float32)
    ref = np.where(m, np.minimum(logps + rng.normal(0, 0.1, (n, W)), 0.0), 0.0).astype(np.float32)
    ent = np.where(m, rng.uniform(0.2, 3.0, (n, W)), 0.0).astype(np.float32)
    adv = (case.adv_scale * rng.normal(0, 1, n)).astype(np.float32)
    adv[rng.random(n) < 0.15] = 0.0
    meta, offs = [], [0]
    for r in range(case.ranks):
        for f in range(case.forwards):
            meta.append((r, f))
            offs.append(offs[-1] + case.rows)
    arrays = {"labels": labels, "logps": logps, "entropies": ent, "old": old, "ref": ref, "adv": adv,
              "fw_meta": np.array(meta), "fw_offsets": np.array(offs)}
    rewards = {"accuracy": rng.integers(0, 2, n).astype(float).tolist(), "format": rng.uniform(0, 1, n).tolist()}
    config = {"loss": case.loss, "metric": case.metric, "loss_kwargs": case.loss_kwargs,
              "metric_kwargs": case.metric_kwargs, "old": case.old, "ref": case.ref,
              "rewards": rewards, "completion_lengths": lens.tolist()}
    return arrays, config, lens


@pytest.fixture(scope="module")
def twinkle_logged(twinkle_python, tmp_path_factory):
    d = tmp_path_factory.mktemp("twinkle_ref")
    jobs, built = [], {}
    for c in CASES:
        arrays, config, lens = build(c)
        np.savez(d / f"{c.name}.npz", **arrays)
        jobs.append({"in": str(d / f"{c.name}.npz"), "config": config})
        built[c.name] = (arrays, config, lens)
    (d / "cases.json").write_text(json.dumps(jobs))
    logged = json.loads(refvenv.run(twinkle_python, "twinkle_driver.py", str(d / "cases.json")))
    return {c.name: (built[c.name], logged[i]) for i, c in enumerate(CASES)}


def record(case: Case, arrays: dict, config: dict, lens, run) -> None:
    """Each rank's forwards through the writer hook: the response part of each row."""
    W = arrays["labels"].shape[1]
    cfg = {"loss_type": "grpo", "log_ratio_clamp": 20.0, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.0,
           **case.config}
    meta, offs = arrays["fw_meta"], arrays["fw_offsets"]
    for r in range(case.ranks):
        hook = GRPOLensHook(run, config=cfg, rank=r, world_size=case.ranks, trainer={"name": "twinkle", "version": "0.5.1"})
        fws = [i for i in range(len(meta)) if int(meta[i][0]) == r]
        rows_r = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in fws])
        hook.log_samples(step=1, sample_ids=torch.tensor(rows_r), group_ids=torch.tensor(rows_r // 3),
                         completion_lens=torch.tensor(lens[rows_r]), truncated=torch.zeros(len(rows_r), dtype=torch.bool),
                         rewards={k: np.asarray(v)[rows_r] for k, v in config["rewards"].items()})
        for u, i in enumerate(fws):
            sl = slice(int(offs[i]), int(offs[i + 1]))
            resp = lambda x: torch.tensor(np.ascontiguousarray(x[sl][:, PRE:]))  # noqa: E731
            mask = resp(arrays["labels"] != -100)
            kw = {"old_logp": resp(arrays["old"])} if case.old else {}
            if case.ref:
                kw["ref_logp"] = resp(arrays["ref"])
            hook.log_loss_call(step=1, micro_batch=u, logp=resp(arrays["logps"]), entropy=resp(arrays["entropies"]),
                               advantages=torch.tensor(arrays["adv"][sl]), mask=mask,
                               sample_ids=torch.arange(sl.start, sl.stop), **kw)
        hook.end_step(1)
        hook.close()


PARAMS = [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=GAPS[c.name])] if c.name in GAPS else [])
          for c in CASES]


@pytest.mark.parametrize("case", PARAMS)
def test_twinkle_profile_reproduces_twinkle(case, twinkle_logged, tmp_path):
    (arrays, config, lens), logged = twinkle_logged[case.name]
    run = tmp_path / "run"
    record(case, arrays, config, lens, run)
    df = grpolens.recompute(run, profile="twinkle", write=False)
    ours = {k: v for k, v in df.row(0, named=True).items() if v is not None and k != "step"}
    rows, extra = [], sorted(k for k in ours if k.startswith("train/") and k not in logged)
    for k, v in sorted(logged.items()):
        got = ours.get(k)
        if isinstance(v, str):  # LossMetric's f'{loss:.4f}'
            ok = got is not None and f"{got:.4f}" == v
        else:
            ok = close(got, v, ATOL, RTOL)
        rows.append((k, v, got, ok))
    TALLY[("twinkle-kit 0.5.1", case.name)] = (sum(ok for *_, ok in rows), len(rows) + len(extra))
    bad = [f"{k}: twinkle {v!r}, grpolens {g!r}" for k, v, g, ok in rows if not ok] + [f"{k}: only grpolens" for k in extra]
    assert rows
    assert not bad, f"{len(bad)} of {len(rows) + len(extra)} values differ:\n" + "\n".join(bad)


def test_docs_quote_the_count():
    """Runs after the comparisons above (module order): the figure docs/profiles.md quotes."""
    check_quoted_tally("twinkle-kit 0.5.1", {c.name for c in CASES},
                       "Twinkle 0.5.1, {got} of {total} over {configs}")
