"""verl 0.9.1's default trainer (``trainer.use_v1: true``) keeps per-token fields as nested tensors
(``layout=torch.jagged``, response tokens only; ``prompts`` and ``input_ids`` nested too, no
``attention_mask``; ``verl/trainer/ppo/v1/trainer_base.py``, ``verl/workers/utils/padding.py``).
The same ragged batch captured padded and nested must give the same run, byte for byte in its tables.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import grpolens
from grpolens.integrations.verl import VerlCapture, verl_config

from tests.integrations.test_verl import EOS, make_batch

PRE, OLD_ENT = VerlCapture.PRE_REJECTION_MASK_KEY, VerlCapture.OLD_ENTROPY_KEY
TOKEN_KEYS = ("responses", "response_mask", "old_log_probs", "ref_log_prob", "rollout_log_probs", "advantages",
              "token_level_scores", "token_level_rewards", PRE, OLD_ENT)


def _rows(x: torch.Tensor, lens) -> torch.Tensor:
    return torch.nested.as_nested_tensor([x[i, : int(n)] for i, n in enumerate(lens)], layout=torch.jagged)


def jagged(batch: dict) -> dict:
    """verl's use_v1 layout of a padded batch: per-token keys and prompts/input_ids as jagged rows."""
    W = batch["responses"].shape[1]
    attn = batch["attention_mask"]
    r_len, p_len = attn[:, -W:].sum(-1), attn[:, :-W].sum(-1)
    P = attn.shape[1] - W
    out = {k: v for k, v in batch.items() if k not in ("attention_mask", "position_ids")}
    for k in TOKEN_KEYS:
        if k in out:
            out[k] = _rows(out[k], r_len)
    prompts = [batch["input_ids"][i, P - int(p_len[i]):P] for i in range(len(r_len))]
    out["prompts"] = torch.nested.as_nested_tensor(prompts, layout=torch.jagged)
    out["input_ids"] = torch.nested.as_nested_tensor(
        [torch.cat([p, batch["responses"][i, : int(r_len[i])]]) for i, p in enumerate(prompts)], layout=torch.jagged)
    return out


def capture(run, nested: bool, seed=11):
    """One step the way TrainingWorker.train_mini_batch runs it: ids at the start, shuffled
    mini/micro-batches, one loss call each; the nested capture sees every batch in verl's use_v1 layout."""
    rng = np.random.default_rng(seed)
    data = make_batch(rng, rejected_row=3)
    b = data.batch
    W = b["responses"].shape[1]
    valid = b["attention_mask"][:, -W:]
    before = valid.clone()
    b[PRE] = before
    b[OLD_ENT] = torch.tensor(rng.uniform(0.1, 2.0, before.shape), dtype=torch.float32) * before
    b["response_mask"] = b["response_mask"].clone()
    b["response_mask"][5, 1:] = 0  # a partly rejected row
    cfg = verl_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": True, "kl_loss_coef": 0.01,
                       "loss_agg_mode": "token-mean"},
                      {"rollout_correction": {"rollout_is": "token", "rollout_rs": "token_k1",
                                              "rollout_rs_threshold": 0.5}})
    cap = VerlCapture(run, config=cfg, rank=0, world_size=1, eos_token_id=EOS)
    view = SimpleNamespace(batch=jagged(b) if nested else dict(b), non_tensor_batch=data.non_tensor_batch,
                           meta_info=data.meta_info)
    cap.begin_step(view)
    b[VerlCapture.SAMPLE_ID_KEY] = view.batch[VerlCapture.SAMPLE_ID_KEY]
    keys = ["responses", "response_mask", "input_ids", "attention_mask", "old_log_probs", "advantages",
            "ref_log_prob", "rollout_log_probs", VerlCapture.SAMPLE_ID_KEY]
    perm = torch.tensor(rng.permutation(len(b["responses"])))
    sel = {k: b[k][perm] for k in keys}
    for u0 in range(0, len(perm), 3):
        mb = {k: v[u0:u0 + 3] for k, v in sel.items()}
        v = mb["attention_mask"][:, -W:]
        log_prob = mb["old_log_probs"] + torch.tensor(rng.normal(0, 0.05, v.shape), dtype=torch.float32) * v
        entropy = torch.tensor(rng.uniform(0.5, 3.0, v.shape), dtype=torch.float32) * v
        if nested:
            lens = v.sum(-1)
            # log-probs as jagged rows (response_from_nested), entropies padded past the micro-batch's
            # longest response, to the step's width (no_padding_2_padding with verl's max_response_len)
            log_prob = _rows(log_prob, lens)
            mb = jagged(mb)
        cap.log_micro_batch(mb, log_prob=log_prob, entropy=entropy)
    cap.end_step()
    cap.close()
    return b


def test_nested_batches_give_the_padded_run(tmp_path):
    runs = {nested: tmp_path / ("nested" if nested else "padded") for nested in (False, True)}
    batch = {nested: capture(run, nested) for nested, run in runs.items()}[False]
    for table in ("tokens", "samples"):
        files = sorted(p.relative_to(runs[False]) for p in (runs[False] / table).rglob("*.parquet"))
        assert files and files == sorted(p.relative_to(runs[True]) for p in (runs[True] / table).rglob("*.parquet"))
        for f in files:
            padded, nested = pq.read_table(runs[False] / f), pq.read_table(runs[True] / f)
            assert padded.num_rows > 0 and padded.equals(nested), f
    tokens = pq.read_table(runs[True] / files[0].parent.parent / "tokens") if False else None  # noqa: F841
    a = grpolens.recompute(runs[False], profile="verl", write=False)
    b = grpolens.recompute(runs[True], profile="verl", write=False)
    assert a.height == 1 and a.equals(b, null_equal=True)
    assert a["rollout_corr/rollout_rs_token_masked_fraction"].item() > 0 if "rollout_corr/rollout_rs_token_masked_fraction" in a.columns else True


@pytest.mark.parametrize("case", ["padded key in nested batch", "nested key in padded batch",
                                  "nested rows of other lengths", "full-sequence log_prob"])
def test_mixed_layouts_are_one_clear_error(tmp_path, case):
    rng = np.random.default_rng(3)
    data = make_batch(rng)
    b = data.batch
    W = b["responses"].shape[1]
    lens = b["attention_mask"][:, -W:].sum(-1)
    key = {"padded key in nested batch": "old_log_probs", "nested key in padded batch": "advantages",
           "nested rows of other lengths": "ref_log_prob", "full-sequence log_prob": "log_prob"}[case]
    if case == "nested key in padded batch":
        batch = dict(b)
        batch["advantages"] = _rows(b["advantages"], lens)
    else:
        batch = jagged(b)
        if case == "padded key in nested batch":
            batch["old_log_probs"] = b["old_log_probs"]
        elif case == "nested rows of other lengths":
            batch["ref_log_prob"] = _rows(b["ref_log_prob"], (lens - 1).clamp(min=0))
    cap = VerlCapture(tmp_path / "run", rank=0, world_size=1)
    view = SimpleNamespace(batch=batch, non_tensor_batch=data.non_tensor_batch, meta_info=data.meta_info)
    with pytest.raises(ValueError, match=repr(key)) as err:
        cap.begin_step(view)
        log_prob = batch["input_ids"] if case == "full-sequence log_prob" else b["old_log_probs"]
        cap.log_micro_batch(batch, log_prob=log_prob.to(torch.float32) if not log_prob.is_nested else
                            torch.nested.as_nested_tensor([r.float() for r in log_prob.unbind()], layout=torch.jagged))
    assert "\n" not in str(err.value)
    cap.close()
