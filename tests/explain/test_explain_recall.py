"""Recall: a planted pathology -- one token id with a high KL, ratio or mismatch in a few
completions of one step, or one prompt whose completions all drift -- is what the explanation
ranks first, and the concentration shows it; the same run without it shows no such thing."""

from __future__ import annotations

import numpy as np
import pytest

from grpolens.analysis.explain import explain
from tests.explain.runs import random_step, write_run

PLANTED = 7777  # a token id outside the random vocabulary


def _runs(tmp_path, plant, seed=3, ranks=2):
    """(clean run, run with ``plant(step 2's completions)`` applied)."""
    rng = np.random.default_rng(seed)
    steps = {s: random_step(rng, s, groups=6, max_len=40) for s in range(3)}
    clean = write_run(tmp_path / "clean", steps, ranks=ranks)
    planted = plant(steps[2])
    return clean, write_run(tmp_path / "planted", steps, ranks=ranks), planted


def _plant_tokens(field_fn, n_completions=3, per_completion=2):
    """Overwrite ``per_completion`` tokens of ``n_completions`` completions with the planted id,
    and set their field by ``field_fn(completion, index)``; returns the planted sample ids."""
    def plant(comps):
        hit = []
        for c in comps[1:1 + 4 * n_completions:4]:  # one completion in each of several prompts
            idx = np.arange(min(per_completion, len(c.token_id)))
            c.token_id[idx] = PLANTED
            c.mask[idx] = True
            field_fn(c, idx)
            hit.append(c.sample_id)
        return hit
    return plant


def _kl(c, idx):
    c.ref_logp[idx] = np.minimum(c.logp[idx] - 4.0, 0.0)  # x = -4: k3 ≈ 3.02 per token


def _ratio(c, idx):
    c.old_logp[idx] = c.logp[idx] - 2.0  # ratio e^2
    c.rollout_logp[idx] = c.old_logp[idx]


def _mismatch(c, idx):
    c.rollout_logp[idx] = np.minimum(c.old_logp[idx] - 3.0, 0.0)


@pytest.mark.parametrize("metric, field_fn", [("kl/k3", _kl), ("policy/approx_kl", _ratio), ("mismatch/kl_k3", _mismatch)])
def test_planted_tokens_rank_first(tmp_path, metric, field_fn):
    clean, planted_run, hit = _runs(tmp_path, _plant_tokens(field_fn))
    e = explain(planted_run, metric, 2, top=5)
    d = e.to_dict()
    first = d["by"]["token_id"][0]
    assert first["key"] == PLANTED and first["share"] > 0.5, first
    assert first["completions"] == len(hit) and first["groups"] == len(hit)
    top_completions = {x["key"] for x in d["by"]["completion"][:len(hit)]}
    assert top_completions == set(hit)
    assert d["concentration"]["top_1%_tokens"] > 0.5
    assert f"from token `⟨{PLANTED}⟩` in {len(hit)} completions of {len(hit)} prompts" in e.headline()
    # silence: the same step without the plant has no dominating token, no concentration
    c = explain(clean, metric, 2, top=5).to_dict()
    assert c["concentration"]["top_1%_tokens"] < 0.25
    assert all(x["key"] != PLANTED for x in c["by"]["token_id"])


def test_a_drifting_prompt_ranks_first_by_group(tmp_path):
    def plant(comps):
        group = comps[5].group_id
        for c in comps:
            if c.group_id == group:
                c.ref_logp[:] = np.minimum(c.logp - 1.5, 0.0)  # every token of every completion
        return [group]

    clean, planted_run, (group,) = _runs(tmp_path, plant)
    d = explain(planted_run, "kl/k3", 2, top=5).to_dict()
    assert d["by"]["group"][0]["key"] == group and d["by"]["group"][0]["share"] > 0.6
    # spread over the prompt's tokens: no single token id explains it
    assert d["by"]["token_id"][0]["share"] < 0.3
    assert explain(clean, "kl/k3", 2, top=5).to_dict()["by"]["group"][0]["key"] != group
