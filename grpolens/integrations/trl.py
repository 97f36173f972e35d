"""TRL integration: record what TRL's ``GRPOTrainer`` feeds its loss into a grpolens run.

One line in a training script::

    from grpolens.integrations.trl import GRPOLensTrainer      # instead of trl.GRPOTrainer
    trainer = GRPOLensTrainer(model=..., reward_funcs=..., args=..., train_dataset=...,
                              grpolens_dir="runs/my-run")      # default: <output_dir>/grpolens_run

or ``with_grpolens(MyGRPOTrainerSubclass)`` for a trainer class of your own.

What is recorded, and where it is taken from (``docs/integrations/trl.md`` has the long version):

* **every loss call** (``_compute_loss``, once per micro-batch and rank): the current log-probs
  and entropies exactly as TRL's loss computed them (captured from the
  ``_get_per_token_logps_and_entropies(..., compute_entropy=True)`` call inside the loss), the
  old, reference and rollout-engine log-probs and the advantages from the micro-batch, the loss
  mask ``completion_mask · tool_mask`` (after ``mask_truncated_completions``) and the token ids;
* **every generation round** (``_generate_and_score_completions``): per completion its group,
  prompt and completion lengths, ``truncated`` (last token not EOS/pad), each reward function's
  raw value, the weighted total reward, the advantage, the round's index ``generation`` (several
  rounds share a step when ``steps_per_generation < gradient_accumulation_steps``; TRL logs the
  mean of their values) and, optionally, the prompt/completion text;
* the trainer config (``CONFIG_DEFAULTS`` keys of :mod:`grpolens.run.format`, plus every
  ``GRPOConfig`` field under ``trl_args``) in the manifest, ``trainer = {"name": "trl", ...}``;
* the tokenizer as ``RUN/tokenizer.json`` (fast tokenizers; rank 0), for token text in every view;
* TRL's own logged metrics, one JSON object per ``log()`` call, in ``RUN/grpolens/trl_log.jsonl``
  (rank 0), so that ``grpolens recompute --profile trl`` can be compared with them.

An existing run in ``grpolens_dir`` (a relaunch after a crash) is refused unless
``grpolens_mode`` says ``"resume"`` (keep its complete steps and the log records up to the last
of them; what TRL logs again for those steps, after restarting from an earlier checkpoint, is
dropped) or ``"overwrite"`` (delete the run and its log first).

Identity of samples. TRL shuffles each generation batch and reuses its slices for
``num_iterations`` passes, so row order means nothing at a loss call. The integration adds a
``grpolens_sample_id`` tensor (and the completion lengths) to the generation batch dict that TRL
shuffles and splits; the ids travel with their rows. ``sample_id = step · 1_000_000 + i`` where
``i`` counts the completions generated during ``step`` on all ranks (rank-major, as TRL gathers
them), and ``group_id = step · 1_000_000 + i // num_generations``.

Steps. ``step`` is TRL's ``state.global_step + 1`` at the loss call or generation: 1-based, the
optimizer step the call contributes to, which is the ``step`` TRL logs for it. ``micro_batch``
counts the loss calls of that step on the rank from 0 (TRL's micro-batch slot).

Training is untouched: the overrides call TRL's methods and only read (detached) results; the
extra dict entries are ignored by TRL's loss and consume no random numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import trl
from transformers import TrainerCallback
from trl import GRPOTrainer

from grpolens.run import format as fmt
from grpolens.run.format import atomic_write_bytes
from grpolens.capture.hook import GRPOLensHook
from grpolens.profiles.trl import STATE_NAME

__all__ = ["GRPOLensTrainer", "GRPOLensMixin", "with_grpolens", "run_config", "SAMPLE_ID_STRIDE",
           "TRL_LOG_NAME"]

#: ``sample_id = step * SAMPLE_ID_STRIDE + index of the completion within its step``.
SAMPLE_ID_STRIDE = 1_000_000
#: TRL's logged metrics, written by rank 0 under the run's derived directory.
TRL_LOG_NAME = "trl_log.jsonl"
_SAMPLE_ID_KEY = "grpolens_sample_id"
_LENGTH_KEY = "grpolens_length"


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    """A JSON-friendly copy: numbers, strings, lists and dicts kept; anything else as its str()."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):  # enums
        return value.value
    return str(value)


def run_config(trainer: GRPOTrainer) -> dict[str, Any]:
    """The manifest config of a TRL run: the keys grpolens' metrics read, in grpolens' terms, then
    TRL-only settings that change metrics, then every ``GRPOConfig`` field under ``trl_args``.

    Read from the trainer (not only ``args``) where TRL resolves a value there: ``epsilon_high``
    defaulting to ``epsilon``, the reward weights and names, ``use_vllm`` (the rollout-engine
    importance-sampling correction exists only when it is on).
    """
    a = trainer.args
    names = list(trainer.reward_func_names)
    weights = [float(w) for w in trainer.reward_weights.tolist()]
    rollout_is = None
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        # TRL's own spelling: grpolens' config reader maps it (TRL's "*_mask" zeroes weights, it does not
        # reject tokens, so it is not grpolens' "mask" mode)
        rollout_is = {"vllm_importance_sampling_correction": True,
                      "vllm_importance_sampling_mode": trainer.vllm_importance_sampling_mode,
                      "vllm_importance_sampling_clip_min": trainer.vllm_importance_sampling_clip_min,
                      "vllm_importance_sampling_clip_max": trainer.vllm_importance_sampling_clip_max}
    cfg: dict[str, Any] = {
        "loss_type": a.loss_type,
        "epsilon": float(getattr(trainer, "epsilon_low", a.epsilon)),
        "epsilon_high": float(getattr(trainer, "epsilon_high", None) or a.epsilon),
        "delta": getattr(a, "delta", None),
        "beta": float(a.beta),
        "importance_sampling_level": getattr(a, "importance_sampling_level", "token"),
        "temperature": float(a.temperature),
        "max_completion_length": a.max_completion_length,
        "num_generations": a.num_generations,
        "gradient_accumulation_steps": a.gradient_accumulation_steps,
        # TRL's meaning: micro-batches (loss calls per rank) that one generation batch is split into.
        "steps_per_generation": a.steps_per_generation,
        "num_iterations": a.num_iterations,
        "scale_rewards": {True: "group", False: "none"}.get(trainer.scale_rewards, trainer.scale_rewards),
        "use_bias_correction_kl": bool(getattr(a, "use_bias_correction_kl", False)),
        # by name: the samples table's reward/<name> columns are not in reward_funcs order
        "reward_weights": dict(zip(names, weights)),
        "sapo_temperature_pos": float(getattr(a, "sapo_temperature_pos", 1.0)),
        "sapo_temperature_neg": float(getattr(a, "sapo_temperature_neg", 1.05)),
        **{k: float(getattr(a, k, d)) for k, d in (("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0),
                                                     ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0))},
        "rollout_is": rollout_is,
        # TRL settings outside CONFIG_DEFAULTS that change what TRL logs
        "reward_funcs": names,
        "mask_truncated_completions": bool(getattr(a, "mask_truncated_completions", False)),
        "top_entropy_quantile": float(getattr(a, "top_entropy_quantile", 1.0)),
        "off_policy_mask_threshold": getattr(a, "off_policy_mask_threshold", None),
        "multi_objective_aggregation": getattr(a, "multi_objective_aggregation", "sum_then_normalize"),
        "per_device_train_batch_size": a.per_device_train_batch_size,
        "num_processes": trainer.accelerator.num_processes,
        "use_vllm": bool(getattr(trainer, "use_vllm", False)),
        "trl_args": _jsonable(a.to_dict()),
    }
    return cfg


# ---------------------------------------------------------------------------------------------
# Text of prompts and completions (conversational or plain)
# ---------------------------------------------------------------------------------------------

def _as_text(x: Any) -> str | None:
    if x is None:
        return None
    if isinstance(x, str):
        return x
    if isinstance(x, list):  # conversational: [{"role": ..., "content": ...}, ...]
        parts = []
        for m in x:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # content blocks
                    content = " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
                parts.append(f"{m.get('role', '')}: {content}" if len(x) > 1 else str(content))
            else:
                parts.append(str(m))
        return "\n".join(parts)
    return str(x)


# ---------------------------------------------------------------------------------------------
# The mixin
# ---------------------------------------------------------------------------------------------

def _trim_log(path: Path, last_step: int) -> None:
    """Keep the log records of steps up to ``last_step`` (a resumed run's complete steps), atomically."""
    if not path.exists():
        return
    from grpolens.run.format import atomic_write_bytes

    kept = [ln for ln in path.read_text().splitlines(keepends=True)
            if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
    atomic_write_bytes(path, "".join(kept).encode())


class _GRPOLensCallback(TrainerCallback):
    """Ends each step's shards after the optimizer step, records TRL's logs, closes at the end."""

    def __init__(self, owner: "GRPOLensMixin"):
        self.owner = owner

    def on_train_begin(self, args, state, control, **kwargs):
        self._schedule = {"max_steps": int(state.max_steps), "epoch_ends": []}
        # written once the run's writer exists (it refuses a folder that already holds files)

    def on_epoch_end(self, args, state, control, **kwargs):
        if getattr(self, "_schedule", None) is not None:
            self._schedule["epoch_ends"].append(int(state.global_step))
            self._write_schedule(state)

    def _write_schedule(self, state) -> None:
        """The Trainer's step count and epoch ends, which TRL's logging schedule depends on."""
        if (self.owner._grpolens_enabled and state.is_world_process_zero and self.owner._grpolens_hook is not None
                and getattr(self, "_schedule", None) is not None):
            path = fmt.as_run(self.owner.grpolens_dir) / "grpolens" / STATE_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps(self._schedule).encode())

    def on_step_end(self, args, state, control, **kwargs):
        hook = self.owner._grpolens_hook
        if hook is not None and state.global_step == 1:
            self._write_schedule(state)
        if hook is not None:
            hook.end_step(state.global_step)  # the step just finished: global_step was step - 1 during it

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.owner._grpolens_enabled or not state.is_world_process_zero or not logs:
            return
        if state.global_step in self.owner._grpolens_kept:
            return  # a resumed run already has this step, and its record
        clean = {k: (v if not (isinstance(v, float) and not math.isfinite(v)) else None) for k, v in logs.items()}
        path = fmt.as_run(self.owner.grpolens_dir) / "grpolens" / TRL_LOG_NAME
        line = json.dumps({"step": state.global_step, **_jsonable(clean)}) + "\n"
        if fmt.is_remote_run(path):  # an object cannot be appended to: the log is written again, whole
            atomic_write_bytes(path, (path.read_bytes() if path.exists() else b"") + line.encode())
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line)

    def on_train_end(self, args, state, control, **kwargs):
        self.owner.grpolens_close()


class GRPOLensMixin:
    """Mix into a ``GRPOTrainer`` (sub)class to record a grpolens run; see the module docstring.

    Extra keyword arguments (all optional):

    ``grpolens_dir``        run directory (default ``<args.output_dir>/grpolens_run``)
    ``grpolens_text``       store prompt and completion text in the samples table (default True)
    ``grpolens_enabled``    False: behave exactly like the base trainer, write nothing
    ``grpolens_run_name``   the manifest's run name (default: the directory name)
    ``grpolens_writer``     dict of :class:`~grpolens.capture.writer.ShardWriter` options
    ``grpolens_mode``       ``"new"`` (default: refuse a directory that holds a run), ``"resume"``
                            or ``"overwrite"`` (see the module docstring)
    """

    def __init__(self, *args, grpolens_dir=None, grpolens_text: bool = True, grpolens_enabled: bool = True,
                 grpolens_run_name: str | None = None, grpolens_writer: dict | None = None,
                 grpolens_mode: str = "new", **kwargs):
        super().__init__(*args, **kwargs)
        self._grpolens_mode = grpolens_mode
        self._grpolens_kept: frozenset[int] = frozenset()  # steps a resumed run already had complete
        # a local directory, or s3://bucket/prefix: the run is written straight to object storage
        self.grpolens_dir = (grpolens_dir if fmt.is_remote_run(grpolens_dir) else Path(grpolens_dir)) \
            if grpolens_dir is not None else Path(self.args.output_dir) / "grpolens_run"
        self._grpolens_enabled = grpolens_enabled
        self._grpolens_text = grpolens_text
        self._grpolens_run_name = grpolens_run_name
        self._grpolens_writer = dict(grpolens_writer or {})
        self._grpolens_hook: GRPOLensHook | None = None
        self._grpolens_generated: dict[int, int] = {}  # step -> completions generated in it (all ranks)
        self._grpolens_rounds = 0  # training generation rounds recorded so far (the same on every rank)
        self._grpolens_micro: tuple[int, int] = (-1, 0)  # (step, next micro_batch)
        self._grpolens_capture: dict | None = None
        self._grpolens_gen: tuple | None = None
        self._grpolens_rewards: torch.Tensor | None = None
        self.add_callback(_GRPOLensCallback(self))

    # -- lifecycle -------------------------------------------------------------------------------
    def _grpolens_active(self) -> bool:
        return self._grpolens_enabled and self.model.training

    def grpolens_hook(self) -> GRPOLensHook:
        """The writer, created at the first recorded call so that the manifest sees the final
        trainer settings (e.g. ``use_vllm`` set after construction)."""
        if self._grpolens_hook is None:
            hook = GRPOLensHook(
                self.grpolens_dir, config=run_config(self), run_name=self._grpolens_run_name,
                trainer={"name": "trl", "version": trl.__version__},
                rank=self.accelerator.process_index, world_size=self.accelerator.num_processes,
                mode=self._grpolens_mode, **self._grpolens_writer)
            self._grpolens_mode = "resume"  # a later train() of this trainer continues this run
            self._grpolens_kept = hook.writer.kept_steps
            if self._grpolens_kept and self.accelerator.is_main_process:
                _trim_log(fmt.as_run(self.grpolens_dir) / "grpolens" / TRL_LOG_NAME, max(self._grpolens_kept))
            self._grpolens_hook = hook
            if self.accelerator.is_main_process:
                self._grpolens_save_tokenizer()
        return self._grpolens_hook

    def _grpolens_save_tokenizer(self) -> None:
        """``RUN/tokenizer.json``: the fast tokenizer's own serialisation, so that every view can
        show token text with the light ``tokenizers`` library (no transformers, no download). A
        slow (Python) tokenizer has none: the views then show ids and say why."""
        from grpolens.run import format as fmt
        from grpolens.run.decode import TOKENIZER_FILE

        tok = getattr(self, "_tokenizer", None) or getattr(self.processing_class, "tokenizer", self.processing_class)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            fmt.atomic_write_bytes(fmt.as_run(self.grpolens_dir) / TOKENIZER_FILE, backend.to_str().encode())

    def grpolens_close(self) -> None:
        """Write everything still buffered and stop the writer (called at the end of ``train()``)."""
        if self._grpolens_hook is not None:
            hook, self._grpolens_hook = self._grpolens_hook, None  # a later train() opens a new writer
            hook.close()

    def _grpolens_step(self) -> int:
        return int(self.state.global_step) + 1

    def _grpolens_stop_ids(self) -> set[int]:
        """EOS ids and pad id, as TRL's truncation test uses them (``eos_token_ids`` since 1.10, the
        tokenizer's EOS before)."""
        tok = getattr(self, "_tokenizer", None) or getattr(self.processing_class, "tokenizer", self.processing_class)
        eos = getattr(self, "eos_token_ids", None)
        if eos is None:
            eos = [tok.eos_token_id]
        return {int(e) for e in eos if e is not None} | ({int(tok.pad_token_id)} if tok.pad_token_id is not None else set())

    # -- generation side -------------------------------------------------------------------------
    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self._grpolens_active():
            self._grpolens_gen = (prompts, out)
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._grpolens_active():
            self._grpolens_rewards = rewards.detach()
        return rewards

    def _generate_and_score_completions(self, inputs):
        self._grpolens_gen, self._grpolens_rewards = None, None
        output = super()._generate_and_score_completions(inputs)
        if self._grpolens_active() and self._grpolens_gen is not None:
            self._grpolens_record_generation(output)
        self._grpolens_gen, self._grpolens_rewards = None, None
        return output

    def _grpolens_record_generation(self, output: dict) -> None:
        prompts, (prompt_ids, completion_ids, tool_mask, completions, *_rest) = self._grpolens_gen
        device = output["completion_ids"].device
        step = self._grpolens_step()
        n_local, n_proc, rank = len(completion_ids), self.accelerator.num_processes, self.accelerator.process_index
        first = self._grpolens_generated.get(step, 0)
        self._grpolens_generated[step] = first + n_local * n_proc
        if first + n_local * n_proc > SAMPLE_ID_STRIDE:
            raise RuntimeError(f"grpolens: more than {SAMPLE_ID_STRIDE} completions generated in step {step}")
        index = first + rank * n_local + torch.arange(n_local, dtype=torch.int64)
        sample_ids = step * SAMPLE_ID_STRIDE + index
        group_ids = step * SAMPLE_ID_STRIDE + index // self.num_generations

        # TRL's own definitions (GRPOTrainer._generate): model tokens only, truncated = no EOS/pad at the end
        lengths = [len(ids) for ids in completion_ids]
        model_tokens = [int(sum(m)) for m in tool_mask] if tool_mask is not None else lengths
        stop = self._grpolens_stop_ids()
        truncated = [len(ids) > 0 and ids[-1] not in stop for ids in completion_ids]

        rewards = reward = None
        if self._grpolens_rewards is not None:
            local = self._grpolens_rewards[rank * n_local:(rank + 1) * n_local].float().cpu()
            rewards = {name: local[:, j] for j, name in enumerate(self.reward_func_names)}
            total = (local * self.reward_weights.float().cpu().unsqueeze(0)).nansum(dim=1)
            total[torch.isnan(local).all(dim=1)] = float("nan")  # nothing could score it: TRL's NaN
            reward = total.double()
        texts = {}
        if self._grpolens_text:
            texts = {"prompts": [_as_text(p) for p in prompts], "completions": [_as_text(c) for c in completions]}
        self.grpolens_hook().log_samples(
            step=step, sample_ids=sample_ids, group_ids=group_ids, completion_lens=model_tokens,
            truncated=truncated, rewards=rewards, reward=reward, advantages=output["advantages"].detach().float(),
            prompt_lens=[len(ids) for ids in prompt_ids], generations=self._grpolens_rounds, **texts)
        self._grpolens_rounds += 1
        # travel with the rows through TRL's shuffle and split
        output[_SAMPLE_ID_KEY] = sample_ids.to(device)
        output[_LENGTH_KEY] = torch.tensor(lengths, dtype=torch.int64, device=device)

    # -- loss side -------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        cap = self._grpolens_capture
        if cap is not None and kwargs.get("compute_entropy") and "logp" not in cap:
            logps, entropies = out[0], out[1]
            cap["logp"] = logps.detach()
            cap["entropy"] = entropies.detach() if entropies is not None else None
        return out

    def _compute_loss(self, model, inputs):
        if not (self._grpolens_active() and _SAMPLE_ID_KEY in inputs):
            return super()._compute_loss(model, inputs)
        self._grpolens_capture = {}
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            cap, self._grpolens_capture = self._grpolens_capture, None
        self._grpolens_record_loss_call(inputs, cap)
        return loss

    def _grpolens_record_loss_call(self, inputs: dict, cap: dict) -> None:
        if "logp" not in cap:
            raise RuntimeError("grpolens: TRL's loss did not call _get_per_token_logps_and_entropies(compute_entropy="
                               "True); this TRL version is not supported by grpolens.integrations.trl")
        step = self._grpolens_step()
        last, nxt = self._grpolens_micro
        micro_batch = nxt if last == step else 0
        self._grpolens_micro = (step, micro_batch + 1)
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        width = completion_ids.size(1)
        valid = torch.arange(width, device=completion_ids.device).unsqueeze(0) < inputs[_LENGTH_KEY].unsqueeze(1)
        self.grpolens_hook().log_loss_call(
            step=step, micro_batch=micro_batch, sample_ids=inputs[_SAMPLE_ID_KEY],
            logp=cap["logp"], entropy=cap.get("entropy"), advantages=inputs["advantages"],
            mask=mask.bool(), valid=valid, old_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps"), rollout_logp=inputs.get("sampling_per_token_logps"),
            token_ids=completion_ids)


def with_grpolens(base: type) -> type:
    """A subclass of ``base`` (``GRPOTrainer`` or a subclass of it) that records a grpolens run."""
    if not (isinstance(base, type) and issubclass(base, GRPOTrainer)):
        raise TypeError(f"with_grpolens expects GRPOTrainer or a subclass of it, got {base!r}")
    return type(f"GRPOLens{base.__name__}", (GRPOLensMixin, base), {"__module__": base.__module__})


GRPOLensTrainer = with_grpolens(GRPOTrainer)
GRPOLensTrainer.__module__ = __name__
