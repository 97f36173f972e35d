"""GRPOLensHook: padded and packed layouts give byte-identical shards, the rows match a plain-python
reference, inputs are never touched, ranks come from torch.distributed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpolens.run import format as fmt
from grpolens.hook import GRPOLensHook
from grpolens.run.validate import validate_run

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("old_logp", "ref_logp", "rollout_logp", "entropy")


def make_batch(seed, B=7, T=13, min_len=0):
    """Ragged padded batch: lengths include min_len, 1 and T; some real tokens are outside the loss mask;
    padding holds garbage that must never reach a shard."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, T + 1, (B,), generator=g)
    lens[0], lens[1], lens[2] = T, 1, min_len
    valid = torch.arange(T)[None, :] < lens[:, None]
    d = {"lens": lens, "valid": valid, "mask": valid & (torch.rand(B, T, generator=g) < 0.8),
         "sample_ids": torch.randperm(1000, generator=g)[:B], "advantages": torch.randn(B, generator=g),
         "token_ids": torch.randint(0, 50_000, (B, T), generator=g)}
    d["logp"] = -torch.rand(B, T, generator=g) * 5
    for name in OPTIONAL:
        d[name] = -torch.rand(B, T, generator=g) * 5
    for name in ("logp", "token_ids", *OPTIONAL):
        d[name] = torch.where(valid, d[name], torch.full_like(d[name], 777))  # garbage in the padding
    return d


PER_TOKEN = ("logp", "mask", "valid", "token_ids", *OPTIONAL)


def packed(d, tail=3, prompt=0):
    """The same sequences packed in one row, each optionally preceded by `prompt` non-valid prompt tokens,
    followed by `tail` padding tokens. Returns per-token (1, N) tensors, cu_seqlens and position_ids."""
    cols = {k: [] for k in PER_TOKEN}
    cu, pid = [0], []
    for b, n in enumerate(d["lens"].tolist()):
        for k in PER_TOKEN:
            real = d[k][b, :n]
            pre = torch.full((prompt,), 5, dtype=real.dtype) if k not in ("mask", "valid") else torch.zeros(prompt, dtype=torch.bool)
            cols[k].append(torch.cat([pre, real]))
        cu.append(cu[-1] + prompt + n)
        pid.append(torch.arange(prompt + n))
    for k in PER_TOKEN:
        pad = torch.zeros(tail, dtype=d[k].dtype) if k in ("mask", "valid") else torch.full((tail,), 888, dtype=d[k].dtype)
        cols[k] = torch.cat(cols[k] + [pad])[None, :]
    pid = torch.cat(pid + [torch.arange(tail)])[None, :]
    return cols, torch.tensor(cu, dtype=torch.int32), pid


def log(hook, d, step=0, **kw):
    args = {k: d[k] for k in ("logp", "mask", "valid", "token_ids", "sample_ids", "advantages", *OPTIONAL)}
    args.update(kw)
    hook.log_loss_call(step=step, **args)


def shard_bytes(run):
    return {s.path.relative_to(run).as_posix(): s.path.read_bytes() for t in fmt.TABLES for s in fmt.list_shards(run, t)}


def reference_rows(d):
    """Plain python over the padded tensors: one row per real token, sorted by (sample_id, pos)."""
    rows = []
    for b in range(len(d["lens"])):
        for t in range(int(d["lens"][b])):
            rows.append((int(d["sample_ids"][b]), t, float(d["logp"][b, t]), float(d["advantages"][b]),
                         bool(d["mask"][b, t]), int(d["token_ids"][b, t]), *(float(d[k][b, t]) for k in OPTIONAL)))
    return sorted(rows)


def table_rows(run):
    (s,) = fmt.list_shards(run)
    t = pq.read_table(s.path)
    names = ("sample_id", "pos", "logp", "advantage", "mask", "token_id", *OPTIONAL)
    return list(zip(*(t.column(n).to_pylist() for n in names)))


def test_padded_rows_match_python_reference(tmp_path):
    d = make_batch(0)
    with GRPOLensHook(tmp_path) as hook:
        log(hook, d)
        hook.end_step(0)
    assert table_rows(tmp_path) == reference_rows(d)  # float32 values compare exactly after .tolist()


def test_padded_and_packed_layouts_give_byte_identical_shards(tmp_path):
    d = make_batch(1, min_len=1)  # position_ids cannot describe an empty sequence
    runs = {}

    def run(name, **kw):
        runs[name] = tmp_path / name
        with GRPOLensHook(runs[name], run_name="same") as hook:
            log(hook, d, step=3, **kw)
            hook.log_loss_call(step=3, logp=d["logp"][:2], advantages=d["advantages"][:2],
                               sample_ids=d["sample_ids"][:2] + 5000, mask=d["mask"][:2])  # a second call
            hook.end_step(3)

    run("padded")
    # Left padding: each row's real tokens at its end.
    T = d["logp"].shape[1]
    left = {k: torch.stack([torch.roll(d[k][b], T - int(n)) for b, n in enumerate(d["lens"])]) for k in PER_TOKEN}
    run("padded_left", **{k: left[k] for k in PER_TOKEN})
    cols, cu, pid = packed(d)
    run("cu_seqlens", **cols, cu_seqlens=cu)
    run("position_ids", **cols, position_ids=pid)
    cols1d = {k: v[0] for k, v in cols.items()}
    run("cu_seqlens_1d", **cols1d, cu_seqlens=cu.tolist())
    pcols, pcu, ppid = packed(d, prompt=2)  # prompt tokens in the packed row, not valid
    run("cu_with_prompts", **pcols, cu_seqlens=pcu)
    run("pid_with_prompts", **pcols, position_ids=ppid)
    reference = shard_bytes(runs["padded"])
    assert sorted(reference) == ["tokens/step=00000003/rank=00000.parquet"]
    for name, path in runs.items():
        assert shard_bytes(path) == reference, name


def test_packed_cu_seqlens_with_empty_sequences_matches_reference(tmp_path):
    d = make_batch(2, B=9)
    assert (d["lens"] == 0).any()
    cols, cu, _ = packed(d)
    with GRPOLensHook(tmp_path) as hook:
        log(hook, d, **cols, cu_seqlens=cu)
    assert table_rows(tmp_path) == reference_rows(d)


def test_advantages_per_token_equal_per_sequence(tmp_path):
    d = make_batch(3)
    per_token = d["advantages"][:, None].expand_as(d["logp"]).clone()
    for name, adv in (("seq", d["advantages"]), ("tok", per_token)):
        with GRPOLensHook(tmp_path / name) as hook:
            log(hook, d, advantages=adv)
    cols, cu, _ = packed(d)
    packed_adv = torch.cat([per_token[b, :n] for b, n in enumerate(d["lens"].tolist())] + [torch.zeros(3)])
    with GRPOLensHook(tmp_path / "packed_tok") as hook:
        log(hook, d, **cols, cu_seqlens=cu, advantages=packed_adv)
    assert shard_bytes(tmp_path / "seq") == shard_bytes(tmp_path / "tok") == shard_bytes(tmp_path / "packed_tok")


def test_old_entropy_and_rollout_rejected_follow_their_tokens(tmp_path):
    """The two optional verl columns, padded and packed: each stored token keeps its own value; a
    rejected token is a real token outside the mask."""
    d = make_batch(9, min_len=1)
    g = torch.Generator().manual_seed(9)
    d["old_entropy"] = torch.where(d["valid"], torch.rand(d["logp"].shape, generator=g) * 3, torch.full_like(d["logp"], 777))
    d["rollout_rejected"] = d["valid"] & ~d["mask"] & (torch.rand(d["logp"].shape, generator=g) < 0.5)
    assert d["rollout_rejected"].any()
    extra = ("old_entropy", "rollout_rejected")
    with GRPOLensHook(tmp_path / "padded") as hook:
        log(hook, d, old_entropy=d["old_entropy"], rollout_rejected=d["rollout_rejected"])
    per_token = {**d, "old_entropy": d["old_entropy"], "rollout_rejected": d["rollout_rejected"]}
    cols = {k: torch.cat([per_token[k][b, :n] for b, n in enumerate(d["lens"].tolist())])[None, :] for k in (*PER_TOKEN, *extra)}
    cu = torch.tensor([0, *np.cumsum(d["lens"].tolist())])
    with GRPOLensHook(tmp_path / "packed") as hook:
        log(hook, d, **cols, cu_seqlens=cu)
    assert shard_bytes(tmp_path / "padded") == shard_bytes(tmp_path / "packed")
    t = pq.read_table(fmt.list_shards(tmp_path / "padded")[0].path)
    want = sorted((int(d["sample_ids"][b]), i, float(d["old_entropy"][b, i]), bool(d["rollout_rejected"][b, i]))
                  for b in range(len(d["lens"])) for i in range(int(d["lens"][b])))
    got = list(zip(*(t.column(n).to_pylist() for n in ("sample_id", "pos", *extra))))
    assert got == want
    # without a mask (every valid token counts) the rejected flags still land on their rows
    with GRPOLensHook(tmp_path / "nomask") as hook:
        hook.log_loss_call(step=0, logp=d["logp"], advantages=d["advantages"], sample_ids=d["sample_ids"],
                           valid=d["valid"], rollout_rejected=torch.zeros_like(d["valid"]))
    t = pq.read_table(fmt.list_shards(tmp_path / "nomask")[0].path)
    assert t.num_rows == int(d["valid"].sum()) and not any(t.column("rollout_rejected").to_pylist())


def test_dtypes_are_converted_to_the_format_and_optional_columns_absent(tmp_path):
    d = make_batch(4)
    with GRPOLensHook(tmp_path) as hook:
        hook.log_loss_call(step=0, logp=d["logp"].to(torch.bfloat16), advantages=d["advantages"].double(),
                           sample_ids=d["sample_ids"].int(), mask=d["mask"].float(), valid=d["valid"].long(),
                           old_logp=d["old_logp"].double())
    (s,) = fmt.list_shards(tmp_path)
    t = pq.read_table(s.path)
    expected = fmt.arrow_schema(fmt.TOKENS, ["step", "rank", "micro_batch", "sample_id", "pos", "logp", "old_logp",
                                             "advantage", "mask"])
    assert t.schema.equals(expected, check_metadata=False), t.schema
    rows = sorted((int(d["sample_ids"][b]), t_, float(d["logp"][b, t_].to(torch.bfloat16).float()),
                   float(d["old_logp"][b, t_].float()), bool(d["mask"][b, t_]))
                  for b in range(len(d["lens"])) for t_ in range(int(d["lens"][b])))
    assert list(zip(*(t.column(n).to_pylist() for n in ("sample_id", "pos", "logp", "old_logp", "mask")))) == rows


def test_default_valid_is_mask_and_no_mask_means_every_token(tmp_path):
    d = make_batch(5)
    with GRPOLensHook(tmp_path / "m") as hook:
        hook.log_loss_call(step=0, logp=d["logp"], advantages=d["advantages"], sample_ids=d["sample_ids"], mask=d["mask"])
    t = pq.read_table(fmt.list_shards(tmp_path / "m")[0].path)
    assert t.num_rows == int(d["mask"].sum()) and all(t.column("mask").to_pylist())
    # pos counts the stored tokens of a sequence
    for sid in set(t.column("sample_id").to_pylist()):
        pos = [p for s, p in zip(t.column("sample_id").to_pylist(), t.column("pos").to_pylist()) if s == sid]
        assert pos == list(range(len(pos)))
    with GRPOLensHook(tmp_path / "none") as hook:
        hook.log_loss_call(step=0, logp=d["logp"], advantages=d["advantages"], sample_ids=d["sample_ids"])
    assert pq.read_table(fmt.list_shards(tmp_path / "none")[0].path).num_rows == d["logp"].numel()


def test_inputs_untouched_no_graph_and_training_unchanged(tmp_path):
    d = make_batch(6)
    logp = d["logp"].clone().requires_grad_(True)
    inputs = {**{k: d[k] for k in ("mask", "valid", "token_ids", "sample_ids", "advantages", *OPTIONAL)}, "logp": logp}
    before = {k: (v.detach().clone(), v._version) for k, v in inputs.items()}
    with GRPOLensHook(tmp_path) as hook:
        hook.log_loss_call(step=0, **inputs)
        loss = -(torch.exp(logp - d["old_logp"]) * d["advantages"][:, None] * d["mask"]).sum()
        loss.backward()
    expected_grad = -(torch.exp(d["logp"] - d["old_logp"]) * d["advantages"][:, None] * d["mask"])
    torch.testing.assert_close(logp.grad, expected_grad)
    for k, v in inputs.items():
        assert torch.equal(v.detach(), before[k][0]) and v._version == before[k][1], k


def test_reused_input_buffers_and_reused_host_blocks_keep_each_call_s_data(tmp_path):
    # A trainer that refills the same tensors in place for every call; the hook's own CPU blocks are
    # recycled once read. Every call must still be stored with the values it had when logged.
    buf = make_batch(10)
    batches = [make_batch(100 + i) for i in range(12)]
    with GRPOLensHook(tmp_path) as hook:
        for i, d in enumerate(batches):
            for k in ("logp", "mask", "valid", "token_ids", "advantages", *OPTIONAL):
                buf[k].copy_(d[k])
            log(hook, buf, step=i // 3)
            if i % 3 == 2:
                hook.end_step(i // 3)
    got = {}
    for s in fmt.list_shards(tmp_path):
        t = pq.read_table(s.path)
        names = ("micro_batch", "sample_id", "pos", "logp", "advantage", "mask", "token_id", *OPTIONAL)
        for row in zip(*(t.column(n).to_pylist() for n in names)):
            got.setdefault(3 * s.step + row[0], []).append(row[1:])
    # sample ids are the buffer's (never refilled), everything else comes from batch i
    for i, d in enumerate(batches):
        assert got[i] == reference_rows({**d, "sample_ids": buf["sample_ids"]}), i


def test_micro_batch_counter_per_step(tmp_path):
    d = make_batch(7, B=3)
    with GRPOLensHook(tmp_path) as hook:
        for step, mb in ((0, None), (0, None), (1, None), (0, 5), (0, None)):
            hook.log_loss_call(step=step, logp=d["logp"], advantages=d["advantages"], micro_batch=mb,
                               sample_ids=d["sample_ids"] + 10 * step, mask=d["mask"])
        hook.end_step(0)
        hook.end_step(1)
    got = {s.step: sorted(set(pq.read_table(s.path).column("micro_batch").to_pylist())) for s in fmt.list_shards(tmp_path)}
    assert got == {0: [0, 1, 5, 6], 1: [0]}


@pytest.mark.parametrize("kwargs, message", [
    ({"logp": torch.zeros(3, 4)}, r"padded logp must be \(B, T\) with B = len\(sample_ids\) = 2"),
    ({"mask": torch.ones(2, 5, dtype=torch.bool)}, r"mask must have the shape of logp \(2, 4\)"),
    ({"advantages": torch.zeros(3)}, r"advantages must be \(2,\) per sequence or \(2, 4\) per token"),
    ({"sample_ids": torch.zeros(2, 1)}, "sample_ids must be 1-D"),
    ({"sample_ids": torch.tensor([0.5, 1.5])}, "sample_ids must be integers, got torch.float32"),
    ({"logp": torch.zeros(2, 4, dtype=torch.long)}, "logp must be a floating-point tensor"),
    ({"cu_seqlens": [0, 4, 8], "position_ids": torch.arange(8)}, "cu_seqlens or position_ids, not both"),
    ({"logp": torch.zeros(8), "mask": None, "cu_seqlens": [0, 4]}, r"cu_seqlens must be \(3,\)"),
    ({"logp": torch.zeros(8), "mask": None, "cu_seqlens": [0, 5, 4]}, "cu_seqlens must start at 0, never decrease"),
    ({"logp": torch.zeros(8), "mask": None, "cu_seqlens": [0, 4, 9]}, "cu_seqlens must start at 0"),
    ({"logp": torch.zeros(8), "mask": None, "position_ids": torch.tensor([0, 1, 0, 1, 0, 1, 2, 3])},
     "position_ids describe 3 sequences but sample_ids has 2, and the extra ones hold real tokens"),
    ({"logp": torch.zeros(8), "mask": None, "position_ids": torch.tensor([1, 2, 0, 1, 0, 1, 2, 3])},
     "position_ids must start at 0"),
])
def test_bad_inputs_raise_naming_the_argument(tmp_path, kwargs, message):
    args = {"step": 0, "logp": torch.zeros(2, 4), "advantages": torch.zeros(2), "sample_ids": torch.arange(2),
            "mask": torch.ones(2, 4, dtype=torch.bool), **kwargs}
    with GRPOLensHook(tmp_path) as hook:
        with pytest.raises(ValueError, match=message):
            hook.log_loss_call(**args)
    assert fmt.list_shards(tmp_path) == []


def test_log_samples(tmp_path):
    with GRPOLensHook(tmp_path) as hook:
        hook.log_samples(step=2, sample_ids=torch.tensor([4, 5, 6]), group_ids=[0, 0, 1],
                         completion_lens=torch.tensor([10, 3, 0]), truncated=torch.tensor([True, False, False]),
                         rewards={"accuracy": [1.0, None, 0.0], "format": torch.tensor([0.5, 1.0, 1.0])},
                         reward=torch.tensor([1.5, float("nan"), 1.0]), advantages=torch.tensor([0.7, 0.0, -0.7]),
                         prompt_lens=[8, 8, 12], prompts=["p", "p", "q"], completions=["a", "[bold]b", None])
        with pytest.raises(ValueError, match="group_id has 2 values but sample_ids has 3"):
            hook.log_samples(step=2, sample_ids=[1, 2, 3], group_ids=[0, 0], completion_lens=[1, 1, 1],
                             truncated=[False] * 3)
        with pytest.raises(ValueError, match="reward function names"):
            hook.log_samples(step=2, sample_ids=[1], group_ids=[0], completion_lens=[1], truncated=[False],
                             rewards={"a/b": [1.0]})
    (s,) = fmt.list_shards(tmp_path, fmt.SAMPLES)
    rows = pq.read_table(s.path).to_pylist()
    assert rows[1] == {"step": 2, "rank": 0, "sample_id": 5, "group_id": 0, "prompt_len": 8, "completion_len": 3,
                       "truncated": False, "reward": None, "advantage": 0.0, "prompt": "p", "completion": "[bold]b",
                       "reward/accuracy": None, "reward/format": 1.0}
    assert [r["reward/accuracy"] for r in rows] == [1.0, None, 0.0]


def test_log_samples_generation_round(tmp_path):
    """``generations``: one round index per completion, or one int for all; stored as int64 and
    validated like the other columns."""
    with GRPOLensHook(tmp_path) as hook:
        hook.log_samples(step=1, sample_ids=[1, 2], group_ids=[0, 0], completion_lens=[3, 4], truncated=[False] * 2,
                         generations=7)
        hook.log_samples(step=1, sample_ids=[3, 4], group_ids=[1, 1], completion_lens=[3, 4], truncated=[False] * 2,
                         generations=torch.tensor([8, 8]))
        with pytest.raises(ValueError, match="generation has 1 values but sample_ids has 2"):
            hook.log_samples(step=1, sample_ids=[5, 6], group_ids=[2, 2], completion_lens=[1, 1],
                             truncated=[False] * 2, generations=[9])
    (s,) = fmt.list_shards(tmp_path, fmt.SAMPLES)
    t = pq.read_table(s.path)
    assert t.schema.field("generation").type == pa.int64()
    assert t.column("generation").to_pylist() == [7, 7, 8, 8]
    assert validate_run(tmp_path).ok


def test_manifest_and_disabled_hook(tmp_path):
    with GRPOLensHook(tmp_path / "run", config={"loss_type": "dapo", "epsilon_high": 0.28},
                      trainer={"name": "trl", "version": "0.21"}) as hook:
        assert (hook.rank, hook.world_size) == (0, 1)
    m = fmt.read_manifest(tmp_path / "run")
    assert (m.run_name, m.world_size, m.trainer, m.config) == (
        "run", 1, {"name": "trl", "version": "0.21"}, {"loss_type": "dapo", "epsilon_high": 0.28})
    d = make_batch(8)
    with GRPOLensHook(tmp_path / "off", enabled=False) as hook:
        log(hook, d)
        hook.end_step(0)
    assert not (tmp_path / "off").exists()


def test_rank_and_world_size_come_from_torch_distributed(tmp_path):
    """A real 2-rank gloo group: rank 0 here, rank 1 in a child process (see helpers/dist_hook.py)."""
    import torch.distributed as dist

    run, store = tmp_path / "run", tmp_path / "store"
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "dist_hook.py"), str(store), str(run), "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(store), 2), rank=0, world_size=2)
        try:
            with GRPOLensHook(run, config={"written_by": 0}) as hook:
                assert (hook.rank, hook.world_size) == (0, 2)
                hook.log_loss_call(step=0, logp=torch.randn(2, 3), advantages=torch.zeros(2), sample_ids=torch.arange(2))
                hook.end_step(0)
            dist.barrier()  # now rank 1 starts its hook
            out = child.communicate(timeout=120)[0]
        finally:
            dist.destroy_process_group()
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, out
    shards = fmt.list_shards(run)
    assert [(s.step, s.rank) for s in shards] == [(0, 0), (0, 1)]
    for s in shards:
        assert set(pq.read_table(s.path).column("rank").to_pylist()) == {s.rank}
    m = fmt.read_manifest(run)
    assert m.world_size == 2 and m.config == {"written_by": 0}  # rank 1 (which ran last) wrote no manifest


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inputs_give_the_same_shards_as_cpu(tmp_path):
    d = make_batch(9)
    cols, cu, _ = packed(d)
    with GRPOLensHook(tmp_path / "cpu") as hook:
        log(hook, d)
        log(hook, d, step=1, **cols, cu_seqlens=cu)
    dev = {k: v.cuda() for k, v in d.items()}
    cols_dev = {k: v.cuda() for k, v in cols.items()}
    with GRPOLensHook(tmp_path / "cuda") as hook:
        log(hook, dev)
        log(hook, dev, step=1, **cols_dev, cu_seqlens=cu.cuda())
        for k in PER_TOKEN:  # the training thread may overwrite its buffers right after the call
            dev[k].zero_()
            cols_dev[k].zero_()
    assert shard_bytes(tmp_path / "cuda") == shard_bytes(tmp_path / "cpu")


def test_docs_example_runs(tmp_path, monkeypatch):
    from grpolens.run.validate import validate_run

    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "hook.md").read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/hook.md", "exec"), {"__name__": "__docs__"})
    report = validate_run(tmp_path / "runs" / "toy")
    assert report.problems == [] and report.files == {fmt.TOKENS: 3, fmt.SAMPLES: 3}
