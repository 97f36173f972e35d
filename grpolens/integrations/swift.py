"""ms-swift integration: record what ms-swift's ``GRPOTrainer`` trains on into a grpolens run.

ms-swift is not imported here: its trainer, samples and ``GRPOBatch`` are read by attribute. One
line after the trainer is built (``docs/integrations/swift.md``)::

    from grpolens.integrations.swift import SwiftCapture

    capture = SwiftCapture("runs/my-run", trainer)   # config from trainer.args (swift_config)
    trainer.train()
    capture.close()

``SwiftCapture(run, trainer)`` wraps three of the trainer's methods on the instance (a subclass can
call the same three methods instead, see the docs):

* ``_postprocess_batch`` (after ms-swift computed the advantages of a generation round): the
  round's completions on this rank, with each reward function's raw score and the weighted
  total, completion length, truncation and the round index (``log_rollout``);
* ``_get_per_token_logps_and_entropies``: the current policy's log-probs and entropies, kept only
  inside ``_compute_loss_and_metrics`` (not the old-policy or reference passes at generation);
* ``_compute_loss_and_metrics``: one loss call with the micro-batch's old, reference and rollout
  log-probs, per-token advantages, ``valid`` (ms-swift's completion mask) and ``mask`` (after
  ``overlong_filter``), as ``grpolens.profiles.swift`` reads them (``log_loss``).

The step is ms-swift's ``state.global_step + 1`` (the step it logs the micro-batch's metrics at);
a step's shards are written when the next step's first record comes, and on ``close``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

__all__ = ["SwiftCapture", "SAMPLE_ID_STRIDE"]

#: ``sample_id = round * SAMPLE_ID_STRIDE + index`` (index: the completion's place in the round, all ranks)
SAMPLE_ID_STRIDE = 1_000_000


class SwiftCapture:
    """Writes an ms-swift GRPO trainer's rounds and loss calls through
    :class:`~grpolens.capture.hook.GRPOLensHook` (``config`` defaults to
    ``grpolens.profiles.swift.swift_config(trainer.args)``; ``rank``/``world_size`` to the trainer's
    accelerator; ``mode`` as for the hook). ``hook``: any object with the hook's ``log_samples``,
    ``log_loss_call``, ``end_step`` and ``close`` (for tests; the writer hook by default)."""

    def __init__(self, run_dir, trainer: Any = None, *, config: dict | None = None, rank: int | None = None,
                 world_size: int | None = None, enabled: bool = True, run_name: str | None = None,
                 mode: str = "new", hook: Any = None, **writer_kwargs):
        acc = getattr(trainer, "accelerator", None)
        if rank is None and acc is not None:
            rank = int(acc.process_index)
        if world_size is None and acc is not None:
            world_size = int(acc.num_processes)
        if config is None and trainer is not None:
            from grpolens.profiles.swift import swift_config

            config = swift_config(trainer.args)
        if hook is None:
            from grpolens.capture.hook import GRPOLensHook
            from grpolens.integrations import trainer_info

            hook = GRPOLensHook(run_dir, config=config, run_name=run_name, trainer=trainer_info("ms-swift"), rank=rank,
                                world_size=world_size, enabled=enabled, mode=mode, **writer_kwargs)
        self.hook, self.enabled = hook, enabled
        self.round = -1
        self._open: int | None = None  # the step whose shards are not written yet
        self._ids: dict[int, tuple[Any, torch.Tensor]] = {}  # id(grpo_batch) -> (batch, its rows' sample ids)
        self._forward: tuple | None = None
        self._in_loss = False
        if trainer is not None:
            self.attach(trainer)

    # ------------------------------------------------------------------------------ wiring

    def attach(self, trainer: Any) -> None:
        """Wrap the trainer's ``_postprocess_batch``, ``_get_per_token_logps_and_entropies`` and
        ``_compute_loss_and_metrics`` on this instance. Refuses what ms-swift computes elsewhere."""
        for name in ("use_liger_loss", "enable_server_multi_turn", "use_gym_env"):
            if getattr(trainer, name, False):
                raise ValueError(f"SwiftCapture: trainer.{name} is set: ms-swift then computes the loss outside "
                                 f"_compute_loss_and_metrics (or chunked per request), which the capture does not record")
        post, forward, loss = (trainer._postprocess_batch, trainer._get_per_token_logps_and_entropies,
                               trainer._compute_loss_and_metrics)

        def _postprocess_batch(samples, batch_encoded_inputs, *a, **k):
            out = post(samples, batch_encoded_inputs, *a, **k)
            self.log_rollout(trainer, samples, batch_encoded_inputs)
            return out

        def _get_per_token_logps_and_entropies(*a, **k):
            out = forward(*a, **k)
            if self._in_loss:
                self._forward = out
            return out

        def _compute_loss_and_metrics(model, model_inputs, grpo_batch, *a, **k):
            with self._loss_call():
                out = loss(model, model_inputs, grpo_batch, *a, **k)
                per_token_logps, entropies = self._forward or (None, None)
            if per_token_logps is not None:
                self.log_loss(trainer, grpo_batch, per_token_logps, entropies)
            return out

        trainer._postprocess_batch = _postprocess_batch
        trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies
        trainer._compute_loss_and_metrics = _compute_loss_and_metrics

    @contextlib.contextmanager
    def _loss_call(self):
        self._in_loss, self._forward = True, None
        try:
            yield
        finally:
            self._in_loss = False

    # ------------------------------------------------------------------------------ records

    def _step(self, trainer: Any) -> int:
        step = int(trainer.state.global_step) + 1
        if self._open is not None and step != self._open:
            self.hook.end_step(self._open)
        self._open = step
        return step

    def log_rollout(self, trainer: Any, samples: list, batch_encoded_inputs: list) -> None:
        """After ms-swift's ``_postprocess_batch``: this rank's completions of the round (the kept
        ones under dynamic sampling), in the order of its micro-batches' rows."""
        if not trainer.model.training:  # evaluation rounds are not trained on
            return
        self.round += 1
        self._ids = {}
        batches = [b["grpo_batch"] for b in batch_encoded_inputs]
        n = sum(int(b.completion_mask.shape[0]) for b in batches)
        if n != len(samples):
            raise ValueError(f"SwiftCapture.log_rollout: {n} rows in the micro-batches for {len(samples)} samples")
        total = trainer._rewards_per_func  # every rank's completions, in rank order
        world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
        base, rem = divmod(int(total.shape[0]), world)  # ms-swift's get_even_process_data split
        start = rank * base + min(rank, rem)
        index = torch.arange(start, start + n, dtype=torch.int64)
        ids = self.round * SAMPLE_ID_STRIDE + index
        groups = self.round * SAMPLE_ID_STRIDE + index // int(trainer.num_generations)
        row = 0
        for b in batches:
            k = int(b.completion_mask.shape[0])
            self._ids[id(b)] = (b, ids[row:row + k])
            row += k
        step = self._step(trainer)
        if not self.enabled:
            return
        rw = total[start:start + n].detach().double().cpu()
        weights = trainer.reward_weights.detach().double().cpu()
        lens = torch.cat([b.completion_mask.sum(1).cpu() for b in batches]).to(torch.int64)
        trunc = torch.cat([torch.as_tensor(b.truncated_mask).reshape(-1).cpu() for b in batches]).bool()
        names = [str(x) for x in trainer.reward_func_names]
        self.hook.log_samples(step=step, sample_ids=ids, group_ids=groups, completion_lens=lens, truncated=trunc,
                              rewards={f: rw[:, j].numpy() for j, f in enumerate(names)},
                              reward=torch.from_numpy(np.nansum((rw * weights).numpy(), axis=1)),
                              advantages=torch.stack([torch.as_tensor(s.advantages).reshape(()).cpu().float()
                                                      for s in samples]) if samples else None,
                              generations=self.round)

    def log_loss(self, trainer: Any, grpo_batch: Any, per_token_logps, entropies=None) -> None:
        """One ``_compute_loss_and_metrics`` call: the forward's log-probs (and entropies) with the
        micro-batch's other columns."""
        if not trainer.model.training:
            return
        kept = self._ids.get(id(grpo_batch))
        if kept is None or kept[0] is not grpo_batch:
            raise RuntimeError("SwiftCapture.log_loss: a micro-batch from no recorded round: attach the capture "
                               "before training starts (docs/integrations/swift.md)")
        step = self._step(trainer)
        if not self.enabled:
            return
        valid = grpo_batch.completion_mask.bool()
        mask = valid
        if trainer.overlong_filter:
            mask = valid & ~torch.as_tensor(grpo_batch.truncated_mask, device=valid.device).bool().reshape(-1, 1)
        old = grpo_batch.old_per_token_logps
        ref = grpo_batch.ref_per_token_logps if trainer.beta != 0.0 else None
        self.hook.log_loss_call(step=step, logp=per_token_logps.detach().float(), advantages=grpo_batch.advantages,
                                sample_ids=kept[1], mask=mask, valid=valid,
                                old_logp=per_token_logps.detach().float() if old is None else old, ref_logp=ref,
                                rollout_logp=grpo_batch.rollout_per_token_logps,
                                entropy=None if entropies is None else entropies.detach().float())

    def end_step(self, step: int | None = None) -> None:
        """Write the open step's shards now (done by the next record and by ``close`` otherwise)."""
        step = self._open if step is None else step
        if step is not None:
            self.hook.end_step(step)
        if step == self._open:
            self._open = None

    def close(self) -> None:
        self.end_step()
        self.hook.close()

