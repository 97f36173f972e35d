"""The OpenRLHF capture on experiences shaped as OpenRLHF 0.11.2 builds them: one row per sample
from the samples generator (action mask over the whole observation shifted by one, so the prompt
is zeros; multi-turn rows with environment tokens between the actions), the driver's two lines,
the replay buffer's single-row items and a collated, right-padded micro-batch. The profile's values
themselves are judged by OpenRLHF's own code in tests/reference/test_openrlhf_reference.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch

from grpolens.integrations.openrlhf import (GROUP_ID_KEY, REF_KEY, SAMPLE_ID_KEY, SAMPLE_ID_STRIDE, OpenRLHFCapture,
                                            keep_reference, openrlhf_config, tag_experiences)
from grpolens.run.reader import RunReader
from grpolens.run.validate import validate_run

#: (prompt tokens, action ranges within the observation): single-turn rows and a multi-turn one
ROWS = [(3, [(3, 7)]), (2, [(2, 3)]), (4, [(4, 6), (8, 11)]), (3, [(3, 9)])]


def experience(i: int, rng) -> SimpleNamespace:
    """One sample as ``_process_response_into_experience`` and the experience maker leave it."""
    p, ranges = ROWS[i]
    obs = max(e for _, e in ranges)
    am = torch.zeros(obs, dtype=torch.long)
    for s, e in ranges:
        am[s:e] = 1
    am = am[1:].unsqueeze(0)
    A = am.shape[1]
    old = torch.tensor(-rng.exponential(1.0, (1, A)), dtype=torch.float32) * am
    ones = torch.nonzero(am[0]).flatten()
    return SimpleNamespace(
        action_mask=am, action_log_probs=old, base_action_log_probs=None,
        rollout_log_probs=old - 0.01 * am, advantages=torch.full((1, A), 0.5 - i, dtype=torch.float32) * am,
        response_length=torch.tensor([int(ones[-1] - ones[0] + 1)]), total_length=torch.tensor([float(obs)]),
        truncated=torch.tensor([i == 3]), index=[i],
        info={"reward": torch.tensor([float(i)]), "response_clip_ratio": torch.tensor([False])})


def collate(items: list) -> SimpleNamespace:
    """OpenRLHF's make_experience_batch: per-token fields right-padded, info values listed."""
    def pad(name):
        xs = [getattr(it, name)[0] for it in items]
        w = max(len(x) for x in xs)
        return torch.stack([torch.nn.functional.pad(x, (0, w - len(x))) for x in xs])
    info = {k: [it.info[k][0] for it in items] for k in items[0].info}
    return SimpleNamespace(action_mask=pad("action_mask"), action_log_probs=pad("action_log_probs"),
                           base_action_log_probs=None, rollout_log_probs=pad("rollout_log_probs"),
                           advantages=pad("advantages"), info=info)


def test_a_step_through_the_capture(tmp_path):
    rng = np.random.default_rng(0)
    exps = [experience(i, rng) for i in range(4)]
    refs = []
    for e in exps:  # the experience maker's loop: the reference log-probs (× action mask)
        ref = (e.action_log_probs - 0.1) * e.action_mask
        refs.append(ref)
        keep_reference(e, ref)
    tag_experiences(exps, step=3, n_samples_per_prompt=2)
    assert [int(e.info[SAMPLE_ID_KEY][0]) for e in exps] == [3 * SAMPLE_ID_STRIDE + i for i in range(4)]
    assert [int(e.info[GROUP_ID_KEY][0]) for e in exps] == [3 * SAMPLE_ID_STRIDE + i // 2 for i in range(4)]
    cfg = openrlhf_config({"algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 2,
                           "actor.eps_clip_low_high": [0.2, 0.28], "train.max_epochs": 1},
                          SimpleNamespace(accumulated_gradient=2))
    assert cfg["openrlhf_args"]["accumulated_gradient"] == 2 and cfg["epsilon_high"] == 0.28
    cap = OpenRLHFCapture(tmp_path / "run", config=cfg, rank=0, world_size=1)
    assert cap.begin_step(exps) == 3  # the step travels with the ids
    for rows in ([2, 0], [3, 1]):
        mb = collate([exps[i] for i in rows])
        logp = mb.action_log_probs - 0.05 * mb.action_mask
        ent = torch.ones(mb.action_mask.shape[0], mb.action_mask.shape[1] + 1)  # the forward's, over the sequence
        cap.log_micro_batch(mb, logp, entropy=ent)
        assert not {SAMPLE_ID_KEY, GROUP_ID_KEY, REF_KEY} & set(mb.info)  # nothing reaches OpenRLHF's status
    cap.end_step()
    cap.close()
    validate_run(tmp_path / "run")
    reader = RunReader(tmp_path / "run")
    s = reader.samples(3).sort("sample_id")
    spans = [int(e.response_length[0]) for e in exps]
    assert s["completion_len"].to_list() == spans  # OpenRLHF's response_length: first to last action token
    assert (s["prompt_len"] + s["completion_len"]).to_list() == [int(e.total_length[0]) for e in exps]
    assert s["truncated"].to_list() == [False, False, False, True]
    assert s["reward"].to_list() == [0.0, 1.0, 2.0, 3.0]
    t = pl.from_arrow(reader.tokens(3))
    for i, e in enumerate(exps):
        rows = t.filter(pl.col("sample_id") == 3 * SAMPLE_ID_STRIDE + i).sort("pos")
        am = e.action_mask[0]
        first = int(torch.nonzero(am).flatten()[0])
        span = am[first:first + spans[i]].bool()
        assert rows.height == spans[i]
        assert rows["mask"].to_list() == span.tolist()  # the environment's tokens are in the span, masked out
        np.testing.assert_allclose(rows["old_logp"].to_numpy(), e.action_log_probs[0, first:first + spans[i]].numpy())
        got_ref = rows.filter(pl.col("mask"))["ref_logp"].to_numpy()
        np.testing.assert_allclose(got_ref, refs[i][0][am.bool()].numpy(), rtol=1e-6)
        assert rows["micro_batch"][0] == (0 if i in (0, 2) else 1)


def test_a_micro_batch_without_ids_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    cap = OpenRLHFCapture(tmp_path / "run", config=openrlhf_config({}), rank=0, world_size=1)
    e = experience(0, rng)
    with pytest.raises(KeyError, match="tag_experiences"):
        cap.log_micro_batch(e, e.action_log_probs)
    cap.close()


def test_tag_experiences_refuses_a_group_size_below_one():
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        tag_experiences([], step=1, n_samples_per_prompt=0)
