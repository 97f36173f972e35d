"""Runs OpenRLHF 0.11.2's own code on recorded steps and prints what it logs (JSON).

Executed by the reference venv's interpreter (``tests/reference/refvenv.py``), never by grpolens'
environment: ``python openrlhf_driver.py CASES.json`` runs each case ``{"in": IN.npz, "config":
{...}, "out": OUT.json}`` and prints one JSON list, the logged status of each case.

What is OpenRLHF's code and what stands in for its plumbing:

* Imported from the installed package, module by module: ``openrlhf.models.loss`` (``PolicyLoss``,
  ``aggregate_loss``), ``openrlhf.models.utils`` (``compute_approx_kl``, ``compute_reward``,
  ``masked_mean``), ``openrlhf.utils.loss_utils`` (``iter_grad_accum_global_norm``,
  ``_optimizer_step_loss_norm``), ``openrlhf.trainer.ppo_utils`` (``Experience``,
  ``NaiveReplayBuffer`` with its split/unpad/collate, the length penalties, the KL controller).
  Their packages' ``__init__`` modules (which import the model classes, DeepSpeed and vLLM) are not
  run; ``deepspeed`` and ``transformers`` are empty modules here, imported at the top of
  ``models/utils.py`` and ``utils/utils.py`` but used only by functions the driver never calls.
* Run from the installed sources (``ast``-extracted, unchanged): ``ActorPPOTrainer.ppo_train`` and
  ``.training_step`` (``trainer/ray/ppo_actor.py``), ``RemoteExperienceMaker.compute_advantages_and_returns``
  and its return helpers (``experience_maker.py``), ``SamplesGenerator._process_response_into_experience``
  (``samples_generator.py``) and ``BasePPOTrainer._compute_rollout_stats`` (``ppo_trainer.py``). Their
  modules import Ray, vLLM and DeepSpeed, which the methods themselves do not need.
* Stand-ins: the model (``actor(...)`` returns the recorded log-probs and entropies of the rows it is
  given: each row is known by the sample id the capture's ids carry), the DeepSpeed strategy (``all_reduce`` as
  ``DeepspeedStrategy.all_reduce``: ``op="mean"`` divides by the world size and sums with
  ``torch.distributed``; backward and optimizer step do nothing) and the experience maker's model
  forwards (its KL loop is replayed: ``compute_approx_kl`` of the actor's log-probs against the
  reference, ``masked_mean`` per row). Data-parallel ranks are processes joined by a gloo process
  group, so every all-reduce is torch.distributed's own.

Inputs (``IN.npz``) per sample: ``prompt_len``, ``resp_len``, ``reward``, ``truncated`` and, over the
response tokens (padded to the widest), ``old`` (the actor's log-probs at experience time),
``ref``, ``rollout`` and per epoch ``cur`` / ``ent`` (the training forward's log-probs and
entropies). Output (``OUT.json``): the status ``ppo_train`` returns merged with the rollout
statistics (the keys OpenRLHF's logger writes under ``train/``), and each rank's loss calls: the
sample ids of every micro-batch in order (the DataLoader shuffles with the rank's seed).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
import textwrap
import types
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist


def _load_openrlhf():
    """Register OpenRLHF's packages without running their ``__init__`` and import the modules used."""
    import importlib.util

    spec = importlib.util.find_spec("openrlhf")
    root = Path(spec.submodule_search_locations[0])
    for name, names in (("deepspeed", ()), ("transformers", ("AutoTokenizer",))):
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        for attr in names:  # imported by name, used only by functions the driver does not call
            setattr(mod, attr, None)
    for pkg in ("openrlhf", "openrlhf.models", "openrlhf.utils", "openrlhf.trainer", "openrlhf.trainer.ppo_utils"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
        sys.modules[pkg] = mod
    import importlib

    mods = {n: importlib.import_module(n) for n in (
        "openrlhf.models.utils", "openrlhf.models.loss", "openrlhf.utils.loss_utils",
        "openrlhf.trainer.ppo_utils.experience", "openrlhf.trainer.ppo_utils.replay_buffer",
        "openrlhf.trainer.ppo_utils.length_penalty", "openrlhf.trainer.ppo_utils.kl_controller")}
    return root, mods


ROOT, M = _load_openrlhf()
U, LOSS, LU = M["openrlhf.models.utils"], M["openrlhf.models.loss"], M["openrlhf.utils.loss_utils"]
EXP = M["openrlhf.trainer.ppo_utils.experience"]
Experience = EXP.Experience


def _methods(rel: str, cls: str, names: tuple[str, ...], namespace: dict) -> dict:
    """Methods of class ``cls`` in OpenRLHF's source file ``rel``, compiled unchanged in ``namespace``."""
    path = ROOT / rel
    src = path.read_text()
    tree = ast.parse(src)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for node in klass.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            code = textwrap.dedent(ast.get_source_segment(src, node, padded=True))
            exec(compile(code, f"{path}:{cls}.{node.name}", "exec"), namespace)
            out[node.name] = namespace[node.name]
    missing = set(names) - set(out)
    if missing:
        raise RuntimeError(f"{rel}: {cls} has no {sorted(missing)}")
    return out


def _ns(**extra) -> dict:
    from typing import Dict, List, Optional, Tuple

    from torch.utils.data import DataLoader
    from tqdm import tqdm

    import itertools
    import logging

    return {"torch": torch, "itertools": itertools, "DataLoader": DataLoader, "tqdm": tqdm, "fields": fields, "Experience": Experience,
            "Dict": Dict, "List": List, "Optional": Optional, "Tuple": Tuple, "logger": logging.getLogger("openrlhf"),
            "masked_mean": U.masked_mean, "compute_approx_kl": U.compute_approx_kl, "compute_reward": U.compute_reward,
            "aggregate_loss": LOSS.aggregate_loss, "get_loss_batch_info": LU.get_loss_batch_info,
            "iter_grad_accum_global_norm": LU.iter_grad_accum_global_norm,
            "apply_length_penalties": M["openrlhf.trainer.ppo_utils.length_penalty"].apply_length_penalties,
            "merge_mm_train_inputs": None, **extra}


ACTOR = _methods("trainer/ray/ppo_actor.py", "ActorPPOTrainer", ("ppo_train", "training_step"), _ns())
MAKER = _methods("trainer/ppo_utils/experience_maker.py", "RemoteExperienceMaker",
                 ("compute_advantages_and_returns", "get_advantages_and_returns", "get_cumulative_returns"), _ns())
GEN = _methods("trainer/ppo_utils/samples_generator.py", "SamplesGenerator", ("_process_response_into_experience",), _ns())
STATS = _methods("trainer/ppo_trainer.py", "BasePPOTrainer", ("_compute_rollout_stats",), _ns())


def _args(c: dict) -> SimpleNamespace:
    """OpenRLHF's hierarchical args from dotted names (what ``hierarchize`` builds)."""
    root: dict = {}
    for k, v in c.items():
        d = root
        parts = k.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v

    def ns(d):
        return SimpleNamespace(**{k: ns(v) if isinstance(v, dict) else v for k, v in d.items()})
    return ns(root)


def config_args(c: dict) -> SimpleNamespace:
    base = {
        "actor.eps_clip_low_high": [0.2, 0.2], "actor.dual_clip": None, "actor.loss_agg_mode": "token-mean",
        "actor.policy_loss_type": "ppo", "actor.entropy_coef": None, "actor.aux_loss_coef": 0.0,
        "algo.advantage.is_correction_level": "off", "algo.advantage.is_correction_mode": "mask",
        "algo.advantage.is_correction_gating": "ratio", "algo.advantage.is_correction_threshold": [0.5, 5.0],
        "algo.advantage.estimator": "group_norm", "algo.advantage.gamma": 1.0, "algo.advantage.lambd": 1.0,
        "algo.advantage.no_std_norm": False, "algo.kl.use_loss": False, "algo.kl.init_coef": 0.01,
        "algo.kl.estimator": "k1", "algo.kl.unbiased_gradient": False, "rollout.n_samples_per_prompt": 4,
        "train.max_epochs": 1, "train.dynamic_batch_enable": False, "ds.packing_samples": False,
        "ds.tensor_parallel_size": 1, "data.max_len": 2048, "reward.clip_range": [-10.0, 10.0],
    }
    return _args({**base, **c})


class Strategy:
    """DeepSpeed's strategy as ppo_train uses it; ``all_reduce`` is ``DeepspeedStrategy.all_reduce``."""

    def __init__(self, args, gas: int):
        self.args = args
        self.accumulated_gradient = gas
        self.ring_attn_group = None
        self.world_size = dist.get_world_size()

    def is_rank_0(self):
        return dist.get_rank() == 0

    def all_reduce(self, data, op="mean"):
        if isinstance(data, dict):
            return {k: self.all_reduce(v, op) for k, v in data.items()}
        is_tensor = isinstance(data, torch.Tensor)
        if not is_tensor:
            data = torch.Tensor([data])
        if op == "mean":
            data /= self.world_size
        dist.all_reduce(data, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return data.item() if not is_tensor else data

    def backward(self, *a, **k):
        pass

    def optimizer_step(self, *a, **k):
        pass

    def moving_average(self, *a, **k):
        pass

    def get_grad_norm(self, model):
        return 0.0


class Model:
    """The actor's forward: the recorded log-probs (× action mask, as ``Actor.forward`` returns them)
    and entropies of each row's sample at its next pass."""

    def __init__(self, data):
        self.d = data
        self.passes: dict[int, int] = {}

    def train(self):
        pass

    def __call__(self, sequences, action_mask, return_entropy=False, **kw):
        ids = list(self._labels)
        logp = torch.zeros(action_mask.shape, dtype=torch.float32)
        ent = torch.zeros(action_mask.shape, dtype=torch.float32)
        for i, sid in enumerate(ids):
            e = self.passes.get(sid, 0)
            self.passes[sid] = e + 1
            pos = torch.nonzero(action_mask[i]).flatten()
            n = len(pos)
            logp[i, pos] = torch.from_numpy(self.d["cur"][e, sid, :n])
            ent[i, pos] = torch.from_numpy(self.d["ent"][e, sid, :n])
        logp = logp * action_mask.float()
        self.last = (logp.clone(), ent.clone())
        return logp, SimpleNamespace(entropy=ent, aux_loss=None)


def build_experiences(d, args, rows: list[int]) -> list:
    """Experiences of ``rows`` as the samples generator and experience maker build them (rollout
    micro-batch of one sample)."""
    exps = []
    max_len = int(args.data.max_len)
    for sid in rows:
        p, n = int(d["prompt_len"][sid]), int(d["resp_len"][sid])
        obs = list(range(1, p + n + 1))
        roll = np.zeros(p + n, dtype=np.float32)
        roll[p:p + n] = d["rollout"][sid, :n]
        response = {"observation_tokens": obs, "action_ranges": [(p, p + n)], "reward": float(d["reward"][sid]),
                    "rollout_log_probs": roll.tolist(), "prompt": str(sid), "label": str(sid),
                    "truncated": bool(d["truncated"][sid])}
        exp = GEN["_process_response_into_experience"](None, response, max_len=max_len)
        exp.index = [sid]
        exps.append(exp)
    return exps


def make_experience(d, args, exps: list) -> None:
    """``RemoteExperienceMaker.make_experience``'s KL loop on the recorded actor and reference log-probs."""
    for exp in exps:
        sid = exp.index[0]
        am = exp.action_mask
        pos = torch.nonzero(am[0]).flatten()
        n = len(pos)
        alp = torch.zeros(am.shape, dtype=torch.float32)
        alp[0, pos] = torch.from_numpy(d["old"][sid, :n])
        base = torch.zeros(am.shape, dtype=torch.float32)
        base[0, pos] = torch.from_numpy(d["ref"][sid, :n])
        alp, base = alp * am.float(), base * am.float()
        has_ref = float(args.algo.kl.init_coef) > 0
        if has_ref and not args.algo.kl.use_loss:
            kl = U.compute_approx_kl(alp, base, kl_estimator=args.algo.kl.estimator)
            logprobs_diff = alp.float() - base.float()
        else:
            kl = torch.zeros_like(alp)
            logprobs_diff = torch.zeros_like(alp)
        exp.info["kl"] = U.masked_mean(kl, am, dim=-1)
        exp.info["logprobs_diff"] = U.masked_mean(logprobs_diff, am, dim=-1)
        exp.action_log_probs = alp
        exp.base_action_log_probs = base if args.algo.kl.use_loss else None
        exp.grpolens_ref = base if has_ref else None  # what keep_reference sees in the maker's loop
        exp.values = None
        exp.kl = kl


def tag(exps: list, args, step: int) -> None:
    """The two driver lines of grpolens' OpenRLHF capture (``keep_reference`` in the experience
    maker's loop, ``tag_experiences`` after it; ``grpolens.integrations.openrlhf``), written out
    here because grpolens is not importable in this venv: the rows' ids and, without the KL loss,
    their reference log-probs in ``info``, where OpenRLHF's replay buffer carries them to the actor."""
    n = int(args.rollout.n_samples_per_prompt)
    for e in exps:
        m = e.action_mask.bool()
        if e.base_action_log_probs is None and e.grpolens_ref is not None:
            e.info["grpolens_ref_logp"] = [row[mm].float() for row, mm in zip(e.grpolens_ref, m)]
        index = torch.as_tensor(e.index, dtype=torch.int64)
        e.info["grpolens_sample_id"] = step * 1_000_000 + index
        e.info["grpolens_group_id"] = step * 1_000_000 + index // n


_TAGS = ("grpolens_sample_id", "grpolens_group_id", "grpolens_ref_logp")


def _t(x):
    return None if x is None else x.detach().clone()


def _rank_main(rank: int, world: int, init: str, cases: list):
    """One data-parallel rank: every case of this world size, in order."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for case in cases:
        _run_case(rank, world, case, case["out"])
    dist.destroy_process_group()


def _run_case(rank: int, world: int, case: dict, result: str):
    d = dict(np.load(case["in"]))
    c = case["config"]
    args = config_args(c["args"])
    B = len(d["reward"])
    exps = build_experiences(d, args, list(range(B)))
    kl_ctl = M["openrlhf.trainer.ppo_utils.kl_controller"].FixedKLController(float(args.algo.kl.init_coef))
    make_experience(d, args, exps)
    maker = SimpleNamespace(strategy=SimpleNamespace(args=args), args=args, kl_ctl=kl_ctl,
                            advantage_estimator=args.algo.advantage.estimator)
    maker.get_cumulative_returns = lambda *a: MAKER["get_cumulative_returns"](maker, *a)
    maker.get_advantages_and_returns = lambda *a: MAKER["get_advantages_and_returns"](maker, *a)
    exps = MAKER["compute_advantages_and_returns"](maker, exps)
    tag(exps, args, int(c.get("step", 1)))
    rollout_stats = STATS["_compute_rollout_stats"](None, exps)
    mine = [e for e in exps if e.index[0] in set(c["ranks"][rank])]
    torch.manual_seed(int(c.get("seed", 0)) * 100 + rank)  # the DataLoader's shuffle
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # NaiveReplayBuffer names a target device it never uses here
    buf = M["openrlhf.trainer.ppo_utils.replay_buffer"].NaiveReplayBuffer(
        int(c["micro_train_batch_size"]), 0, True, bool(c.get("packing_samples", False)), False)
    torch.cuda.current_device = lambda: "cpu"  # ppo_train moves each micro-batch to this device
    for e in mine:
        buf.append(e)
    items = [{"info": {k: v for k, v in it.info.items()}, "response_length": it.response_length,
              "total_length": it.total_length, "truncated": it.truncated, "action_mask": it.action_mask,
              "advantages": it.advantages} for it in buf.items]
    model = Model(d)
    trainer = SimpleNamespace(
        args=args, strategy=Strategy(args, int(c["accumulated_gradient"])), replay_buffer=buf, actor=model,
        ema_model=None, actor_optim=None, actor_scheduler=SimpleNamespace(get_last_lr=lambda: [1e-6]),
        dataloader_pin_memory=False, max_epochs=int(args.train.max_epochs), aux_loss=False,
        actor_loss_fn=LOSS.PolicyLoss(
            clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
            dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
            policy_loss_type=args.actor.policy_loss_type,
            is_correction_level=args.algo.advantage.is_correction_level,
            is_correction_mode=args.algo.advantage.is_correction_mode,
            is_correction_gating=args.algo.advantage.is_correction_gating,
            is_correction_threshold=args.algo.advantage.is_correction_threshold))
    calls = []

    def training_step(experience, kl, step, info):
        # what the capture's log_micro_batch reads, and its taking the ids out of info
        tags = {k: experience.info.pop(k) for k in _TAGS if k in experience.info}
        model._labels = [int(x) % 1_000_000 for x in tags["grpolens_sample_id"]]
        status = ACTOR["training_step"](trainer, experience, kl, step, info)
        calls.append({"info": tags, "action_mask": _t(experience.action_mask),
                      "action_log_probs": _t(experience.action_log_probs),
                      "base_action_log_probs": _t(experience.base_action_log_probs),
                      "rollout_log_probs": _t(experience.rollout_log_probs), "advantages": _t(experience.advantages),
                      "logp": model.last[0], "entropy": model.last[1]})
        return status
    trainer.training_step = training_step
    status = ACTOR["ppo_train"](trainer, kl_ctl.value)
    torch.cuda.current_device = real
    dumps = [None] * world
    dist.all_gather_object(dumps, {"items": items, "calls": calls})
    if rank == 0:
        status.update(rollout_stats)
        torch.save({"status": {k: float(v) for k, v in status.items()}, "ranks": dumps}, result)
    dist.barrier()


def main():
    import torch.multiprocessing as mp

    cases = json.loads(Path(sys.argv[1]).read_text())
    for world in sorted({len(c["config"]["ranks"]) for c in cases}):  # one process group per world size
        mine = [c for c in cases if len(c["config"]["ranks"]) == world]
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank_main, args=(world, f"file://{tmp}/pg", mine), nprocs=world, join=True)
    print(json.dumps([torch.load(c["out"], weights_only=False)["status"] for c in cases]))


if __name__ == "__main__":
    main()
