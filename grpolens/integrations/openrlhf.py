"""OpenRLHF integration: record what OpenRLHF's PPO/GRPO actor trains on into a grpolens run.

OpenRLHF is not imported here (it needs Ray, DeepSpeed and vLLM); its ``Experience`` batches are
read by attribute. Two lines on the driver, four in the actor (``docs/integrations/openrlhf.md``)::

    from grpolens.integrations.openrlhf import OpenRLHFCapture, openrlhf_config, tag_experiences, keep_reference

    # RemoteExperienceMaker.make_experience, in its loop, before base_action_log_probs may be dropped:
    keep_reference(samples, base_action_log_probs)
    # PPOTrainer.train_step, after experiences = self.experience_maker.make_experience_batch(...):
    tag_experiences(experiences, step=global_step + 1, n_samples_per_prompt=self.args.rollout.n_samples_per_prompt)

    # ActorPPOTrainer.__init__ (each rank):
    self.grpolens = OpenRLHFCapture("runs/my-run", config=openrlhf_config(self.args, strategy))
    # ActorPPOTrainer.ppo_train, first line / last line before return:
    self.grpolens.begin_step(self.replay_buffer)
    self.grpolens.end_step()
    # ActorPPOTrainer.training_step, after self.actor_loss_fn(...):
    self.grpolens.log_micro_batch(experience, action_log_probs, entropy=output.entropy if "entropy" in output else None)

The ids travel with the rows in ``Experience.info`` (``info`` entries are split, unpadded and
collated with the rows by OpenRLHF's replay buffer); ``log_micro_batch`` takes them out again
before ``training_step`` turns ``info`` into its logged status, so OpenRLHF logs nothing new.

Each row's tokens are the span from its first to its last action token (``action_mask``, which
covers the prompt and, in multi-turn runs, the environment's tokens with 0): ``completion_len`` is
OpenRLHF's ``response_length`` (that span) and ``prompt_len`` the other observation tokens
(``total_length − response_length``), so that the samples table holds what OpenRLHF's per-sample
status and rollout statistics read.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from grpolens.capture.hook import GRPOLensHook
from grpolens.integrations import trainer_info

__all__ = ["OpenRLHFCapture", "openrlhf_config", "tag_experiences", "keep_reference"]

#: ``Experience.info`` keys the ids (and, without the KL loss, the reference log-probs) travel in
SAMPLE_ID_KEY = "grpolens_sample_id"
GROUP_ID_KEY = "grpolens_group_id"
REF_KEY = "grpolens_ref_logp"
_KEYS = (SAMPLE_ID_KEY, GROUP_ID_KEY, REF_KEY)
#: ``sample_id = step * SAMPLE_ID_STRIDE + index`` (index: the row's place in the step's rollout batch)
SAMPLE_ID_STRIDE = 1_000_000

#: OpenRLHF's arguments (dotted, as its CLI spells them) that its logged status depends on
SETTINGS = ("actor.policy_loss_type", "actor.loss_agg_mode", "actor.eps_clip_low_high", "actor.dual_clip",
            "actor.entropy_coef", "algo.kl.use_loss", "algo.kl.init_coef", "algo.kl.estimator",
            "algo.advantage.estimator", "algo.advantage.is_correction_level", "algo.advantage.is_correction_mode",
            "algo.advantage.is_correction_gating", "algo.advantage.is_correction_threshold",
            "rollout.n_samples_per_prompt", "train.max_epochs", "data.max_len", "reward.clip_range",
            "train.dynamic_batch_enable", "train.micro_batch_size")


def _lookup(args: Any, dotted: str):
    x = args
    for part in dotted.split("."):
        x = x.get(part) if isinstance(x, Mapping) else getattr(x, part, None)
        if x is None:
            return None
    return x


def _plain(v):
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.generic, torch.Tensor)):
        return v.item()
    return v


def openrlhf_config(args: Any, strategy: Any = None) -> dict[str, Any]:
    """The run config for OpenRLHF ``args`` (its hierarchical namespace or a dict of the same
    shape, or flat dotted keys): grpolens' own settings (loss type, clip range, KL coefficient,
    group size, epochs) and ``openrlhf_args``, OpenRLHF's settings by its own names, with the
    strategy's ``accumulated_gradient`` (micro-batches per optimizer step and rank)."""
    flat = args if isinstance(args, Mapping) and any("." in k for k in args) else None
    get = (lambda k: flat.get(k)) if flat is not None else (lambda k: _lookup(args, k))  # noqa: E731
    o = {k: _plain(get(k)) for k in SETTINGS if get(k) is not None}
    eps = o.get("actor.eps_clip_low_high")
    if eps is None and get("actor.eps_clip") is not None:
        eps = o["actor.eps_clip_low_high"] = [float(get("actor.eps_clip"))] * 2
    gas = getattr(strategy, "accumulated_gradient", None) if strategy is not None else get("accumulated_gradient")
    if gas is not None:
        o["accumulated_gradient"] = int(gas)
    gspo = o.get("actor.policy_loss_type") == "gspo"
    token_mean = o.get("actor.loss_agg_mode", "token-mean") == "token-mean" and not gspo
    cfg: dict[str, Any] = {
        "loss_type": "gspo" if gspo else ("bnpo" if token_mean else "grpo"),
        "importance_sampling_level": "sequence" if gspo else "token",
        "beta": float(o.get("algo.kl.init_coef", 0.01)) if o.get("algo.kl.use_loss") else 0.0,
        "num_iterations": int(o.get("train.max_epochs", 1)),
        "openrlhf_args": o,
    }
    if eps is not None:
        cfg["epsilon"], cfg["epsilon_high"] = float(eps[0]), float(eps[1])
    if o.get("rollout.n_samples_per_prompt"):
        cfg["num_generations"] = int(o["rollout.n_samples_per_prompt"])
    if gas is not None:
        cfg["gradient_accumulation_steps"] = int(gas)
    return cfg


# ---------------------------------------------------------------------------------------------- driver side

def keep_reference(samples: Any, base_action_log_probs) -> None:
    """In ``RemoteExperienceMaker.make_experience``: keep the reference log-probs with the rows
    (OpenRLHF drops them without the KL loss, and its ``kl`` status is then the experience's
    per-sample KL against them). Nothing to keep without a reference model."""
    if base_action_log_probs is None:
        return
    mask = samples.action_mask.bool()
    samples.info[REF_KEY] = [row[m].float().cpu() for row, m in zip(base_action_log_probs, mask)]


def tag_experiences(experiences: list, *, step: int, n_samples_per_prompt: int) -> None:
    """In ``PPOTrainer.train_step``, after the experience maker: each row's sample id and prompt
    group (its ``index`` in the rollout batch, whose ``n_samples_per_prompt`` consecutive rows share
    a prompt) in ``info``, where they follow the row to the actor."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"tag_experiences: n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    for exp in experiences:
        index = torch.as_tensor(list(exp.index), dtype=torch.int64)
        if len(index) and int(index.max()) >= SAMPLE_ID_STRIDE:
            raise ValueError(f"tag_experiences: {int(index.max()) + 1} rows in one step exceed {SAMPLE_ID_STRIDE}")
        exp.info[SAMPLE_ID_KEY] = int(step) * SAMPLE_ID_STRIDE + index
        exp.info[GROUP_ID_KEY] = int(step) * SAMPLE_ID_STRIDE + index // n_samples_per_prompt


# ---------------------------------------------------------------------------------------------- actor side

def _ids(info: Mapping, key: str, n: int, where: str) -> torch.Tensor:
    v = info.get(key)
    if v is None:
        raise KeyError(f"OpenRLHFCapture.{where}: the experience has no info[{key!r}]: call tag_experiences(...) "
                       f"on the driver after make_experience_batch (docs/integrations/openrlhf.md)")
    t = torch.stack([torch.as_tensor(x).reshape(()) for x in v]) if isinstance(v, list) else torch.as_tensor(v)
    t = t.reshape(-1).to(torch.int64)
    if len(t) != n:
        raise ValueError(f"OpenRLHFCapture.{where}: info[{key!r}] has {len(t)} ids for {n} rows")
    return t


def _span(action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first action position and the length of its action span (first to last action token)."""
    m = action_mask.bool()
    width = m.shape[1]
    any_ = m.any(1)
    first = torch.where(any_, m.int().argmax(1), torch.zeros_like(any_, dtype=torch.int64))
    last = width - 1 - m.flip(1).int().argmax(1)
    return first, torch.where(any_, last - first + 1, torch.zeros_like(first))


class OpenRLHFCapture:
    """Writes an OpenRLHF actor's replay buffer and micro-batches through
    :class:`~grpolens.capture.hook.GRPOLensHook` (``rank``/``world_size`` default to
    torch.distributed's; ``mode`` as for the hook: ``new``, ``resume`` or ``overwrite``)."""

    def __init__(self, run_dir, *, config: dict | None = None, rank: int | None = None,
                 world_size: int | None = None, enabled: bool = True, run_name: str | None = None,
                 mode: str = "new", **writer_kwargs):
        self.enabled = enabled
        self.hook = GRPOLensHook(run_dir, config=config, run_name=run_name, trainer=trainer_info("openrlhf"), rank=rank,
                                 world_size=world_size, enabled=enabled, mode=mode, **writer_kwargs)
        self.step: int | None = None
        self._micro_batch = 0

    def begin_step(self, replay_buffer: Any, step: int | None = None) -> int:
        """Record the completions in this rank's replay buffer (``replay_buffer.items``, or a list of
        single-row experiences). The step is the ids' (``tag_experiences``), unless given."""
        items = list(getattr(replay_buffer, "items", replay_buffer))
        self._micro_batch = 0
        if not items:
            self.step = step
            return step
        ids = torch.cat([_ids(e.info, SAMPLE_ID_KEY, 1, "begin_step") for e in items])
        self.step = int(ids[0]) // SAMPLE_ID_STRIDE if step is None else int(step)
        if not self.enabled:
            return self.step
        groups = torch.cat([_ids(e.info, GROUP_ID_KEY, 1, "begin_step") for e in items])
        resp = torch.cat([torch.as_tensor(e.response_length).reshape(-1) for e in items]).to(torch.int64)
        total = torch.cat([torch.as_tensor(e.total_length).reshape(-1) for e in items]).to(torch.int64)
        truncated = torch.cat([torch.as_tensor(e.truncated).reshape(-1) for e in items]).bool()
        reward = None
        if all("reward" in e.info for e in items):
            reward = torch.cat([torch.as_tensor(e.info["reward"]).reshape(-1) for e in items]).double()
        adv = []
        for e in items:
            m = e.action_mask.reshape(-1).bool()
            a = e.advantages.reshape(-1)[m] if e.advantages is not None else None
            adv.append(float(a[0]) if a is not None and len(a) else float("nan"))
        self.hook.log_samples(step=self.step, sample_ids=ids, group_ids=groups, completion_lens=resp,
                              truncated=truncated, reward=reward, advantages=torch.tensor(adv),
                              prompt_lens=total - resp)
        return self.step

    def log_micro_batch(self, experience: Any, action_log_probs, entropy=None, step: int | None = None) -> None:
        """Record one ``training_step``: the forward's ``action_log_probs`` (and the entropy over the
        sequence: its last ``action_mask.shape[1]`` columns are the actions'), with the
        experience's old, reference and rollout log-probs, advantages and action mask. Takes the
        capture's keys out of ``experience.info`` (always, also when disabled)."""
        info = experience.info
        m = experience.action_mask.bool()
        n, width = m.shape
        ids = _ids(info, SAMPLE_ID_KEY, n, "log_micro_batch")
        refs = info.get(REF_KEY)
        for k in _KEYS:
            info.pop(k, None)
        if not self.enabled:
            return
        step = self.step if step is None else step
        if step is None:
            raise RuntimeError("OpenRLHFCapture.log_micro_batch before begin_step: call begin_step(replay_buffer) "
                               "first in ppo_train")
        first, span = _span(m)
        valid = torch.arange(width, device=m.device)[None, :] < span[:, None]  # after the left shift
        ref = experience.base_action_log_probs
        if ref is None and refs is not None:  # without the KL loss: the reference kept on the driver
            ref = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
            for i, r in enumerate(refs):
                ref[i, m[i]] = torch.as_tensor(r, dtype=torch.float32, device=m.device)
        ent = None
        if entropy is not None:
            ent = entropy[:, -width:]
        # the span's tokens only, each row left-aligned: position 0 is its first action token
        shift = lambda x: None if x is None else _left_align(x, first, width)  # noqa: E731
        self.hook.log_loss_call(
            step=step, micro_batch=self._micro_batch, sample_ids=ids, logp=shift(action_log_probs.float()),
            advantages=shift(experience.advantages.float()), mask=shift(m), valid=valid,
            old_logp=shift(experience.action_log_probs), ref_logp=shift(ref),
            rollout_logp=shift(getattr(experience, "rollout_log_probs", None)), entropy=shift(ent))
        self._micro_batch += 1

    def end_step(self, step: int | None = None) -> None:
        step = self.step if step is None else step
        if step is not None:
            self.hook.end_step(step)

    def close(self) -> None:
        self.hook.close()


def _left_align(x: torch.Tensor, first: torch.Tensor, width: int) -> torch.Tensor:
    """Row i shifted left by ``first[i]`` (the columns that fall off the end are padding)."""
    idx = (torch.arange(width, device=x.device)[None, :] + first[:, None].to(x.device)).clamp(max=width - 1)
    return x.gather(1, idx)

