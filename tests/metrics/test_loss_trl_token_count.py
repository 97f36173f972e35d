"""TRL's loss normaliser: the token count of each generation round (steps_per_generation > 1,
rounds straddling steps, sample ids beyond float precision) and the releases it changed in."""

import numpy as np
import pytest

import grpolens
from tests.metrics.loss_reference import (
    ref_pooled,
    ref_token_loss,
    ref_trl,
    round_samples,
)
from tests.refdata import approx, random_calls, write_run


def ref_trl_rounds(calls, step, cfg, rounds, S, G):
    """TRL's dapo/cispo loss with several generation rounds per step (trl-notes §4): each call
    returns Σ L·M / (max(N, 1)/P · G/S), N = the valid tokens of ITS round's completions on all
    ranks (each completion once); the step logs Σ over a rank's calls, mean over ranks."""
    cs = [c for c in calls if c.step == step]
    ranks = sorted({c.rank for c in cs})
    N, seen = {}, set()
    for c in cs:
        v = ref_token_loss(c, cfg)[1]
        for i, sid in enumerate(c.sample_ids.tolist()):
            if sid not in seen:
                seen.add(sid)
                N[rounds[sid]] = N.get(rounds[sid], 0) + v[i].sum()
    per_rank = []
    for r in ranks:
        total = 0.0
        for c in (c for c in cs if c.rank == r):
            L, _ = ref_token_loss(c, cfg)
            k = rounds[int(c.sample_ids[0])]
            total += L.sum() / (max(N[k], 1) / len(ranks) * G / S)
        per_rank.append(total)
    return float(np.mean(per_rank))


@pytest.mark.parametrize("cfg", [{"loss_type": "dapo", "beta": 0.04}, {"loss_type": "cispo", "epsilon_high": 1.5}],
                         ids=["dapo", "cispo"])
@pytest.mark.parametrize("reuse", [False, True], ids=["S2", "S1-mu2"])
def test_trl_token_count_per_generation_round(tmp_path, cfg, reuse):
    """G = 4 loss calls per rank and step, two generation rounds per step: S = 2 micro-batches per
    round, or S = 1 reused for num_iterations = 2 (the same completions, new log-probs)."""
    rng = np.random.default_rng(31)
    calls = random_calls(rng, micro_batches=4, batch=3, max_len=10, spread=0.5)
    if reuse:
        for c in calls:
            if c.micro_batch % 2:
                (first,) = [p for p in calls if (p.step, p.rank, p.micro_batch) == (c.step, c.rank, c.micro_batch - 1)]
                c.sample_ids, c.lengths, c.mask, c.advantages = first.sample_ids, first.lengths, first.mask, first.advantages
    rounds = {int(s): 2 * c.step + c.micro_batch // 2 for c in calls for s in c.sample_ids}
    S, G = (1 if reuse else 2), 4
    full = {**cfg, "gradient_accumulation_steps": G, "steps_per_generation": S, "num_iterations": 2 if reuse else 1}
    run = write_run(tmp_path / "run", calls, config=full, samples=round_samples(calls, rounds))
    trl = grpolens.recompute(run, profile="trl", write=False)
    got = grpolens.recompute(run, write=False)
    for step in (0, 1):
        want = ref_trl_rounds(calls, step, full, rounds, S, G)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], want), step
        pooled = [c for c in calls if c.step == step and not (reuse and c.micro_batch % 2)] if reuse else calls
        assert not approx(want, ref_trl(pooled, step, full))  # one count for the step would differ
        assert approx(got.filter(got["step"] == step)["loss"][0], ref_pooled(calls, step, full))  # grpolens: unchanged


def test_trl_token_count_when_a_round_straddles_steps(tmp_path):
    """S = 4 > G = 2: one round, generated at step 0, is trained on at steps 0 and 1. TRL divides
    each call by the round's num_items_in_batch / P · G/S; the round's N comes from its completions'
    ``completion_len`` in the samples table (recorded at step 0), for the calls of both steps."""
    rng = np.random.default_rng(32)
    calls = random_calls(rng, micro_batches=2, batch=3)
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 4}
    rounds = {int(s): 0 for c in calls for s in c.sample_ids}
    run = write_run(tmp_path / "run", calls, config=cfg, samples=round_samples(calls, rounds, at_step=0))
    trl = grpolens.recompute(run, profile="trl", write=False)
    n_round = float(sum(c.lengths.sum() for c in calls))  # completion_len of every completion of the round
    for step in (0, 1):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 4 / 2 * total / n_round), step
        assert not approx(trl.filter(trl["step"] == step)["loss"][0], ref_pooled(calls, step, cfg)), step

def test_trl_gradient_accumulation_left_null_is_trls_default_of_one(tmp_path):
    """``gradient_accumulation_steps: null`` in a run's config is "not set": TRL's value is then the
    TrainingArguments default, 1 (TRL itself always has an integer). With steps_per_generation = 2
    one round (generated at step 0) is trained on at steps 0 and 1, one loss call per rank and step,
    and each call is divided by the round's N/P · G/S = N/P · 1/2."""
    rng = np.random.default_rng(35)
    calls = random_calls(rng, micro_batches=1, batch=3)
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": None, "steps_per_generation": 2}
    rounds = {int(s): 0 for c in calls for s in c.sample_ids}
    run = write_run(tmp_path / "run", calls, config=cfg, samples=round_samples(calls, rounds, at_step=0))
    trl = grpolens.recompute(run, profile="trl", write=False)
    n_round = float(sum(c.lengths.sum() for c in calls))
    for step in (0, 1):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 2 / 1 * total / n_round), step



def _as_trl(run, version: str):
    import json

    m = json.loads((run / "grpolens.json").read_text())
    m["trainer"] = {"name": "trl", "version": version}
    (run / "grpolens.json").write_text(json.dumps(m))
    return run


def test_trl_luspo_before_1_10_is_null_only_where_its_loss_is_per_token(tmp_path):
    """TRL < 1.10 averaged luspo's L·len over padded positions once L is per token, that is with a KL
    term or token-level importance sampling (huggingface/trl#6654): null there. A sequence-level loss
    without KL is one value per sequence, which padding does not change: TRL's number."""
    calls = random_calls(np.random.default_rng(27), steps=(0,), ranks=2, micro_batches=2, spread=0.5)
    cases = [({"beta": 0.0, "importance_sampling_level": "sequence"}, True),
             ({"beta": 0.0, "importance_sampling_level": "token"}, False),
             ({"beta": 0.04, "importance_sampling_level": "sequence"}, False)]
    for i, (extra, defined) in enumerate(cases):
        cfg = {"loss_type": "luspo", **extra}
        got = grpolens.recompute(_as_trl(write_run(tmp_path / str(i), calls, config=cfg), "1.9.0"),
                                 profile="trl", write=False)["loss"][0]
        if defined:
            assert approx(got, ref_trl(calls, 0, cfg)), extra
        else:
            assert got is None, extra


@pytest.mark.parametrize("version,factor_applies", [("1.9.0", False), ("1.10.0", True)])
def test_trl_round_token_count_factor_follows_the_release(tmp_path, version, factor_applies):
    """dapo with two generation rounds per step (S = 2 micro-batches per round, G = 4): from TRL 1.10
    (PR #6024) each call divides by N/P · G/S, before it by N/P."""
    rng = np.random.default_rng(33)
    calls = random_calls(rng, micro_batches=4, batch=3, max_len=10, spread=0.5)
    rounds = {int(s): 2 * c.step + c.micro_batch // 2 for c in calls for s in c.sample_ids}
    S, G = 2, 4
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": G, "steps_per_generation": S}
    run = _as_trl(write_run(tmp_path / "run", calls, config=cfg, samples=round_samples(calls, rounds)), version)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        want = ref_trl_rounds(calls, step, cfg, rounds, S if factor_applies else G, G)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], want), step



def test_trl_round_token_count_when_the_step_also_generated_a_later_round(tmp_path):
    """As above (S = 4 > G = 2, one round trained at steps 0 and 1), and step 1 also generated the
    next round, whose completions (lower sample ids here) are trained on later: the step's own
    samples do not hold the sequences it trains on, so N comes from the run's samples again."""
    import pyarrow as pa

    rng = np.random.default_rng(32)
    calls = random_calls(rng, micro_batches=2, batch=3)
    for c in calls:
        c.sample_ids = c.sample_ids + 1000
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 4}
    rounds = {int(s): 0 for c in calls for s in c.sample_ids}
    samples = round_samples(calls, rounds, at_step=0)
    samples[1] = pa.table({
        "step": pa.array([1] * 3, pa.int64()), "rank": pa.array([0] * 3, pa.int32()),
        "sample_id": pa.array([0, 1, 2], pa.int64()), "group_id": pa.array([0, 1, 2], pa.int64()),
        "completion_len": pa.array([4, 5, 6], pa.int32()), "truncated": pa.array([False] * 3, pa.bool_()),
        "generation": pa.array([1] * 3, pa.int64())})
    trl = grpolens.recompute(write_run(tmp_path / "run", calls, config=cfg, samples=samples), profile="trl", write=False)
    n_round = float(sum(c.lengths.sum() for c in calls))
    for step in (0, 1):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 4 / 2 * total / n_round), step


def test_trl_token_count_of_one_completion_steps_with_and_without_rounds(tmp_path):
    """One completion per step (a samples table of one row): its round's N is its own valid tokens
    (some masked here, so not its completion_len). Samples without the ``generation`` column: one
    round per step, N the step's tokens -- the same number here, reached without the round table."""
    rng = np.random.default_rng(34)
    calls = random_calls(rng, ranks=1, micro_batches=1, batch=1, max_len=12, single_token=False, spread=0.5)
    for c in calls:
        c.lengths[:] = 12
        c.mask[:] = False
        c.mask[0, :9] = True  # 9 of the 12 generated tokens are in the loss
    cfg = {"loss_type": "dapo"}
    rounds = {int(c.sample_ids[0]): c.step for c in calls}
    with_rounds = round_samples(calls, rounds)
    without = {step: t.drop_columns(["generation"]) for step, t in with_rounds.items()}
    for name, samples in (("rounds", with_rounds), ("no_rounds", without)):
        trl = grpolens.recompute(write_run(tmp_path / name, calls, config=cfg, samples=samples), profile="trl", write=False)
        for step in (0, 1):
            want = ref_trl_rounds(calls, step, cfg, rounds, 1, 1)
            assert approx(trl.filter(trl["step"] == step)["loss"][0], want), (name, step)


def test_trl_token_count_per_generation_round_with_unordered_ids_beyond_float_precision(tmp_path):
    """The rounds' N found by sample id: ids from 2⁵³ up (where float64 merges neighbours: an id is
    an int64) and a samples table not in id order (each rank's shard, rank 0's ids the highest)."""
    rng = np.random.default_rng(33)
    calls = random_calls(rng, micro_batches=4, batch=3, max_len=10, spread=0.5)
    top = max(int(s) for c in calls for s in c.sample_ids)
    for c in calls:
        c.sample_ids = (2**53 + top - c.sample_ids.astype(np.int64)).astype(np.int64)
    rounds = {int(s): 2 * c.step + c.micro_batch // 2 for c in calls for s in c.sample_ids}
    full = {"loss_type": "dapo", "gradient_accumulation_steps": 4, "steps_per_generation": 2}
    samples = round_samples(calls, rounds)
    for t in samples.values():  # rank 0's shard is read first: the ids as read are out of order
        assert (np.diff(np.concatenate([t.filter(pa_equal(t, r)).column("sample_id").to_numpy() for r in (0, 1)])) < 0).any()
    run = write_run(tmp_path / "run", calls, config=full, samples=samples)
    trl = grpolens.recompute(run, profile="trl", write=False)
    for step in (0, 1):
        want = ref_trl_rounds(calls, step, full, rounds, 2, 4)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], want), step


def pa_equal(t, rank: int):
    import pyarrow.compute as pc

    return pc.equal(t.column("rank"), rank)


def test_trl_token_count_of_rounds_straddling_steps_with_ids_beyond_float_precision(tmp_path):
    """S = 4 > G = 2, two rounds (generated at steps 0 and 2, each trained on over two steps), sample
    ids from 2⁵³ up: float64 would merge neighbouring ids of the two rounds and give a call the other
    round's N. Each step: (S/G) Σ over its calls Σ L / N_round, N_round its round's completion_len total."""
    rng = np.random.default_rng(34)
    calls = random_calls(rng, steps=(0, 1, 2, 3), micro_batches=2, batch=3)
    for c in calls:
        c.sample_ids = (2**53 + 1 + c.sample_ids.astype(np.int64)).astype(np.int64)
    cfg = {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 4}
    rounds = {int(s): c.step // 2 for c in calls for s in c.sample_ids}
    first = {k: min(s for s, r in rounds.items() if r == k) for k in (0, 1)}
    assert float(first[1]) == float(first[1] - 1)  # the first id of round 1 and the last of round 0, as floats
    samples = {**round_samples([c for c in calls if c.step == 0 or c.step == 1], rounds, at_step=0),
               **round_samples([c for c in calls if c.step >= 2], rounds, at_step=2)}
    run = write_run(tmp_path / "run", calls, config=cfg, samples=samples)
    trl = grpolens.recompute(run, profile="trl", write=False)
    n_round = {k: float(sum(c.lengths.sum() for c in calls if c.step // 2 == k)) for k in (0, 1)}
    assert n_round[0] != n_round[1]
    for step in range(4):
        total = sum(ref_token_loss(c, cfg)[0].sum() for c in calls if c.step == step)
        assert approx(trl.filter(trl["step"] == step)["loss"][0], 4 / 2 * total / n_round[step // 2]), step

