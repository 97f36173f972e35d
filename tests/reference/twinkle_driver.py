"""Runs Twinkle's own losses and metrics on a recorded step and prints what Twinkle would log (JSON).

Executed by the reference venv's interpreter (``tests/reference/refvenv.py``):
``python twinkle_driver.py CASES.json`` runs each case ``{"in": IN.npz, "config": {...}}`` and
prints one JSON list, what Twinkle logs for each case.

Every number comes from twinkle-kit's classes: the configured loss (``twinkle.loss.<Name>``)
called once per forward (micro-batch) with the forward's labels, log-probs, entropies and the
ragged per-sample old/ref log-probs and advantages, exactly as ``forward_backward`` hands them
over; ``LossMetric`` accumulating each forward's loss; the policy metric (``GRPOMetric``,
``GSPOMetric``, ``CISPOMetric`` or ``PPOMetric``) accumulating each forward; and
``CompletionRewardMetric`` fed the step's rewards and completion lengths. Data-parallel ranks
are one metric object each; the all-gather inside ``Metric.gather_results`` is replayed by handing
rank 0's metric the other ranks' local result lists (Twinkle sums them in ``calculate``).

Inputs (``IN.npz``): ``labels`` (per scheduled row: ``-100`` off the response), ``logps``,
``entropies`` (the forward's, full width), ``old`` / ``ref`` (per token, full width; the response
positions are sent as Twinkle's ragged lists), ``adv`` (per row), and the schedule ``fw_meta``
(rank, forward index) with ``fw_offsets``.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

import twinkle.loss as tl
import twinkle.metric as tm


def ragged(x: np.ndarray, labels: np.ndarray) -> list[list[float]]:
    return [x[i][labels[i] != -100].tolist() for i in range(len(x))]


def run_case(inp: str, c: dict) -> dict:
    d = dict(np.load(inp, allow_pickle=False))
    loss_fn = getattr(tl, c["loss"])(**c.get("loss_kwargs", {}))
    meta, offs = d["fw_meta"], d["fw_offsets"]
    ranks = sorted({int(r) for r, _ in meta})
    metrics = {r: getattr(tm, c["metric"])(None, None, **c.get("metric_kwargs", {})) for r in ranks}
    losses = {r: tm.LossMetric(None, None) for r in ranks}
    for i in sorted(range(len(meta)), key=lambda i: (int(meta[i][0]), int(meta[i][1]))):
        r = int(meta[i][0])
        sl = slice(int(offs[i]), int(offs[i + 1]))
        labels = torch.tensor(d["labels"][sl])
        inputs = {"labels": labels}
        outputs = {"logps": torch.tensor(d["logps"][sl]), "entropies": torch.tensor(d["entropies"][sl])}
        kw = {"advantages": d["adv"][sl].tolist()}
        if c.get("old", True):
            kw["old_logps"] = ragged(d["old"][sl], d["labels"][sl])
        if c.get("ref", False):
            kw["ref_logps"] = ragged(d["ref"][sl], d["labels"][sl])
        out = loss_fn(inputs, outputs, **kw)
        losses[r].accumulate(inputs, {"loss": out["loss"]})
        metrics[r].accumulate(inputs, outputs, **{k: v for k, v in kw.items() if k != "ref_logps"})

    result: dict = {}
    for group in (metrics, losses):
        others: list = []
        for r in ranks[1:]:  # each other rank's local results, as all_gather_object would deliver them
            group[r].gather_results = lambda local, _o=others: (_o.extend(local), local)[1]
            group[r].calculate()
        group[ranks[0]].gather_results = lambda local, _o=others: local + _o
        result.update(group[ranks[0]].calculate())
    rewards = c.get("rewards")
    if rewards is not None:
        crm = tm.CompletionRewardMetric()
        crm.accumulate(rewards=rewards, completion_lengths=c.get("completion_lengths", []))
        result.update(crm.calculate())
    result.pop("_high_kl_records", None)
    # LossMetric formats its value as a string with 4 decimals: that string is what Twinkle logs
    return {k: v if isinstance(v, str) else float(v) for k, v in result.items()}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    print(json.dumps([run_case(c["in"], c["config"]) for c in cases]))
