"""Runs verl's own code on a recorded step and prints the metrics verl would log (JSON).

Executed by the reference venv's interpreter (``tests/reference/refvenv.py``), never by grpolens'
environment: ``python verl_driver.py CASES.json`` runs each case ``{"in": IN.npz, "config": {...},
"out": OUT.npz}`` and prints one JSON list, the logged metrics of each case (one import of verl
for the whole matrix). A job ``{"kl_penalty": {"logp": [...], "ref": [...], "types": [...]}}``
instead gives verl's ``kl_penalty`` of each type on those log-probs (float64). A case with
``"every_draw": OUT2.npz`` also gives ``grpolens/pg_loss_expected``: its ``actor/pg_loss`` with
verl's Clip-Cov loss averaged over every draw (:class:`EveryDraw`).

What is verl's code and what is replayed here:

* verl's own functions do every computation: ``compute_rollout_correction_and_add_to_batch``
  (rollout IS weights, rejection, ``rollout_corr/*``), ``compute_grpo_outcome_advantage``,
  ``agg_loss`` (the driver's ``actor/entropy``), ``workers.utils.losses.ppo_loss`` (policy loss
  via the registered loss mode, entropy loss, KL loss, their ``Metric`` aggregation types), and the
  reducers ``append_to_dict``, ``Metric.aggregate_dp``, ``rename_dict``, ``reduce_metrics``.
* The distributed plumbing around them is replayed in one process, line for line from verl 0.9.1:
  ``FSDPEngine.forward_backward_batch`` (global ``batch_num_tokens`` = all-reduced SUM of the
  mini-batch's loss-mask tokens, ``dp_size``), ``postprocess_batch_func`` (per-micro-batch
  lists), ``TrainingWorker._postprocess_output`` (micro-batch losses summed, then AVG over DP;
  metrics all-gathered), ``TrainingWorker.train_mini_batch`` (per mini-batch ``aggregate_dp``,
  appended across mini-batches and epochs) and ``RayPPOTrainer._update_actor`` /
  ``fit`` (``global_batch_size = ppo_mini_batch_size * rollout.n``, ``rename_dict(..., "actor/")``,
  ``reduce_metrics``). Which rows go to which rank, mini-batch and micro-batch is the input's
  schedule (verl shuffles with its own seeds; the metrics only depend on the grouping).

Bypass mode (``rollout_correction.bypass_mode``) replays ``apply_bypass_mode``: ``old_log_probs`` =
``rollout_log_probs``, the policy loss ``bypass_mode`` carrying the rollout-correction config, no
old-log-prob pass and no rollout correction on the driver.

Inputs (``IN.npz``): ``response_mask`` (before rejection), ``old_log_probs``, ``ref_log_prob``,
``rollout_log_probs`` (optional), ``entropys`` (the old-log-prob pass), ``scores`` (per row),
``uid`` (group per row), ``prompt_len`` and the schedule ``fw_meta`` (epoch, mini-batch, rank,
micro-batch per forward), ``fw_offsets``/``fw_rows`` (rows per forward), ``fw_logp``/``fw_ent``
(the forward's log-probs and entropies, one row per scheduled row). Outputs (``OUT.npz``): the
response mask after rejection and the advantages, so that the caller records what verl's actor
was given (``old_log_probs`` too: the rollout's in bypass mode).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage
from verl.utils.metric import Metric, reduce_metrics
from verl.utils.py_functional import append_to_dict, rename_dict
from verl.workers.config import FSDPActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss


def actor_config(c: dict, bypass_corr: dict | None = None) -> FSDPActorConfig:
    """verl's actor config; in bypass mode ``apply_bypass_mode``'s change to it: the policy loss
    becomes ``bypass_mode`` and carries the rollout-correction config."""
    kw = {k: v for k, v in c.items() if k not in ("policy_loss", "ppo_mini_batch_size", "rollout_n")}
    policy = dict(c.get("policy_loss") or {})
    if bypass_corr is not None:
        from verl.trainer.config import RolloutCorrectionConfig

        policy.update(loss_mode="bypass_mode", rollout_correction=RolloutCorrectionConfig(**bypass_corr))
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=c["ppo_mini_batch_size"],
                           ppo_micro_batch_size_per_gpu=1, rollout_n=c.get("rollout_n", 1),
                           policy_loss=PolicyLossConfig(**policy), **kw)


def micro_batch_data(rows, d, resp_mask, adv, weights, logp, ent, dp_size, batch_num_tokens, global_batch_size,
                     v1=True):
    """One micro-batch as ``ppo_loss`` receives it: prompts/responses/attention_mask to slice the
    model output, the fields it selects padded to the micro-batch's longest response (``v1``: what
    ``to_padded_tensor`` of the default trainer's nested tensors gives) or, under the legacy trainer
    (``trainer.use_v1: false``, whose ``_update_actor`` keeps the rollout's padded tensors), to the
    batch's width, and the model output in no-padding layout (one value per prompt + response token,
    log-prob of response token i at ``seq_end - resp_len - 1 + i``)."""
    valid = d["response_mask"][rows]  # real response tokens (before rejection)
    lens = valid.sum(1).astype(np.int64)
    width = int(lens.max()) if v1 else valid.shape[1]
    plen = d["prompt_len"][rows].astype(np.int64)
    pw = int(plen.max())
    n = len(rows)
    attn = np.zeros((n, pw + width), dtype=np.int64)
    for i in range(n):
        attn[i, pw - plen[i]:pw] = 1
        attn[i, pw:pw + lens[i]] = 1
    flat_lp, flat_ent = [], []
    for i in range(n):
        lp = np.zeros(plen[i] + lens[i], dtype=np.float32)
        en = np.zeros(plen[i] + lens[i], dtype=np.float32)
        lp[plen[i] - 1:plen[i] - 1 + lens[i]] = logp[i, :lens[i]]
        en[plen[i] - 1:plen[i] - 1 + lens[i]] = ent[i, :lens[i]]
        flat_lp.append(lp)
        flat_ent.append(en)
    t = lambda x: torch.tensor(np.ascontiguousarray(x[:, :width]))  # noqa: E731
    fields = {
        "prompts": torch.zeros(n, pw, dtype=torch.int64), "responses": torch.zeros(n, width, dtype=torch.int64),
        "attention_mask": torch.tensor(attn), "response_mask": t(resp_mask[rows]),
        "old_log_probs": t(d["old_log_probs"][rows]), "advantages": t(adv[rows]),
        "ref_log_prob": t(d["ref_log_prob"][rows]),
    }
    if weights is not None:
        fields["rollout_is_weights"] = t(weights[rows])
    data = TensorDict(fields, batch_size=[n])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    out = {"log_probs": torch.tensor(np.concatenate(flat_lp)), "entropy": torch.tensor(np.concatenate(flat_ent))}
    return out, data


class DataParallelGroup:
    """``torch.distributed`` as the loss sees it on the actor's data-parallel ranks: they run their
    k-th loss call of a mini-batch together, so an ``all_reduce`` (SUM) in it sums that tensor over
    the ranks' k-th calls (verl's bypass-mode loss does, for ``rollout_is_batch_normalize``).
    Simulated in two passes over a mini-batch: ``record`` keeps what each rank's call reduces,
    ``reduce`` hands every rank the sum. Outside the loss it is off (verl's driver process has no
    process group)."""

    def __init__(self):
        self.mode, self.call, self.n, self.recorded = None, None, 0, {}

    def at(self, mode, call):
        self.mode, self.call, self.n = mode, call, 0

    def is_initialized(self):
        return self.mode is not None

    def all_reduce(self, tensor, op=None, group=None):
        key = (self.call, self.n)
        self.n += 1
        if self.mode == "record":
            self.recorded.setdefault(key, []).append(tensor.detach().clone())
        else:
            tensor.copy_(torch.stack(self.recorded[key]).sum(0))


def run_case(inp: str, c: dict, out_path: str) -> dict:
    d = dict(np.load(inp, allow_pickle=False))
    corr = c.get("rollout_correction")
    bypass = bool(corr and corr.get("bypass_mode", False))
    actor = actor_config(c["actor"], corr if bypass else None)
    dp = int(c["dp_size"])
    v1 = bool(c.get("trainer_v1", True))
    metrics: dict = {}

    resp_mask = torch.tensor(d["response_mask"])
    if bypass:
        # RayPPOTrainer.fit, bypass mode (apply_bypass_mode): no old-log-prob pass (no actor/entropy),
        # old_log_probs = rollout_log_probs, no rollout correction on the driver (the loss does it)
        d["old_log_probs"] = d["rollout_log_probs"]
    else:
        # the old-log-prob pass' entropy, aggregated over the whole batch with the response mask as it
        # is then (before rollout rejection): the default trainer (v1 _compute_old_log_prob) pads its
        # nested entropies to the batch's longest response, the legacy one (RayPPOTrainer.fit) keeps
        # the rollout's padded width
        w = int(d["response_mask"].sum(1).max()) if v1 else resp_mask.shape[1]
        entropy_agg = agg_loss(loss_mat=torch.tensor(d["entropys"][:, :w]), loss_mask=resp_mask[:, :w],
                               loss_agg_mode=actor.loss_agg_mode, loss_scale_factor=actor.loss_scale_factor)
        metrics["actor/entropy"] = entropy_agg.detach().item()

    weights = None
    if corr is not None and "rollout_log_probs" in d and not bypass:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

        batch = DataProto.from_dict(tensors={"old_log_probs": torch.tensor(d["old_log_probs"]),
                                             "rollout_log_probs": torch.tensor(d["rollout_log_probs"]),
                                             "response_mask": resp_mask.clone()})
        batch, is_metrics = compute_rollout_correction_and_add_to_batch(batch, corr)
        metrics.update(is_metrics)
        resp_mask = batch.batch["response_mask"]
        if "rollout_is_weights" in batch.batch.keys():
            weights = batch.batch["rollout_is_weights"].numpy()

    # GRPO advantages on the driver, with the (rejected) response mask
    rewards = torch.zeros_like(resp_mask, dtype=torch.float32)
    rewards[:, 0] = torch.tensor(d["scores"], dtype=torch.float32)
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=resp_mask,
                                            index=d["uid"].astype(np.int64))
    adv = adv.numpy().astype(np.float32)
    mask_np = resp_mask.numpy().astype(np.float32)

    # Engine path: per (epoch, mini-batch) -> per rank -> per micro-batch forward
    meta, offs, rows_all = d["fw_meta"], d["fw_offsets"], d["fw_rows"]
    global_batch_size = int(c["actor"]["ppo_mini_batch_size"]) * int(c["actor"].get("rollout_n", 1))
    mini_outputs = []
    group = DataParallelGroup()
    torch.distributed.is_initialized = group.is_initialized
    torch.distributed.all_reduce = group.all_reduce
    for key in sorted({(int(e), int(m)) for e, m, _, _ in meta}):
        group.recorded = {}
        fws = [i for i in range(len(meta)) if (int(meta[i][0]), int(meta[i][1])) == key]
        mini_rows = np.concatenate([rows_all[offs[i]:offs[i + 1]] for i in fws])
        batch_num_tokens = int(mask_np[mini_rows].sum())  # all-reduced SUM over the DP group
        calls = {r: sorted((i for i in fws if int(meta[i][2]) == r), key=lambda i: int(meta[i][3])) for r in range(dp)}

        def loss_call(i):
            rows = rows_all[offs[i]:offs[i + 1]]
            mo, data = micro_batch_data(rows, d, mask_np, adv, weights, d["fw_logp"][offs[i]:offs[i + 1]],
                                        d["fw_ent"][offs[i]:offs[i + 1]], dp, batch_num_tokens,
                                        global_batch_size, v1)
            if not (actor.calculate_entropy or actor.entropy_coeff != 0):
                mo.pop("entropy")
            return ppo_loss(actor, mo, data)

        if bypass:  # the loss runs on the workers, where the ranks' calls reduce together
            for r in range(dp):
                for k, i in enumerate(calls[r]):
                    group.at("record", k)
                    loss_call(i)
        per_rank = []
        for r in range(dp):
            outs = []
            for k, i in enumerate(calls[r]):
                group.at("reduce", k)
                loss, m = loss_call(i)
                group.at(None, None)
                outs.append({"loss": loss.detach().item(), "metrics": m})
            # postprocess_batch_func: losses and metrics as per-micro-batch lists
            agg: dict = {}
            for o in outs:
                append_to_dict(agg, o["metrics"])
            per_rank.append(({"loss": [o["loss"] for o in outs], "metrics": agg}))
        # _postprocess_output: loss = Σ micro-batch losses, AVG over DP; metrics all-gathered
        loss = float(np.mean([np.sum(p["loss"]) for p in per_rank]))
        gathered: dict = {}
        for p in per_rank:
            for k, v in p["metrics"].items():
                gathered.setdefault(k, []).append(v)
        gathered["loss"] = loss
        mini_outputs.append(gathered)
    # train_mini_batch: aggregate_dp per mini-batch, appended across mini-batches and epochs
    actor_metrics: dict = {}
    for output in mini_outputs:
        for k, v in output.items():
            if isinstance(v, list):
                output[k] = Metric.aggregate_dp(v) if isinstance(v[0], Metric) else [x for xs in v for x in xs]
        append_to_dict(actor_metrics, output)
    actor_metrics = rename_dict(actor_metrics, "actor/")
    metrics.update(reduce_metrics(actor_metrics))
    np.savez(out_path, response_mask=mask_np, advantages=adv, old_log_probs=d["old_log_probs"],
             **({"rollout_is_weights": weights} if weights is not None else {}))
    return {k: float(v) for k, v in metrics.items()}


class EveryDraw:
    """verl's Clip-Cov loss averaged over its random draw, computed by verl's own function: it is
    called once per cyclic shift s of ``torch.randperm(m)``'s output (m candidates); the first
    clip_num places of the m shifts hold each candidate clip_num times, so the mean of the calls'
    losses is the exact expectation over a uniform permutation (the loss is linear in which tokens
    it zeroes)."""

    def __enter__(self):
        from verl.trainer.ppo import core_algos

        self.registry, self.fn = core_algos.POLICY_LOSS_REGISTRY, core_algos.POLICY_LOSS_REGISTRY["clip_cov"]
        self.registry["clip_cov"] = self.averaged
        return self

    def __exit__(self, *exc):
        self.registry["clip_cov"] = self.fn

    def averaged(self, *args, **kwargs):
        randperm, seen = torch.randperm, []
        torch.randperm = lambda n, *a, **k: seen.append(n) or randperm(n, *a, **k)
        try:
            first = self.fn(*args, **kwargs)
        finally:
            torch.randperm = randperm
        if not seen:  # no candidate: nothing drawn
            return first
        m, losses = seen[0], []
        try:
            for shift in range(m):
                torch.randperm = lambda n, *a, _s=shift, **k: torch.roll(torch.arange(n), -_s)
                losses.append(self.fn(*args, **kwargs)[0])
        finally:
            torch.randperm = randperm
        return torch.stack(losses).mean(), first[1]


def kl_penalties(job: dict) -> dict:
    """``kl_penalty(logp, ref, type)`` of each type, as verl's KL loss computes it per token."""
    from verl.trainer.ppo.core_algos import kl_penalty

    logp, ref = (torch.tensor(job[k], dtype=torch.float64) for k in ("logp", "ref"))
    return {t: kl_penalty(logp, ref, t).tolist() for t in job["types"]}


def run_job(c: dict) -> dict:
    if "kl_penalty" in c:
        return kl_penalties(c["kl_penalty"])
    out = run_case(c["in"], c["config"], c["out"])
    if c.get("every_draw"):  # Clip-Cov: also its loss' expectation over verl's draw (grpolens' name for it)
        with EveryDraw():
            out["grpolens/pg_loss_expected"] = run_case(c["in"], c["config"], c["every_draw"])["actor/pg_loss"]
    return out


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    print(json.dumps([run_job(c) for c in cases]))
