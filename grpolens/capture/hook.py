"""The torch front end of the writer: ``GRPOLensHook``, called from inside a trainer's loss.

The hook's job on the training thread is small and never blocks on the device: detach, gather the
per-token columns into one block on the tensors' device, start a ``non_blocking`` copy into pinned
host memory, record a CUDA event. Everything else (waiting for the copy, dropping padding,
positions, conversion, sorting, Parquet, I/O) runs on the :class:`~grpolens.capture.writer.ShardWriter`'s
background thread. On CPU the copy is a plain copy.

Why padding is dropped on the host and not on the device: keeping only the real tokens on the
device needs their count on the host before the copy can be sized, which is a device
synchronisation per loss call. Copying the padded block costs a few megabytes of PCIe traffic per
call instead and never stalls the training thread.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from grpolens.run import format as fmt
from grpolens.capture.writer import ShardWriter, WriterError, check_columns

__all__ = ["GRPOLensHook", "WriterError", "token_rows"]

_NUMPY_DTYPE = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
                torch.bool: np.bool_}


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    try:
        return torch.as_tensor(np.asarray(x))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected a tensor or an array, got {type(x).__name__} ({e})") from None


class _HostCopies:
    """Copies tensors to host memory without blocking: pinned buffers, ``non_blocking`` copies and one
    event per CUDA device; a plain copy on CPU; a blocking copy on other devices."""

    def __init__(self) -> None:
        self.cuda_devices: set[torch.device] = set()
        self.nbytes = 0

    def owned(self, t: torch.Tensor) -> np.ndarray:
        """Host array for a tensor this hook created (no extra copy when it is on CPU already)."""
        if t.device.type == "cpu":
            out = t
        elif t.device.type == "cuda":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            self.cuda_devices.add(t.device)
        else:
            out = t.to("cpu")
        self.nbytes += out.numel() * out.element_size()
        return out.numpy()

    def copy(self, x: Any, dtype: torch.dtype, name: str) -> np.ndarray:
        """Host copy of a caller's value, converted to ``dtype`` (the caller may reuse its buffer)."""
        if not isinstance(x, torch.Tensor):
            arr = np.array(x, dtype=_NUMPY_DTYPE[dtype])  # always a copy
            self.nbytes += arr.nbytes
            return arr
        x = x.detach()
        if x.device.type == "cpu":
            out = torch.empty(x.shape, dtype=dtype)
            out.copy_(x)
            self.nbytes += out.numel() * out.element_size()
            return out.numpy()
        if x.dtype != dtype:
            x = x.to(dtype)
        return self.owned(x)

    def ready(self) -> list[torch.cuda.Event]:
        """Events to wait on before reading the arrays (recorded now, after every copy)."""
        events = []
        for device in self.cuda_devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            events.append(ev)
        return events


class _BlockPool:
    """Reused CPU blocks for the stacked columns. A fresh multi-megabyte buffer per call costs a page
    fault per 4 KiB on the training thread (measured: 1-100 ms per call on a busy 2-core machine,
    against 0.3 ms with warm memory); blocks come back once the writer thread has read them."""

    def __init__(self, keep: int = 8):
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        n = rows * cols
        with self._lock:
            for i, b in enumerate(self._free):
                if b.dtype == dtype and n <= b.numel() <= 2 * n + 4096:
                    return self._free.pop(i)[:n].view(rows, cols)
        return torch.empty(max(n, 1), dtype=dtype)[:n].view(rows, cols)

    def give(self, block: torch.Tensor) -> None:
        base = block._base if block._base is not None else block
        with self._lock:
            self._free.append(base)
            if len(self._free) > self._keep:
                self._free.pop(0)


def _stack(columns: list[torch.Tensor], dtype: torch.dtype, device: torch.device, pool: _BlockPool) -> torch.Tensor:
    """One (C, L) block on ``device`` holding the flattened columns, converted to ``dtype``."""
    rows, cols = len(columns), columns[0].numel()
    if device.type == "cpu":
        block = pool.take(rows, cols, dtype)
    else:
        block = torch.empty((rows, cols), dtype=dtype, device=device)
    for i, col in enumerate(columns):
        block[i].view(col.shape).copy_(col)
    return block


def _segments(layout: tuple, n_seq: int, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each sequence in the flattened token axis; raises ValueError on bad input."""
    kind, value = layout
    n_tok = len(valid)
    if kind == "padded":
        width = value
        return np.arange(n_seq, dtype=np.int64) * width, np.full(n_seq, width, np.int64)
    if kind == "cu_seqlens":
        cu = value
        if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] > n_tok:
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at most at the {n_tok} packed "
                             f"tokens; got {cu.tolist() if len(cu) <= 16 else cu}")
        return cu[:-1], np.diff(cu)
    pid = value  # position_ids: a new sequence wherever they restart at 0
    starts = np.flatnonzero(pid == 0)
    if n_tok and (not len(starts) or starts[0] != 0):
        raise ValueError("position_ids must start at 0 (each packed sequence restarts at 0)")
    if len(starts) < n_seq:
        raise ValueError(f"position_ids describe {len(starts)} sequences but sample_ids has {n_seq}")
    end = n_tok
    if len(starts) > n_seq:  # trailing segments are accepted only as padding
        end = int(starts[n_seq])
        if valid[end:].any():
            raise ValueError(f"position_ids describe {len(starts)} sequences but sample_ids has {n_seq}, and the extra "
                             "ones hold real tokens (pass `mask`/`valid` so that padding is not real)")
        starts = starts[:n_seq]
    return starts.astype(np.int64), np.diff(np.append(starts, end)).astype(np.int64)


def token_rows(floats: np.ndarray, float_names: list[str], valid: np.ndarray, mask: np.ndarray,
               ints: Mapping[str, np.ndarray], sample_ids: np.ndarray, seq_advantage: np.ndarray | None,
               layout: tuple, bools: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Flat token columns (one row per stored token, in sequence order) from flattened per-token arrays.

    ``floats`` is a (C, L) block whose rows are ``float_names``; ``layout`` is ``("padded", T)``,
    ``("cu_seqlens", cu)`` or ``("position_ids", pid)``; ``bools`` are further boolean token
    columns (``rollout_rejected``), flattened like ``mask``. A token is stored when ``valid`` is true
    and it lies inside a sequence; ``pos`` counts the stored tokens of its sequence from 0, so padded
    and packed layouts of the same data give the same rows. Every returned array is a fresh copy.
    """
    starts, lengths = _segments(layout, len(sample_ids), valid)
    end = int(starts[-1] + lengths[-1]) if len(starts) else 0
    keep = valid[:end]
    idx = np.flatnonzero(keep)
    if layout[0] == "padded":
        seq = idx // layout[1]
    else:  # empty sequences share their start with the next one: side="right" skips them
        seq = np.searchsorted(starts, idx, side="right") - 1
    kept_before = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))[starts]  # stored tokens before each sequence
    gathered = floats[:, idx]
    cols = dict(zip(float_names, gathered))
    cols["sample_id"] = sample_ids[seq]
    cols["pos"] = (np.arange(len(idx), dtype=np.int64) - kept_before[seq]).astype(np.int32)
    cols["mask"] = mask[idx]
    for name, values in (bools or {}).items():
        cols[name] = values[idx]
    if seq_advantage is not None:
        cols["advantage"] = seq_advantage[seq]
    if "token_ids" in ints:
        cols["token_id"] = ints["token_ids"][idx]
    return cols


class GRPOLensHook:
    """Records a training rank's loss inputs into a grpolens run (see ``docs/hook.md``).

    ``rank``/``world_size`` default to ``torch.distributed``'s when it is initialised, else 0/1; pass
    the data-parallel rank explicitly under tensor or pipeline parallelism. Rank 0 writes the
    manifest. ``mode`` says what to do with a directory that already holds a run: ``"new"``
    (default) refuses it (:class:`~grpolens.capture.writer.RunExistsError`), ``"resume"`` keeps its
    complete steps and continues after them (rows logged again for a complete step are dropped),
    ``"overwrite"`` deletes it first. ``writer_kwargs`` go to
    :class:`~grpolens.capture.writer.ShardWriter` (``max_part_rows``, ``max_queue_bytes``,
    ``compression``). With ``enabled=False`` every method does nothing.
    """

    def __init__(self, run_dir, *, config: dict | None = None, run_name: str | None = None,
                 trainer: dict | None = None, rank: int | None = None, world_size: int | None = None,
                 enabled: bool = True, mode: str = "new", **writer_kwargs):
        self.enabled = enabled
        self.writer: ShardWriter | None = None
        self._next_micro_batch: dict[int, int] = {}
        self._pool = _BlockPool()
        if rank is None or world_size is None:
            dist = torch.distributed
            initialised = dist.is_available() and dist.is_initialized()
            if rank is None:
                rank = dist.get_rank() if initialised else 0
            if world_size is None:
                world_size = dist.get_world_size() if initialised else 1
        self.rank, self.world_size = rank, world_size
        if not enabled:
            return
        manifest = fmt.Manifest(
            run_name=run_name or (fmt.as_run(run_dir).name if fmt.is_remote_run(run_dir) else Path(run_dir).resolve().name),
            world_size=world_size,
            trainer={"name": None, "version": None, **(trainer or {})},
            config=dict(config or {}),
        )
        self.writer = ShardWriter(run_dir, rank, world_size, manifest=manifest, mode=mode, **writer_kwargs)

    # ------------------------------------------------------------------ per loss call

    def log_loss_call(self, *, step: int, logp, advantages, sample_ids, mask=None, valid=None, old_logp=None,
                      ref_logp=None, rollout_logp=None, entropy=None, token_ids=None, cu_seqlens=None,
                      position_ids=None, micro_batch: int | None = None, old_entropy=None,
                      rollout_rejected=None) -> None:
        """Record one loss call. Never modifies its inputs, never builds a graph, never waits for the device.

        Padded: per-token tensors are ``(B, T)``; ``sample_ids`` is ``(B,)``; ``advantages`` is ``(B,)``
        or ``(B, T)``. Packed: per-token tensors are ``(N,)`` or ``(1, N)`` and ``cu_seqlens`` ``(B+1,)``
        or ``position_ids`` (restarting at 0 at each sequence) say where sequences start;
        ``advantages`` is ``(B,)`` per sequence or per token. ``mask``: the token counts in the loss.
        ``valid``: the token is a real completion token (default: ``mask``); tokens that are not valid
        are padding and are not stored, valid tokens outside the mask are stored with ``mask=False``.
        ``micro_batch`` defaults to a counter per step. ``old_entropy``: the behaviour policy's entropy
        per token (verl's old-log-prob pass). ``rollout_rejected``: the tokens the trainer's rollout
        correction took out of the loss mask (they must be ``valid``, and ``mask`` false for them), so
        that the mask before rejection is kept: ``mask | rollout_rejected``.
        """
        if not self.enabled:
            return
        if cu_seqlens is not None and position_ids is not None:
            raise ValueError("log_loss_call: pass cu_seqlens or position_ids, not both")
        with torch.no_grad():
            self._log_loss_call(step, logp, advantages, sample_ids, mask, valid, old_logp, ref_logp, rollout_logp,
                                entropy, token_ids, cu_seqlens, position_ids, micro_batch, old_entropy,
                                rollout_rejected)

    def _log_loss_call(self, step, logp, advantages, sample_ids, mask, valid, old_logp, ref_logp, rollout_logp,
                       entropy, token_ids, cu_seqlens, position_ids, micro_batch, old_entropy=None,
                       rollout_rejected=None) -> None:
        logp = _as_tensor(logp, "logp")
        sample_ids_t = _as_tensor(sample_ids, "sample_ids")
        if sample_ids_t.dim() != 1:
            raise ValueError("log_loss_call: sample_ids must be 1-D (one id per sequence), "
                             f"got shape {tuple(sample_ids_t.shape)}")
        if sample_ids_t.dtype.is_floating_point or sample_ids_t.dtype.is_complex or sample_ids_t.dtype == torch.bool:
            raise ValueError(f"log_loss_call: sample_ids must be integers, got {sample_ids_t.dtype}")
        if not logp.dtype.is_floating_point:
            raise ValueError(f"log_loss_call: logp must be a floating-point tensor, got {logp.dtype}")
        n_seq = sample_ids_t.shape[0]
        packed = cu_seqlens is not None or position_ids is not None
        shape = tuple(logp.shape)
        if packed:
            if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
                raise ValueError(f"log_loss_call: packed logp must be (N,) or (1, N), got {shape}")
        elif len(shape) != 2 or shape[0] != n_seq:
            raise ValueError(f"log_loss_call: padded logp must be (B, T) with B = len(sample_ids) = {n_seq}, got {shape}"
                             " (packed inputs need cu_seqlens or position_ids)")
        n_tok = logp.numel()

        token_shapes = {(n_tok,), (1, n_tok)} if packed else {shape}  # packed: (N,) and (1, N) mix freely

        def per_token(x, name):
            t = _as_tensor(x, name)
            if tuple(t.shape) not in token_shapes:
                raise ValueError(f"log_loss_call: {name} must have the shape of logp {shape}, got {tuple(t.shape)}")
            return t.reshape(shape)

        adv = _as_tensor(advantages, "advantages")
        seq_adv = tuple(adv.shape) == (n_seq,)
        if not seq_adv:
            if tuple(adv.shape) not in token_shapes:
                raise ValueError(f"log_loss_call: advantages must be ({n_seq},) per sequence or {shape} per token, "
                                 f"got {tuple(adv.shape)}")
            adv = adv.reshape(shape)
        floats = {"logp": logp}
        for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("rollout_logp", rollout_logp),
                        ("entropy", entropy), ("old_entropy", old_entropy)):
            if x is not None:
                floats[name] = per_token(x, name)
        if not seq_adv:
            floats["advantage"] = adv
        mask_t = per_token(mask, "mask") if mask is not None else None
        valid_t = per_token(valid, "valid") if valid is not None else mask_t
        rejected_t = per_token(rollout_rejected, "rollout_rejected") if rollout_rejected is not None else None
        ints = {"token_ids": per_token(token_ids, "token_ids")} if token_ids is not None else {}
        if cu_seqlens is not None:
            cu_t = _as_tensor(cu_seqlens, "cu_seqlens")
            if tuple(cu_t.shape) != (n_seq + 1,):
                raise ValueError(f"log_loss_call: cu_seqlens must be ({n_seq + 1},) for {n_seq} sequences, "
                                 f"got {tuple(cu_t.shape)}")
        if position_ids is not None:
            ints["position_ids"] = per_token(position_ids, "position_ids")

        # Training thread: a few copies into blocks, all asynchronous on CUDA.
        device = logp.device
        host = _HostCopies()
        names = list(floats)
        pool = self._pool
        bools = ([mask_t] if mask_t is not None else []) + ([valid_t] if valid is not None else [])
        rejected_row = None
        if rejected_t is not None:
            rejected_row = len(bools)
            bools.append(rejected_t)
        blocks = [_stack([floats[n] for n in names], torch.float32, device, pool),
                  _stack(bools, torch.bool, device, pool) if bools else None,
                  _stack(list(ints.values()), torch.int32, device, pool) if ints else None]
        fblock, bblock, iblock = (host.owned(b) if b is not None else None for b in blocks)
        # CPU blocks go back to the pool once read; device blocks are dropped now (the allocator
        # orders their reuse after the copies on this stream), so queued calls hold no device memory.
        reusable = [b for b in blocks if b is not None] if device.type == "cpu" else []
        del blocks
        mask_row = 0 if mask_t is not None else None
        valid_row = (1 if mask_t is not None else 0) if valid is not None else mask_row
        sids = host.copy(sample_ids_t, torch.int64, "sample_ids")
        adv_np = host.copy(adv, torch.float32, "advantages") if seq_adv else None
        cu = host.copy(cu_t, torch.int64, "cu_seqlens") if cu_seqlens is not None else None
        events = host.ready()
        int_names = list(ints)

        def load() -> dict[str, np.ndarray]:
            for ev in events:
                ev.synchronize()
            int_cols = dict(zip(int_names, iblock)) if iblock is not None else {}
            valid_np = bblock[valid_row] if valid_row is not None else np.ones(n_tok, bool)
            mask_np = bblock[mask_row] if mask_row is not None else np.ones(n_tok, bool)
            if cu is not None:
                layout = ("cu_seqlens", cu)
            elif "position_ids" in int_cols:
                layout = ("position_ids", int_cols["position_ids"])
            else:
                layout = ("padded", shape[1])
            extra = {"rollout_rejected": bblock[rejected_row]} if rejected_row is not None else None
            rows = token_rows(fblock, names, valid_np, mask_np, int_cols, sids, adv_np, layout, extra)
            for b in reusable:  # read and copied: the blocks can serve a later call
                pool.give(b)
            return rows

        if not events and packed:  # the data is on the host already: report bad packing now, not later
            valid_np = bblock[valid_row] if valid_row is not None else np.ones(n_tok, bool)
            layout = ("cu_seqlens", cu) if cu is not None else ("position_ids", iblock[int_names.index("position_ids")])
            _segments(layout, n_seq, valid_np)

        if micro_batch is None:
            micro_batch = self._next_micro_batch.get(step, 0)
        self._next_micro_batch[step] = max(self._next_micro_batch.get(step, 0), micro_batch + 1)
        if len(self._next_micro_batch) > 4096:  # forget the oldest steps
            for old in sorted(self._next_micro_batch)[:2048]:
                del self._next_micro_batch[old]
        self.writer.add_tokens_deferred(step, micro_batch, load, host.nbytes)

    # ------------------------------------------------------------------ per completion

    def log_samples(self, *, step: int, sample_ids, group_ids, completion_lens, truncated,
                    rewards: dict | None = None, reward=None, advantages=None, prompt_lens=None,
                    prompts=None, completions=None, generations=None) -> None:
        """Record the completions generated in ``step``: one value per completion in each argument.

        ``rewards`` maps a reward function's name to its raw (unweighted) values; ``reward`` is the
        weighted total. NaN or None rewards are stored as null (the function could not score it).
        ``prompts``/``completions`` are optional text. ``generations`` is the trainer's
        generation-round index of each completion (or one int for all), unique within the run:
        needed where a step holds several rounds that the trainer logs one by one.
        """
        if not self.enabled:
            return
        n = len(sample_ids)
        if isinstance(generations, (int, np.integer)):
            generations = [int(generations)] * n
        host = _HostCopies()
        numeric = {"sample_id": (sample_ids, torch.int64), "group_id": (group_ids, torch.int64),
                   "completion_len": (completion_lens, torch.int64), "truncated": (truncated, torch.bool),
                   "reward": (reward, torch.float64), "advantage": (advantages, torch.float32),
                   "prompt_len": (prompt_lens, torch.int64), "generation": (generations, torch.int64)}
        for name, values in (rewards or {}).items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"log_samples: reward function names must be non-empty strings without '/', got {name!r}")
            numeric[fmt.REWARD_PREFIX + name] = (values, torch.float64)
        cols: dict[str, Any] = {}
        for name, (values, dtype) in numeric.items():
            if values is None:
                continue
            if isinstance(values, torch.Tensor) and values.dim() != 1:
                raise ValueError(f"log_samples: {name} must be 1-D (one value per completion), got {tuple(values.shape)}")
            if len(values) != n:
                raise ValueError(f"log_samples: {name} has {len(values)} values but sample_ids has {n}")
            if isinstance(values, (list, tuple)) and dtype == torch.float64:
                values = [np.nan if v is None else v for v in values]
            cols[name] = host.copy(values, dtype, name)
        for name, texts in (("prompt", prompts), ("completion", completions)):
            if texts is not None:
                cols[name] = list(texts)
        events = host.ready()
        if not events:
            self.writer.add_samples(step, cols)
            return
        check_columns(fmt.SAMPLES, cols, f"log_samples(step={step})")  # shapes and names now; values later

        def load() -> dict[str, Any]:
            for ev in events:
                ev.synchronize()
            return cols

        self.writer.add_samples_deferred(step, load, host.nbytes + sum(len(s or "") for s in cols.get("prompt", [])))

    # ------------------------------------------------------------------ lifecycle

    def end_step(self, step: int) -> None:
        """The optimizer step is done on this rank: its shards are written in the background."""
        if self.enabled:
            self.writer.end_step(step)

    def flush(self) -> None:
        """Write everything logged so far and wait for it (e.g. before a checkpoint)."""
        if self.enabled:
            self.writer.flush()

    def close(self) -> None:
        """Write everything and stop the writer thread. Idempotent; raises WriterError if writing failed."""
        if self.enabled:
            self.writer.close()

    def __enter__(self) -> "GRPOLensHook":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.enabled:
            self.writer.__exit__(exc_type, exc, tb)
