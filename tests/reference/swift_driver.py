"""Runs ms-swift 4.6.0's own GRPO trainer code on recorded runs and prints what it logs (JSON).

Executed by the reference venv's interpreter (``tests/reference/refvenv.py``), never by grpolens'
environment: ``python swift_driver.py CASES.json`` runs each case ``{"in": IN.npz, "config": {...},
"out": OUT.json}`` and prints one JSON list, the dicts each case's ``GRPOTrainer.log`` passed on.

What is ms-swift's code and what stands in for its plumbing:

* Compiled unchanged from the installed sources (``ast``-extracted methods, in a class that derives
  from a stand-in for transformers' ``Trainer.log``): ``GRPOTrainer`` (``swift/rlhf_trainers/
  grpo_trainer.py``): ``_prepare_algorithm_params``, ``_prepare_metrics``, ``_prepare_inputs``,
  ``_score_completions``, ``_compute_rewards_per_func``, ``_prepare_batch_inputs``,
  ``_postprocess_batch``, ``_compute_advantages``, ``compute_loss``, ``_compute_loss``,
  ``_compute_loss_single``, ``_compute_loss_and_metrics``, ``_undo_gradient_accumulation_scaling``,
  ``_update_metrics``, ``_compute_fipo_influence``, the rollout-correction methods, ``_gather_and_flatten`` and ``log``;
  ``RolloutTrainerMixin._generate_and_score_completions`` and ``split_by_mini_batches``;
  ``BaseRolloutTrainerMixin._split_data_by_steps``; ``RLHFArguments._init_grpo`` and ``_set_default``
  (the argument defaults they resolve); ``get_even_process_data``
  (``rlhf_trainers/utils.py``); TRL 0.29.1's ``nanmin``/``nanmax`` (which ms-swift imports from
  TRL). ``swift/rl_core/advantage.py`` (advantages, reward metrics) is imported as a module.
  Their packages' ``__init__`` modules (transformers, accelerate, peft, modelscope, vLLM) are not run.
* Stand-ins: the model forward (``_get_per_token_logps_and_entropies`` returns the recorded
  log-probs and entropies of the rows of the micro-batch: the old policy's at generation, the
  reference's, then the current policy's of the iteration), the reward functions
  (``score_completions`` returns the recorded rewards; dynamic sampling's new prompts are the
  round's next pool of recorded completions), the encoder and collator (a
  ``GRPOBatch``-shaped namespace of the rows' masks and rollout log-probs), accelerate's
  ``gather``/``gather_object``/``gather_for_metrics`` (``torch.distributed`` all-gathers, flattened
  as accelerate flattens them; the tensor unchanged in a single process), and transformers'
  training loop: ``training_step`` divides each loss by the accumulation steps and sums it per rank,
  TRL's ``_step`` counts micro-steps, and at each logging step (``logging_steps``,
  ``logging_first_step``) ``SwiftMixin._maybe_log_save_evaluate``'s ``loss`` (the ranks' mean of the
  summed losses over the steps since the last log) goes to ``log``; what is left after the last step
  is logged with the training summary. Data-parallel ranks are processes joined by a gloo process
  group.

With ``"capture"`` in a case's config (the path of ``grpolens/integrations/swift.py``), grpolens'
``SwiftCapture`` is attached to each rank's trainer as a user attaches it; its hook is a recorder
(this venv has no pyarrow) whose calls go to the output for the test to replay into the real hook.

Inputs (``IN.npz``), one row per completion in generation order (round, rank, row): ``len``,
``trunc``, ``rewards`` (one column per reward function), ``old``, ``ref``, ``rollout`` (padded to
the widest) and per iteration ``cur`` / ``ent``. Output (``OUT.json``): ``logs`` (each ``log()``
call's dict, with ``step``), and per rank the sample ids of each loss call in order and the
advantages ms-swift computed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import sys
import tempfile
import textwrap
import types
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist


def _root(pkg: str) -> Path:
    return Path(importlib.util.find_spec(pkg).submodule_search_locations[0])


SWIFT, TRL = _root("swift"), _root("trl")


def _source(path: Path, cls: str | None, names: tuple[str, ...]) -> list[str]:
    """The source of functions ``names`` (of class ``cls``, or module level), decorators included."""
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    body = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            out[node.name] = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
    missing = set(names) - set(out)
    if missing:
        raise RuntimeError(f"{path}: {cls or 'module'} has no {sorted(missing)}")
    return [out[n] for n in names]


def _module_constant(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path}: no {name}")


def _field_defaults(path: Path, classes: tuple[str, ...]) -> dict:
    """The literal defaults of the dataclass fields of ``classes`` (ms-swift's argument mixins)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and st.value is not None and isinstance(st.target, ast.Name):
                    try:
                        out[st.target.id] = ast.literal_eval(st.value)
                    except ValueError:
                        pass
    return out


def _load_advantage():
    """``swift.rl_core.advantage`` without ``swift/__init__`` and ``swift/utils/__init__`` (which import
    transformers and modelscope): ``swift.utils`` is a module holding ms-swift's own ``nanstd``."""
    for pkg in ("swift", "swift.rl_core"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(SWIFT.joinpath(*pkg.split(".")[1:]))]
        sys.modules[pkg] = mod
    utils = types.ModuleType("swift.utils")
    ns = {"torch": torch, "Optional": __import__("typing").Optional, "Union": __import__("typing").Union}
    exec(compile(_source(SWIFT / "utils" / "torch_utils.py", None, ("nanstd",))[0], "swift/utils/torch_utils.py", "exec"), ns)
    utils.nanstd = ns["nanstd"]
    sys.modules["swift.utils"] = utils
    return importlib.import_module("swift.rl_core.advantage")


ADV = _load_advantage()
GRPO_METHODS = (
    "_prepare_inputs", "_score_completions", "_postprocess_batch", "_compute_rewards_per_func", "_compute_advantages",
    "_prepare_batch_inputs", "compute_loss", "_compute_loss", "_compute_loss_single", "_compute_loss_and_metrics",
    "_undo_gradient_accumulation_scaling", "_update_metrics", "_get_rollout_is_correction", "log",
    "_gather_and_flatten", "_prepare_metrics", "_prepare_algorithm_params", "_compute_sequence_level_ratios",
    "_apply_rollout_importance_sampling", "_compute_off_policy_sequence_mask", "_compute_rollout_offpolicy_metrics",
    "_compute_is_correction_metrics", "_dynamic_sampling", "compute_std", "_compute_fipo_influence",
)


# ---------------------------------------------------------------------------------------------- stand-ins

def gather(t: torch.Tensor) -> torch.Tensor:
    """accelerate's ``gather``: the tensor itself in one process, else the ranks' tensors concatenated
    (a 0-dim tensor becomes one element each)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    t = t.detach().clone()[None] if t.ndim == 0 else t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out, dim=0)


def gather_object(obj):
    """accelerate's ``gather_object``: the object itself in one process, else the ranks' lists concatenated."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return [y for x in out for y in x]


class _Accelerator:
    def __init__(self, rank: int, world: int):
        self.num_processes, self.process_index, self.is_main_process = world, rank, rank == 0
        self.device = torch.device("cpu")

    def gather_for_metrics(self, t):  # training: no dataloader remainder to drop
        return gather(t)


class _Model:
    training = True

    def __init__(self, kind: str):
        self.kind = kind


class _TrainerLog:
    """transformers' ``Trainer.log`` (what ``GRPOTrainer.log`` hands its dict to): recorded."""

    def log(self, logs, start_time=None):
        self.logged.append(dict(logs))


def _trainer_class():
    ns = {
        "torch": torch, "dist": dist, "nn": torch.nn, "gather": gather, "gather_object": gather_object,
        "defaultdict": defaultdict, "deque": deque, "os": __import__("os"), "deepcopy": __import__("copy").deepcopy,
        "nullcontext": contextlib.nullcontext, "contextmanager": contextlib.contextmanager,
        "logger": __import__("logging").getLogger("swift"), "profiling_decorator": lambda f: f,
        "profiling_context": lambda *a, **k: contextlib.nullcontext(),
        "compute_advantages": ADV.compute_advantages, "compute_advantages_dynamic": ADV.compute_advantages_dynamic,
        "compute_reward_metrics": ADV.compute_reward_metrics, "expand_advantage_to_per_token": ADV.expand_advantage_to_per_token,
        "apply_rlsd_reweight": ADV.apply_rlsd_reweight, "compute_teacher_kl_per_token": ADV.compute_teacher_kl_per_token,
        "compute_sdar_loss": ADV.compute_sdar_loss, "version": SimpleNamespace(parse=lambda v: tuple(int(x) for x in v.split(".")[:2])),
        "transformers": SimpleNamespace(__version__="4.57"), "JsonlWriter": lambda path: None,
        "WINDOW_NORMALIZED_LOSS_TYPES": _module_constant(SWIFT / "rlhf_trainers" / "grpo_trainer.py", "WINDOW_NORMALIZED_LOSS_TYPES"),
        "disable_gradient_checkpointing": lambda *a, **k: contextlib.nullcontext(),
        "encode_sample": lambda s, template: {}, "collate_to_grpo_micro_batch": _collate,
        "build_opsd_samples": lambda batch: False, "should_compute_local_teacher_logps": lambda **k: False,
        "score_completions": _score_completions, "Any": object, "Dict": dict, "List": list, "Optional": object,
        "Tuple": tuple, "Union": object, "GRPOSample": object, "GRPOBatch": object, "DataType": object,
        "OnPolicySample": object,
    }
    for name, code in (("trl/trainer/utils.py", _source(TRL / "trainer" / "utils.py", None, ("nanmin", "nanmax"))),
                       ("swift/rlhf_trainers/utils.py", _source(SWIFT / "rlhf_trainers" / "utils.py", None, ("get_even_process_data",)))):
        for c in code:
            exec(compile(c, name, "exec"), ns)
    methods = _source(SWIFT / "rlhf_trainers" / "grpo_trainer.py", "GRPOTrainer", GRPO_METHODS)
    methods += _source(SWIFT / "rlhf_trainers" / "rollout_mixin.py", "RolloutTrainerMixin",
                       ("_generate_and_score_completions", "split_by_mini_batches"))
    methods += _source(SWIFT / "rlhf_trainers" / "base_rollout_mixin.py", "BaseRolloutTrainerMixin", ("_split_data_by_steps",))
    body = "\n".join(textwrap.indent(m, "    ") + "\n" for m in methods)
    ns["_TrainerLog"] = _TrainerLog
    exec(compile(f"class GRPOTrainer(_TrainerLog):\n{body}", str(SWIFT / "rlhf_trainers" / "grpo_trainer.py"), "exec"), ns)
    return ns["GRPOTrainer"]


class RecordingHook:
    """Stands in for grpolens' writer hook (pyarrow is not in this venv): every call SwiftCapture
    makes, its arguments as JSON (arrays with their dtype), replayed into the real hook by the test."""

    def __init__(self):
        self.calls = []

    def _record(self, name, kw):
        def enc(v):
            if isinstance(v, torch.Tensor):
                v = v.detach().cpu().numpy()
            if isinstance(v, np.ndarray):
                return {"dtype": str(v.dtype), "shape": list(v.shape), "v": v.reshape(-1).tolist()}
            if isinstance(v, dict):
                return {"dict": {k: enc(x) for k, x in v.items()}}
            return v
        self.calls.append([name, {k: enc(v) for k, v in kw.items()}])

    def log_samples(self, **kw):
        self._record("log_samples", kw)

    def log_loss_call(self, **kw):
        self._record("log_loss_call", kw)

    def end_step(self, step):
        self._record("end_step", {"step": step})

    def close(self):
        self._record("close", {})


def _capture_class(path: str):
    """``grpolens/integrations/swift.py`` loaded by path (grpolens' package needs polars/pyarrow)."""
    spec = importlib.util.spec_from_file_location("grpolens_swift_capture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SwiftCapture


# the recorded data of the running case, by sample id (set per case)
DATA: dict = {}


def _score_completions(samples, reward_funcs, reward_model_plugins, use_gym_env, device, trainer_state,
                       extra_reward_kwargs=None):
    """The reward functions: the recorded rewards of these samples, one column per function."""
    return torch.tensor(DATA["rewards"][[s.id for s in samples]], dtype=torch.float32)


def _rows(ids, name, width):
    a = DATA[name][ids]
    return torch.tensor(a[..., :width] if a.ndim == 2 else a[:, :width])


def _collate(batch, template, device=None, use_logits_to_keep=True):
    """``collate_to_grpo_micro_batch``: the rows' completion masks (padded to the batch's longest
    completion), truncation flags and rollout log-probs."""
    ids = [s.id for s in batch]
    lens = DATA["len"][ids]
    T = int(lens.max())
    mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
    rollout = _rows(ids, "rollout", T) if DATA["has_rollout"] else None
    gb = SimpleNamespace(completion_mask=mask, truncated_mask=torch.tensor(DATA["trunc"][ids]),
                         seq_lengths=torch.tensor(lens), old_per_token_logps=None, ref_per_token_logps=None,
                         rollout_per_token_logps=rollout, teacher_per_token_logps=None, advantages=None,
                         num_items_in_batch=None, logits_to_keep=T, ids=ids)
    return {"input_ids": torch.zeros(len(ids), T, dtype=torch.long)}, gb


def _args(c: dict) -> SimpleNamespace:
    """ms-swift's argument defaults (the field defaults of its argument classes, read from its source)
    under the case's, resolved by ``RLHFArguments._init_grpo`` and ``_set_default`` (β, loss type,
    reward scaling and KL-in-reward). The case gives only what it changes: the defaults are ms-swift's
    own here and grpolens' on the other side, so a default grpolens got wrong shows."""
    d = _field_defaults(SWIFT / "rlhf_trainers" / "args_mixin.py",
                        ("VllmArguments", "RolloutTrainerArgumentsMixin", "GRPOArgumentsMixin"))
    d.update(_field_defaults(SWIFT / "trainers" / "arguments.py", ("TrainArgumentsMixin",)))
    d.update(_field_defaults(SWIFT / "arguments" / "rlhf_args.py", ("GRPOArguments", "RLHFArguments")))
    d.update({"rlhf_type": "grpo", "cached_dataset": None, "cached_val_dataset": None, "truncation_strategy": "left",
              "reward_funcs": c["reward_funcs"], "loss_type": None})
    d.update(c["args"])
    ns = {"logger": __import__("logging").getLogger("swift"), "set_default_ddp_config": lambda: None}
    for name in ("_init_grpo", "_set_default"):  # in RLHFArguments.__post_init__'s order
        exec(compile(_source(SWIFT / "arguments" / "rlhf_args.py", "RLHFArguments", (name,))[0],
                     "swift/arguments/rlhf_args.py", "exec"), ns)
    args = SimpleNamespace(**d)
    ns["_init_grpo"](args)
    ns["_set_default"](args)
    return args


class Runner:
    """One rank's trainer: the ms-swift methods plus what ``__init__`` and the mixins would set."""

    def __init__(self, rank: int, world: int, c: dict):
        T = _trainer_class()
        t = T.__new__(T)
        args = _args(c)
        t.args, t.logged, t.accelerator = args, [], _Accelerator(rank, world)
        t.model, t.ref_model = _Model("policy"), (_Model("ref") if args.beta != 0.0 else None)
        t.template = SimpleNamespace(sequence_parallel_size=1, padding_free=False, truncation_strategy="left")
        t.num_generations = args.num_generations
        t.num_generations_eval = args.num_generations
        t.max_completion_length = args.max_completion_length
        t.beta = args.beta
        t.reward_func_names = c["reward_funcs"]
        t.reward_funcs, t.reward_model_plugins, t.use_gym_env = c["reward_funcs"], [], False
        t.reward_weights = torch.tensor(c["reward_weights"], dtype=torch.float32)
        t.dynamic_num_samples, t.enable_server_multi_turn, t.is_multimodal = False, False, False
        t.disable_rollout_importance_sampling = False
        t._has_teacher, t.use_teacher_api, t._is_dynamic_self_distillation = False, False, False
        t.teacher_kl_coef = args.teacher_kl_coef
        t.use_liger_loss, t.chord_sft_iterator, t.model_accepts_loss_kwargs, t.compute_loss_func = False, None, False, None
        t.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        t.state = SimpleNamespace(global_step=0)
        t._prepare_algorithm_params()
        t._prepare_metrics()
        t._step, t._buffered_inputs = 0, None
        self.t, self.rank, self.world, self.c = t, rank, world, c
        self.calls: list[list[int]] = []
        self.advantages: dict[int, float] = {}
        self.round = 0

        def rollout_samples(inputs):
            ids = self.c["rounds"][self.round][rank]
            self.round, self.attempt = self.round + 1, 0
            return [SimpleNamespace(id=i, rollout_infos={}, messages=[], extra={}) for i in ids]

        def resample(inputs):  # dynamic sampling's next prompts: the round's next pool of completions
            ids = self.c["resample"][self.round - 1][self.attempt][rank]
            self.attempt += 1
            return [SimpleNamespace(id=i, rollout_infos={}, messages=[], extra={}) for i in ids]

        score = t._score_completions

        def score_completions(samples):  # the real one; the samples it keeps are the round's
            kept = score(samples)
            self.round_ids.append([int(i) for i in gather_object([s.id for s in kept])])
            return kept

        def forward(model, model_inputs, grpo_batch, compute_entropy=False, origin_data=None):
            T = grpo_batch.logits_to_keep
            ids = grpo_batch.ids
            if model.kind == "ref":
                return _rows(ids, "ref", T), None
            if grpo_batch.old_per_token_logps is None:  # the old-policy pass at generation
                return _rows(ids, "old", T), None
            it = (t._step // args.steps_per_generation) % args.num_iterations
            ent = torch.tensor(DATA["ent"][it][ids][:, :T]) if compute_entropy else None
            self.calls.append([int(i) for i in ids])
            return torch.tensor(DATA["cur"][it][ids][:, :T]), ent

        self.round_ids: list[list[int]] = []
        t._rollout_samples = rollout_samples
        t._score_completions = score_completions
        t.to_samples, t._generate_completions = resample, (lambda samples: samples)
        t.dynamic_resample_iterator = iter(lambda: None, object())
        t._get_per_token_logps_and_entropies = forward
        t._log_rollout = lambda samples: None
        t._template_context = lambda template: contextlib.nullcontext()
        t._has_teacher_explicit = lambda: False
        t._disable_sp_context = lambda: contextlib.nullcontext()
        self.hook = self.capture = None
        if c.get("capture"):  # grpolens' SwiftCapture on this trainer, as a user attaches it
            self.hook = RecordingHook()
            self.capture = _capture_class(c["capture"])(None, t, config={}, hook=self.hook)

    def train(self) -> list[dict]:
        """transformers' loop: micro-steps, the summed loss, ``log`` at the logging steps."""
        t, args = self.t, self.t.args
        tr_loss, last = torch.tensor(0.0, dtype=torch.float64), 0
        for step in range(1, self.c["steps"] + 1):
            for _ in range(args.gradient_accumulation_steps):
                inputs = t._prepare_inputs(None)
                gb = inputs["grpo_batch"]
                for i, a in zip(gb.ids, gb.advantages[:, 0].tolist()):
                    self.advantages[int(i)] = a
                loss = t.compute_loss(t.model, inputs)
                tr_loss = tr_loss + (loss.detach() / args.gradient_accumulation_steps).double()
                t._step += 1
            t.state.global_step = step
            if (step == 1 and args.logging_first_step) or step % args.logging_steps == 0:
                mean = gather(tr_loss.float()).mean().item()
                logs = {"loss": mean / (step - last)}
                tr_loss, last = torch.tensor(0.0, dtype=torch.float64), step
                t.log(logs)
                t.logged[-1]["step"] = step
        if any(len(v) for v in t._metrics["train"].values()):
            t.log({"train_runtime": 0.0})  # Trainer.train's closing summary
            t.logged[-1]["step"] = self.c["steps"]
        if self.capture is not None:
            self.capture.close()  # the capture's last step, as the user's close() after train()
        return t.logged


def _rank_main(rank: int, world: int, init: str, cases: list):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for case in cases:
        d = np.load(case["in"])
        DATA.clear()
        DATA.update({k: d[k] for k in d.files})
        DATA["has_rollout"] = bool(case["config"].get("rollout", False))
        r = Runner(rank, world, case["config"])
        logs = r.train()
        dumps = [None] * world
        dist.all_gather_object(dumps, {"calls": r.calls, "advantages": r.advantages, "round_ids": r.round_ids,
                                       "capture": r.hook.calls if r.hook is not None else None})
        if rank == 0:
            Path(case["out"]).write_text(json.dumps({"logs": logs, "ranks": dumps}))
        dist.barrier()
    dist.destroy_process_group()


def main():
    import torch.multiprocessing as mp

    cases = json.loads(Path(sys.argv[1]).read_text())
    for world in sorted({c["config"]["world"] for c in cases}):  # one process group per world size
        mine = [c for c in cases if c["config"]["world"] == world]
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank_main, args=(world, f"file://{tmp}/pg", mine), nprocs=world, join=True)
    print(json.dumps([json.loads(Path(c["out"]).read_text())["logs"] for c in cases]))


if __name__ == "__main__":
    main()
