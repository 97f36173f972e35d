"""verl integration: record a verl actor's ``update_policy`` inputs into a grpolens run.

verl is not imported here (it needs Ray and GPUs); everything is read by key from the batch verl
hands its actor: a ``DataProto`` (``.batch`` TensorDict, ``.non_tensor_batch`` numpy arrays,
``.meta_info``), a TensorDict, or a plain dict of tensors. Five lines in the actor
(``docs/integrations/verl.md``)::

    from grpolens.integrations.verl import VerlCapture
    self.grpolens = VerlCapture("runs/my-run", config=verl_config(actor_config))   # __init__

    # update_policy(self, data):
    self.grpolens.begin_step(data)                      # before data.select(...): samples + ids
    select_keys.append(VerlCapture.SAMPLE_ID_KEY)       # let the ids travel with the rows
    ...  entropy, log_prob = self._forward_micro_batch(micro_batch, ...)
    self.grpolens.log_micro_batch(micro_batch, log_prob=log_prob, entropy=entropy)
    self.grpolens.end_step()                            # after the last mini-batch

Keys read (verl's names): ``responses``, ``response_mask`` (the loss mask, after rollout
rejection), ``attention_mask`` (its last ``T`` columns mark the real response tokens, its first
columns the prompt), ``old_log_probs``, ``ref_log_prob``, ``rollout_log_probs``, ``advantages``
(per token); non-tensor ``uid`` (the prompt group), the reward scores (``token_level_scores``,
else ``token_level_rewards``, summed over the response) and numeric reward-info arrays;
``meta_info["global_steps"]`` for the step. Two optional keys that verl's driver does not keep,
set there with one line each (``docs/integrations/verl.md``): ``PRE_REJECTION_MASK_KEY`` (the
response mask before rollout rejection: stored as ``rollout_rejected``) and ``OLD_ENTROPY_KEY``
(the old-log-prob pass' entropies: ``old_entropy``).

verl 0.9.1's default trainer (``trainer.use_v1: true``) hands these per-token keys as nested
tensors (``layout=torch.jagged``, one row per sequence, response tokens only) with ``prompts`` and
``input_ids`` (prompt + response) nested as well and no ``attention_mask``; they are read as the
padded ``(B, T)`` tensors the legacy trainer holds, ``T`` the batch's longest response.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from grpolens.capture.hook import GRPOLensHook
from grpolens.integrations import trainer_info

__all__ = ["VerlCapture", "verl_config", "group_id_of"]

#: ``sample_id = (step * world_size + rank) * SAMPLE_ID_STRIDE + row`` (row: index in the rank's batch).
SAMPLE_ID_STRIDE = 1_000_000
#: Non-tensor keys that are never reward components.
_NOT_REWARDS = {"uid", "index", "data_source", "raw_prompt", "raw_prompt_ids", "multi_modal_data",
                "multi_modal_inputs", "extra_info", "reward_model", "tools_kwargs", "interaction_kwargs",
                "ability", "request_id", "agent_name"}


def group_id_of(uid: Any) -> int:
    """A stable non-negative int64 for verl's ``uid`` (a uuid string): the same on every rank."""
    digest = hashlib.blake2b(str(uid).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _tensors(x: Any) -> Any:
    """The tensor part of a DataProto (``.batch``), or ``x`` itself (TensorDict / dict)."""
    return x.batch if hasattr(x, "batch") and not isinstance(x, Mapping) else x


def _keys(t: Any) -> set[str]:
    return set(t.keys())  # TensorDict refuses `in`; keys() works for it and for dicts


def _get(t: Any, key: str, required: bool = True):
    if key in _keys(t):
        return t[key]
    if required:
        raise KeyError(f"verl batch has no {key!r} (keys: {', '.join(sorted(_keys(t)))})")
    return None


#: Per-token keys, one value per response token, that may come nested (jagged) instead of padded.
_TOKEN_KEYS = ("responses", "response_mask", "old_log_probs", "ref_log_prob", "rollout_log_probs", "advantages",
               "token_level_scores", "token_level_rewards", "grpolens_response_mask_before_rejection",
               "grpolens_old_entropys")


def _row_lengths(x, key: str) -> torch.Tensor:
    if x.layout != torch.jagged:
        raise ValueError(f"VerlCapture: {key!r} is a nested tensor of layout {x.layout}; only "
                         f"layout=torch.jagged (verl's) is read")
    return x.offsets().diff()


def _padded_like(x, key: str, lengths: torch.Tensor, width: int, nested_only: bool) -> torch.Tensor:
    """``x`` (nested with the rows of ``responses``, or padded ``(B, >= width)`` unless ``nested_only``)
    as a padded ``(B, width)`` tensor: positions past a row's length hold 0."""
    if not getattr(x, "is_nested", False):
        if nested_only:
            raise ValueError(f"VerlCapture: 'responses' is a nested tensor but {key!r} is padded: hand every "
                             f"per-token key in one layout")
        if x.dim() != 2 or x.shape[0] != len(lengths) or x.shape[1] < width:
            raise ValueError(f"VerlCapture: {key!r} has shape {tuple(x.shape)}, expected (rows, at least the "
                             f"longest response) = {(len(lengths), width)} for nested 'responses'")
        return x[:, :width]  # no_padding_2_padding may pad to verl's max_response_len: only padding is cut
    own = _row_lengths(x, key)
    if x.dim() != 2 or not torch.equal(own.cpu(), lengths.cpu()):
        raise ValueError(f"VerlCapture: nested {key!r} has row lengths {own.tolist()}, expected those of "
                         f"'responses' {lengths.tolist()} (response tokens only)")
    out = x.to_padded_tensor(0)
    return torch.nn.functional.pad(out, (0, width - out.shape[1])) if out.shape[1] < width else out


def _unnested(t: Any) -> tuple[Any, bool]:
    """The batch with nested (jagged) per-token keys padded, and whether they were nested.

    With nested ``responses`` the prompt side comes from nested ``prompts`` (else ``input_ids``,
    prompt + response) and ``attention_mask`` / ``input_ids`` are rebuilt padded: prompt tokens
    first, then the response columns, as ``begin_step`` reads them from the legacy trainer."""
    keys = _keys(t)
    responses = _get(t, "responses")
    if not getattr(responses, "is_nested", False):
        for k in _TOKEN_KEYS:
            if k in keys and getattr(t[k], "is_nested", False):
                raise ValueError(f"VerlCapture: {k!r} is a nested tensor but 'responses' is padded: hand every "
                                 f"per-token key in one layout")
        return t, False
    lengths = _row_lengths(responses, "responses")
    width = int(lengths.max()) if len(lengths) else 0
    out = {k: t[k] for k in keys}
    for k in _TOKEN_KEYS:
        if k in keys:
            out[k] = _padded_like(t[k], k, lengths, width, nested_only=True)
    if "prompts" in keys and getattr(t["prompts"], "is_nested", False):
        prompt_lens = _row_lengths(t["prompts"], "prompts")
        prompt_ids = t["prompts"].to_padded_tensor(0)
    elif "input_ids" in keys and getattr(t["input_ids"], "is_nested", False):
        prompt_lens = _row_lengths(t["input_ids"], "input_ids") - lengths.to(responses.offsets().device)
        rows = t["input_ids"].unbind()
        prompt_ids = torch.nn.utils.rnn.pad_sequence([r[: int(n)] for r, n in zip(rows, prompt_lens)], batch_first=True)
    else:
        raise KeyError("VerlCapture: nested 'responses' need nested 'prompts' or 'input_ids' for the prompt lengths")
    prompt_w = prompt_ids.shape[1] if prompt_ids.dim() == 2 else 0
    attn = torch.cat([torch.arange(prompt_w) < prompt_lens.cpu().unsqueeze(1),
                      torch.arange(width) < lengths.cpu().unsqueeze(1)], 1).to(torch.int64)
    out["attention_mask"] = attn.to(out["responses"].device)
    out["input_ids"] = torch.cat([prompt_ids.reshape(len(lengths), prompt_w).to(out["responses"].dtype),
                                  out["responses"]], 1)
    out["_lengths"] = lengths
    return out, True


def verl_config(actor: Mapping | None = None, algorithm: Mapping | None = None,
                rollout: Mapping | None = None, trainer: Mapping | None = None) -> dict[str, Any]:
    """grpolens config keys from verl's ``actor_rollout_ref.actor`` (and ``algorithm``) config.

    ``trainer`` and ``rollout`` (optional): verl's ``trainer`` and ``actor_rollout_ref.rollout``.
    Under ``loss_agg_mode: seq-mean-token-sum-norm`` without ``loss_scale_factor`` verl divides by
    the padded response width: verl's default trainer (``trainer.use_v1: true``) pads nested
    responses to the longest one of the batch (the step for ``actor/entropy``, the loss call for the
    losses), which the run's lengths give; the legacy one (``use_v1: false``) keeps the rollout's
    padding to ``rollout.response_length``, kept here as ``verl_rollout.response_length``.

    ``clip_ratio_low/high`` -> ``epsilon/epsilon_high``; ``kl_loss_coef`` (if ``use_kl_loss``) ->
    ``beta``; ``policy_loss.loss_mode`` gspo -> sequence-level ratios, cispo/sapo kept, anything
    else -> ``grpo`` (PPO clip); verl's rollout correction (``rollout_is``, ``rollout_is_threshold``,
    ``rollout_rs``, ``rollout_rs_threshold``) -> ``rollout_is`` in verl's spelling (the threshold only
    with ``rollout_is`` set: verl computes no IS weights without it), and ``rollout_metrics``: whether
    ``algorithm.rollout_correction`` is set at all (verl logs no ``rollout_corr/*`` otherwise). Every
    input key is also kept under ``verl_actor`` / ``verl_algorithm``.
    """
    actor = dict(actor or {})
    algorithm = dict(algorithm or {})
    policy = dict(actor.get("policy_loss") or {})
    mode = str(policy.get("loss_mode", "vanilla"))
    # verl's ActorConfig defaults clip_ratio_low/high to 0.2 themselves: clip_ratio only stands in for None
    eps, eps_high = (actor.get(k, 0.2) for k in ("clip_ratio_low", "clip_ratio_high"))
    eps = actor.get("clip_ratio", 0.2) if eps is None else eps
    eps_high = actor.get("clip_ratio", 0.2) if eps_high is None else eps_high
    cfg: dict[str, Any] = {
        "loss_type": mode if mode in ("cispo", "sapo") else "grpo",
        "importance_sampling_level": "sequence" if mode == "gspo" else "token",
        "epsilon": eps,
        "epsilon_high": eps_high,
        "beta": float(actor.get("kl_loss_coef", 0.0)) if actor.get("use_kl_loss") else 0.0,
        "loss_agg_mode": actor.get("loss_agg_mode"),
        "kl_loss_type": actor.get("kl_loss_type"),
    }
    if mode == "sapo":
        cfg["sapo_temperature_pos"] = policy.get("tau_pos", 1.0)
        cfg["sapo_temperature_neg"] = policy.get("tau_neg", 1.05)
    corr = algorithm.get("rollout_correction")
    # verl computes rollout_corr/* on its driver only when algorithm.rollout_correction is set (its
    # YAML default is set, with rollout_is null: then only the off-policy metrics, no IS weights),
    # and not in bypass mode (the loss computes them per micro-batch: not reproduced)
    cfg["rollout_metrics"] = corr is not None and not bool(dict(corr or {}).get("bypass_mode", False))
    corr = dict(corr or {})
    keys = ("rollout_rs", "rollout_rs_threshold")
    if corr.get("rollout_is") is not None:  # rollout_is_threshold (default 2.0) means nothing without it
        keys = ("rollout_is", "rollout_is_threshold") + keys
    if corr.get("rollout_is") is not None and corr.get("rollout_is_batch_normalize"):
        keys += ("rollout_is_batch_normalize",)
    ris = {k: corr[k] for k in keys if corr.get(k) is not None}
    cfg["rollout_is"] = ris or None
    cfg["verl_actor"] = _plain(actor)
    get = lambda m, k: None if m is None else (m.get(k) if hasattr(m, "get") else getattr(m, k, None))  # noqa: E731
    if trainer is not None and get(trainer, "use_v1") is False:
        length = get(rollout, "response_length")
        if length is None:
            raise ValueError("verl_config: trainer.use_v1 is false (the legacy trainer pads responses to "
                             "rollout.response_length): pass rollout= with its response_length")
        cfg["verl_rollout"] = {"response_length": int(length)}
    if algorithm:
        cfg["verl_algorithm"] = _plain(algorithm)
    return {k: v for k, v in cfg.items() if v is not None or k == "rollout_is"}


def _plain(d: Mapping) -> dict[str, Any]:
    """A JSON-able copy: scalars kept, mappings (``policy_loss``) kept recursively, the rest as text."""
    out: dict[str, Any] = {}
    for k, v in dict(d).items():
        if isinstance(v, (int, float, str, bool, type(None))):
            out[str(k)] = v
        elif isinstance(v, Mapping) or hasattr(v, "items"):
            out[str(k)] = _plain(dict(v.items()))
        else:
            out[str(k)] = str(v)
    return out


class VerlCapture:
    """Writes a verl actor's batches through :class:`~grpolens.capture.hook.GRPOLensHook`.

    ``rank`` must be the data-parallel rank (under Ulysses sequence parallelism pass
    ``enabled=(sp_rank == 0)`` so that each sequence is written once). ``eos_token_id`` lets
    ``truncated`` mean "hit the length limit without EOS"; without it a completion is truncated
    when it fills the whole response width. ``tokenizer`` (optional) decodes prompt/completion
    text into the samples table. ``reward_keys`` names the non-tensor arrays stored as
    ``reward/<key>``; by default every numeric 1-D non-tensor array except ids. ``mode``: ``"new"``
    (default: refuse a directory that already holds a run), ``"resume"`` (after a restart from a
    checkpoint: keep the complete steps, continue after them) or ``"overwrite"``.
    """

    SAMPLE_ID_KEY = "grpolens_sample_id"
    #: Optional batch key: verl's ``response_mask`` as it was *before* its rollout rejection
    #: sampling (set on the driver before ``compute_rollout_correction_and_add_to_batch``).
    PRE_REJECTION_MASK_KEY = "grpolens_response_mask_before_rejection"
    #: Optional batch key: the old-log-prob pass' per-token entropy (verl's ``entropys``, which its
    #: driver aggregates into ``actor/entropy`` and then drops from the batch).
    OLD_ENTROPY_KEY = "grpolens_old_entropys"

    def __init__(self, run_dir, *, config: dict | None = None, rank: int | None = None,
                 world_size: int | None = None, eos_token_id: int | Iterable[int] | None = None,
                 tokenizer: Any = None, reward_keys: Iterable[str] | None = None, enabled: bool = True,
                 run_name: str | None = None, mode: str = "new", **writer_kwargs):
        self.enabled = enabled
        self.hook = GRPOLensHook(run_dir, config=config, run_name=run_name, trainer=trainer_info("verl"),
                                 rank=rank, world_size=world_size, enabled=enabled, mode=mode, **writer_kwargs)
        self.rank, self.world_size = self.hook.rank, self.hook.world_size
        self.eos = None if eos_token_id is None else (
            {int(eos_token_id)} if isinstance(eos_token_id, (int, np.integer)) else {int(e) for e in eos_token_id})
        self.tokenizer = tokenizer
        self.reward_keys = None if reward_keys is None else list(reward_keys)
        self.step: int | None = None
        self._last_step = 0
        self._micro_batch = 0
        #: this step's optional per-row tensors (by row of the rank's batch), looked up per micro-batch
        #: through the sample ids, so that only SAMPLE_ID_KEY has to travel through verl's select
        self._rows: dict[str, Any] = {}
        self._nested = False  # this step's batch came as nested (jagged) tensors

    # ------------------------------------------------------------------ once per training step
    def begin_step(self, data: Any, step: int | None = None) -> int:
        """Record the step's completions (this rank's rows) and attach their ids to ``data`` so that
        they follow the rows through verl's mini-batch split, shuffle and micro-batching. Returns the
        step: ``step``, else ``data.meta_info["global_steps"]``, else the previous step + 1."""
        if step is None:
            meta = getattr(data, "meta_info", None) or {}
            step = meta.get("global_steps")
        step = int(step) if step is not None else self._last_step + 1
        self.step, self._last_step, self._micro_batch = step, step, 0
        given = _tensors(data)
        responses = _get(given, "responses")
        n = responses.size(0)
        if n > SAMPLE_ID_STRIDE:
            raise ValueError(f"VerlCapture: {n} rows on one rank exceed {SAMPLE_ID_STRIDE}")
        sample_ids = (step * self.world_size + self.rank) * SAMPLE_ID_STRIDE + torch.arange(n, dtype=torch.int64)
        given[self.SAMPLE_ID_KEY] = sample_ids.to(responses.offsets().device if responses.is_nested else responses.device)
        if not self.enabled:
            return step
        t, self._nested = _unnested(given)
        responses = t["responses"]
        width = responses.shape[1]
        self._rows = {}
        for name, key in (("pre_mask", self.PRE_REJECTION_MASK_KEY), ("old_entropy", self.OLD_ENTROPY_KEY)):
            x = _get(t, key, False)
            if x is not None:
                if tuple(x.shape) != (n, width):
                    raise ValueError(f"VerlCapture: {key!r} has shape {tuple(x.shape)}, expected that of "
                                     f"'responses' {(n, width)}")
                self._rows[name] = x

        attn = _get(t, "attention_mask")
        valid = attn[:, -width:].bool()
        lengths = valid.sum(-1)
        prompt_lens = attn[:, :-width].sum(-1)
        last = responses.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        full = lengths == width
        truncated = full if self.eos is None else full & ~torch.isin(last, torch.tensor(sorted(self.eos), device=last.device))
        non_tensor = dict(getattr(data, "non_tensor_batch", None) or {})
        uid = non_tensor.get("uid")
        group_ids = (torch.tensor([group_id_of(u) for u in uid], dtype=torch.int64) if uid is not None else sample_ids)
        scores = _get(t, "token_level_scores", False)
        if scores is None:
            scores = _get(t, "token_level_rewards", False)
        reward = (scores * valid).sum(-1).double() if scores is not None else None
        adv = _get(t, "advantages", False)
        first = None
        if adv is not None:  # GRPO broadcasts one value over the response: take the first real token's
            first = adv.gather(1, torch.zeros(n, 1, dtype=torch.int64, device=adv.device)).squeeze(1)
        texts = {}
        if self.tokenizer is not None:
            ids = _get(t, "input_ids")
            texts = {
                "prompts": [self.tokenizer.decode(ids[i, :-width][attn[i, :-width].bool()].tolist(), skip_special_tokens=True)
                            for i in range(n)],
                "completions": [self.tokenizer.decode(responses[i, : int(lengths[i])].tolist(), skip_special_tokens=True)
                                for i in range(n)],
            }
        self.hook.log_samples(step=step, sample_ids=sample_ids, group_ids=group_ids, completion_lens=lengths,
                              truncated=truncated, rewards=self._rewards(non_tensor, n), reward=reward,
                              advantages=first, prompt_lens=prompt_lens, **texts)
        return step

    def _rewards(self, non_tensor: dict, n: int) -> dict[str, np.ndarray] | None:
        keys = self.reward_keys
        if keys is None:
            keys = [k for k, v in non_tensor.items() if k not in _NOT_REWARDS and _numeric(v, n)]
        out = {}
        for k in keys:
            if k not in non_tensor:
                raise KeyError(f"VerlCapture: reward key {k!r} is not in the non-tensor batch "
                               f"(keys: {', '.join(sorted(non_tensor))})")
            out[k.replace("/", "_")] = np.array([np.nan if v is None else float(v) for v in non_tensor[k]])
        return out or None

    # ------------------------------------------------------------------ once per loss call
    def log_micro_batch(self, micro_batch: Any, *, log_prob, entropy=None, entropys=None, step: int | None = None,
                        micro_batch_index: int | None = None) -> None:
        """Record one loss call: ``log_prob`` (and ``entropy``) from the actor's forward on
        ``micro_batch``, plus the batch's own old/ref/rollout log-probs, advantages and masks."""
        if not self.enabled:
            return
        step = self.step if step is None else step
        if step is None:
            raise RuntimeError("VerlCapture.log_micro_batch before begin_step: call begin_step(data) first")
        t = _tensors(micro_batch)
        if self.SAMPLE_ID_KEY not in _keys(t):
            raise KeyError(f"micro-batch has no {self.SAMPLE_ID_KEY!r}: call begin_step(data) before verl's "
                           f"data.select(...) and add VerlCapture.SAMPLE_ID_KEY to its select_keys")
        t, nested = _unnested(t)
        responses = t["responses"]
        width = responses.shape[1]
        if nested:  # the forward's outputs: nested like 'responses', or padded to its longest row
            log_prob = _padded_like(log_prob, "log_prob", t["_lengths"], width, nested_only=False)
            entropy = entropy if entropy is not None else entropys
            if entropy is not None:
                entropy = _padded_like(entropy, "entropy", t["_lengths"], width, nested_only=False)
        else:
            for key, x in (("log_prob", log_prob), ("entropy", entropy), ("entropys", entropys)):
                if getattr(x, "is_nested", False):
                    raise ValueError(f"VerlCapture: {key!r} is a nested tensor but 'responses' is padded: hand "
                                     f"every per-token key in one layout")
        mb = self._micro_batch if micro_batch_index is None else micro_batch_index
        self._micro_batch = mb + 1
        sample_ids = t[self.SAMPLE_ID_KEY]
        mask = _get(t, "response_mask").bool()
        per_row = {name: self._of_rows(x, sample_ids, width) for name, x in self._rows.items()}
        rejected = per_row["pre_mask"].bool() & ~mask if "pre_mask" in per_row else None
        self.hook.log_loss_call(
            step=step, micro_batch=mb, sample_ids=sample_ids, logp=log_prob,
            entropy=entropy if entropy is not None else entropys, advantages=_get(t, "advantages"),
            mask=mask, valid=_get(t, "attention_mask")[:, -width:].bool(),
            old_logp=_get(t, "old_log_probs", False), ref_logp=_get(t, "ref_log_prob", False),
            rollout_logp=_get(t, "rollout_log_probs", False), token_ids=responses,
            old_entropy=per_row.get("old_entropy"), rollout_rejected=rejected)

    def _of_rows(self, x, sample_ids, width: int):
        """The rows of a step-level tensor that a micro-batch holds (its row = sample_id mod stride)."""
        rows = (sample_ids % SAMPLE_ID_STRIDE).to(x.device)
        if self._nested and x.shape[1] >= width:  # padded to the step's longest response: its rows fit `width`
            return x[rows][:, :width]
        if x.shape[1] != width:
            raise ValueError(f"VerlCapture: micro-batch responses are {width} wide but the batch at begin_step "
                             f"was {x.shape[1]} wide")
        return x[rows]

    def end_step(self, step: int | None = None) -> None:
        """The step's loss calls are done on this rank: its shards are written in the background."""
        step = self.step if step is None else step
        if step is not None:
            self.hook.end_step(step)

    def close(self) -> None:
        self.hook.close()


def _numeric(v: Any, n: int) -> bool:
    arr = np.asarray(v)
    if arr.ndim != 1 or len(arr) != n:
        return False
    if arr.dtype.kind in "biuf":
        return True
    return arr.dtype == object and all(x is None or isinstance(x, (bool, int, float, np.number)) for x in arr)

