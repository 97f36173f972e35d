"""OpenRLHF 0.11.2's own code is the judge of grpolens' ``openrlhf`` profile.

For each configuration (OpenRLHF's defaults for a GRPO run first) a seeded ragged step is built:
prompt groups, ragged prompts and responses, rewards, the actor's, reference's and vLLM's
log-probs and, per PPO epoch, the training forward's log-probs and entropies.
``openrlhf_driver.py`` runs OpenRLHF's code on it in the reference venv, one process per
data-parallel rank joined by torch.distributed (the samples generator's experiences, the
experience maker's advantages, the replay buffer, ``ppo_train`` and ``training_step`` with
``PolicyLoss``, ``compute_approx_kl``, ``aggregate_loss`` and the optimizer-step window's
normaliser) and returns the status OpenRLHF's logger writes, with every micro-batch it trained on.
Those batches go through :class:`~grpolens.integrations.openrlhf.OpenRLHFCapture` rank by rank,
and ``--profile openrlhf`` must give every value OpenRLHF logged (float32: rtol 1e-5, atol 1e-6)
and no key it did not log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import grpolens
from grpolens.integrations.openrlhf import OpenRLHFCapture, openrlhf_config
from tests.reference import refvenv
from tests.reference.conftest import TALLY, check_quoted_tally, close

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

RTOL, ATOL = 1e-5, 1e-6
#: the optimizer's, not the batches': what a run cannot hold (docs/profiles.md)
NOT_COMPARED = {"actor_lr", "actor_grad_norm"}
#: a GRPO run of OpenRLHF at its defaults (``--algo.advantage.estimator group_norm``, several samples per prompt)
GRPO = {"algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 4}


@dataclass
class Case:
    name: str
    args: dict = field(default_factory=dict)
    dp: int = 1
    prompts: int = 4
    micro: int = 2  # train.micro_batch_size
    gas: int = 4  # accumulated_gradient: micro-batches per optimizer step and rank
    seed: int = 0
    #: rollout noise: a few tokens far off, so that IS filters reject some
    wild: float = 0.0
    drift: float = 0.05
    max_len: int = 24
    packing: bool = False


CASES = [
    Case("defaults", GRPO, drift=0.3),
    Case("kl_loss_k3_entropy_dp2", {**GRPO, "algo.kl.use_loss": True, "algo.kl.estimator": "k3",
                                    "actor.entropy_coef": 0.0}, dp=2, seed=1, drift=0.3),
    Case("kl_reward_k2_epochs2_gas3", {**GRPO, "algo.kl.estimator": "k2", "train.max_epochs": 2}, gas=3, seed=2),
    Case("asymmetric_dual_clip", {**GRPO, "actor.eps_clip_low_high": [0.2, 0.28], "actor.dual_clip": 3.0},
         seed=3, drift=0.4),
    Case("seq_mean_token_mean_dp2", {**GRPO, "actor.loss_agg_mode": "seq-mean-token-mean"}, dp=2, seed=4, drift=0.3),
    Case("gspo", {**GRPO, "actor.policy_loss_type": "gspo", "actor.eps_clip_low_high": [0.0003, 0.0004]}, seed=5),
    Case("is_token_mask_ratio", {**GRPO, "algo.advantage.is_correction_level": "token",
                                 "algo.advantage.is_correction_threshold": [0.8, 1.25]}, seed=6, wild=0.4),
    Case("is_token_clip_dp2", {**GRPO, "algo.advantage.is_correction_level": "token",
                               "algo.advantage.is_correction_mode": "clip",
                               "algo.advantage.is_correction_threshold": [0.8, 1.25]}, dp=2, seed=7, wild=0.4),
    Case("is_seq_mask_binary_kl_epochs2", {**GRPO, "algo.advantage.is_correction_level": "seq",
                                           "algo.advantage.is_correction_gating": "binary_kl",
                                           "algo.advantage.is_correction_threshold": [0.0, 0.002],
                                           "train.max_epochs": 2}, seed=8, wild=0.4),
    Case("is_seq_mask_tv_dp2", {**GRPO, "algo.advantage.is_correction_level": "seq",
                                "algo.advantage.is_correction_gating": "tv",
                                "algo.advantage.is_correction_threshold": [0.0, 0.05]}, dp=2, seed=9, wild=0.4),
    Case("is_token_mask_kl_loss_k1_rloo", {**GRPO, "algo.advantage.estimator": "rloo", "algo.kl.use_loss": True,
                                           "algo.advantage.is_correction_level": "token",
                                           "algo.advantage.is_correction_gating": "tv",
                                           "algo.advantage.is_correction_threshold": [0.0, 0.1]}, seed=10, wild=0.3),
    Case("reinforce_baseline_no_ref_packed", {**GRPO, "algo.advantage.estimator": "reinforce_baseline",
                                              "algo.kl.init_coef": 0.0}, seed=11, packing=True),
    Case("dr_grpo_gspo_is_dp2_epochs2", {**GRPO, "algo.advantage.estimator": "dr_grpo",
                                         "actor.policy_loss_type": "gspo", "train.max_epochs": 2,
                                         "algo.advantage.is_correction_level": "token"}, dp=2, seed=12, wild=0.2),
]


def build(case: Case) -> tuple[dict, dict]:
    """The step's per-sample arrays (what the driver reads) and its configuration, seeded."""
    rng = np.random.default_rng(case.seed)
    n = int(case.args.get("rollout.n_samples_per_prompt", 1))
    B = case.prompts * n
    W = 9
    resp = rng.integers(1, W + 1, B)
    resp[0] = W
    prompt = rng.integers(2, 8, B)
    prompt[1] = case.max_len - resp[1]  # the observation fills data.max_len: response_clip_ratio counts it
    epochs = int(case.args.get("train.max_epochs", 1))
    valid = np.arange(W)[None] < resp[:, None]
    old = np.minimum(-rng.exponential(1.0, (B, W)), -1e-3).astype(np.float32)
    noise = rng.normal(0, 0.05, (B, W)) + case.wild * rng.standard_t(2, (B, W)) * (rng.random((B, W)) < 0.15)
    rewards = rng.integers(0, 2, B).astype(np.float32)
    rewards[:n] = 1.0  # a group whose rewards are equal (zero advantages)
    arrays = {
        "prompt_len": prompt, "resp_len": resp, "reward": rewards + rng.normal(0, 0.1, B).astype(np.float32) * (np.arange(B) >= n),
        "truncated": resp == W, "old": old,
        "ref": np.minimum(old + rng.normal(0, 0.1, (B, W)), 0.0).astype(np.float32),
        "rollout": np.minimum(old + noise, 0.0).astype(np.float32),
        "cur": np.stack([np.minimum(old + rng.normal(0, case.drift * (1 + e), (B, W)), 0.0)
                         for e in range(epochs)]).astype(np.float32),
        "ent": rng.uniform(0.2, 3.0, (epochs, B, W)).astype(np.float32),
    }
    arrays["reward"] = arrays["reward"].astype(np.float32)
    del valid
    # the experiences go to the ranks in contiguous chunks (OpenRLHF's async_run_method_batch)
    per = B // case.dp
    ranks = [list(range(r * per, (r + 1) * per)) for r in range(case.dp)]
    config = {"args": {**case.args, "data.max_len": case.max_len}, "ranks": ranks, "micro_train_batch_size": case.micro,
              "accumulated_gradient": case.gas, "seed": case.seed, "step": 1, "packing_samples": case.packing}
    return arrays, config


@pytest.fixture(scope="module")
def openrlhf_logged(openrlhf_python, tmp_path_factory):
    """Every case through OpenRLHF's code, in one driver run."""
    import json

    d = tmp_path_factory.mktemp("openrlhf_ref")
    jobs, inputs = [], {}
    for c in CASES:
        arrays, config = build(c)
        np.savez(d / f"{c.name}.npz", **arrays)
        jobs.append({"in": str(d / f"{c.name}.npz"), "config": config, "out": str(d / f"{c.name}.out.pt")})
        inputs[c.name] = config
    (d / "cases.json").write_text(json.dumps(jobs))
    json.loads(refvenv.run(openrlhf_python, "openrlhf_driver.py", str(d / "cases.json")))
    return {c.name: (inputs[c.name], torch.load(d / f"{c.name}.out.pt", weights_only=False)) for c in CASES}


def record(case: Case, config: dict, out: dict, run) -> None:
    """What each rank's OpenRLHFCapture writes: its replay buffer (begin_step), then every
    training_step's micro-batch, as OpenRLHF's replay buffer collated it."""
    cfg = openrlhf_config({**config["args"], "train.micro_batch_size": case.micro},
                          SimpleNamespace(accumulated_gradient=case.gas))
    for r, dump in enumerate(out["ranks"]):
        cap = OpenRLHFCapture(run, config=cfg, rank=r, world_size=case.dp)
        items = [SimpleNamespace(**it) for it in dump["items"]]
        cap.begin_step(items)
        for c in dump["calls"]:
            exp = SimpleNamespace(info=dict(c["info"]), action_mask=c["action_mask"],
                                  action_log_probs=c["action_log_probs"],
                                  base_action_log_probs=c["base_action_log_probs"],
                                  rollout_log_probs=c["rollout_log_probs"], advantages=c["advantages"])
            cap.log_micro_batch(exp, c["logp"], entropy=c["entropy"])
            assert not any(k.startswith("grpolens_") for k in exp.info)  # nothing of the capture reaches the status
        cap.end_step()
        cap.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_openrlhf_profile_reproduces_openrlhf(case, openrlhf_logged, tmp_path):
    config, out = openrlhf_logged[case.name]
    run = tmp_path / "run"
    record(case, config, out, run)
    df = grpolens.recompute(run, profile="openrlhf", write=False)
    ours = {k: v for k, v in df.row(0, named=True).items() if v is not None and k != "step"}
    logged = {f"train/{k}": v for k, v in out["status"].items() if k not in NOT_COMPARED}
    rows = [(k, v, ours.get(k), close(ours.get(k), v, ATOL, RTOL)) for k, v in sorted(logged.items())]
    extra = sorted(k for k in ours if k not in logged)
    good = sum(ok for *_, ok in rows)
    TALLY[("OpenRLHF 0.11.2", case.name)] = (good, len(rows) + len(extra))
    bad = [f"{k}: OpenRLHF {v!r}, grpolens {g!r}" for k, v, g, ok in rows if not ok] + [f"{k}: only grpolens" for k in extra]
    assert not bad, f"{len(bad)} of {len(rows) + len(extra)} values differ:\n" + "\n".join(bad)


@pytest.mark.parametrize("case", CASES[:2], ids=[c.name for c in CASES[:2]])
def test_parity_reads_openrlhf_console_log(case, openrlhf_logged, tmp_path):
    """``grpolens parity`` on OpenRLHF's own console line (``PPOTrainer.fit``'s
    ``✨ Global step N: {status}``, the status as Python prints it): every key the run determines agrees."""
    from grpolens.analysis.parity import compare

    config, out = openrlhf_logged[case.name]
    run = tmp_path / "run"
    record(case, config, out, run)
    status = {**out["status"], "timing/ppo_train": 1.5}
    log = tmp_path / "openrlhf.log"
    log.write_text("INFO starting\n" + f"[INFO] ✨ Global step {config['step']}: {status}\n")
    rows = compare(run, log, profile="openrlhf", rtol=RTOL, atol=ATOL)
    assert {r.key for r in rows} == {f"train/{k}" for k in out["status"] if k not in NOT_COMPARED}
    assert all(r.status == "ok" for r in rows), [str(r) for r in rows if r.status != "ok"]


def test_docs_quote_the_count():
    """Runs after the comparisons above (module order): the figure docs/profiles.md quotes."""
    check_quoted_tally("OpenRLHF 0.11.2", {c.name for c in CASES},
                       "OpenRLHF 0.11.2, {got} of {total} values over {configs} configurations")
