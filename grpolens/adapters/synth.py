"""Realistic synthetic runs, written through the same writer that training uses.

Every random draw comes from a stream derived from ``(seed, stream, step, rank[, micro_batch])`` by
:class:`numpy.random.SeedSequence` spawn keys, so one shard's data never depends on how many steps,
ranks or texts were asked for elsewhere, and injected pathologies are applied *after* generation
from streams of their own: a run with ``--inject kl-spike@5`` equals the clean run of the same
seed everywhere except ``ref_logp`` at step 5.

Shape of one step on one rank: ``groups`` prompts × ``generations`` completions with ragged
lengths (those that reach ``max_len`` are truncated), two reward functions (``accuracy`` 0/1 and
``format`` in [0, 1]), group-normalised advantages, and the completions dealt in order into
``micro_batches`` loss calls. Log-probs are drawn so that the usual training signals look real:
``E[-logp] = entropy``, policy/old ratios near 1 with a few percent outside a 0.2 clip band, a KL
to the reference that grows slowly from ~1e-3 towards ~1e-2, and a rollout mismatch of ~1e-3.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from grpolens.errors import UserError

PATHOLOGIES = ("kl-spike", "rollout-drift", "entropy-collapse", "nan", "clip-drift", "advantage-collapse",
               "length-growth", "reward-hacking", "clip-inactive")
#: Pathologies that last from their step on; the others hit one step only.
_PERSISTENT = {"rollout-drift", "entropy-collapse", "clip-drift", "advantage-collapse", "length-growth",
               "reward-hacking", "clip-inactive"}
#: Pathologies of the samples (rewards, lengths); the tokens follow from them.
_SAMPLE_KINDS = {"advantage-collapse", "length-growth", "reward-hacking"}
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 0.5}

# Stream ids for SeedSequence spawn keys: one per kind of draw, so that adding a draw to one kind
# never shifts another.
_SAMPLES, _TOKENS, _TEXTS = 0, 1, 2
_INJECT = {kind: 10 + i for i, kind in enumerate(PATHOLOGIES)}

_MASK_RATE = 0.04  # masked tokens per token (tool output, padding-like tokens, ...)
_OLD_DRIFT = 0.07  # Laplace scale of logp - old_logp: ~3-4 % of ratios leave [0.8, 1.28]
_ROLLOUT_NOISE = 0.045  # sd of rollout_logp - old_logp: k3 mismatch ~1e-3
_LOGP_FLOOR = -25.0


@dataclass(frozen=True)
class Injection:
    """A pathology to inject: ``kind`` at ``step`` (and, for persistent kinds, every later step)."""

    kind: str
    step: int

    def hits(self, step: int) -> bool:
        return step >= self.step if self.kind in _PERSISTENT else step == self.step

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}"


def parse_injection(spec: str | Injection) -> Injection:
    """``"kl-spike@12"`` -> ``Injection("kl-spike", 12)``; a precise :class:`UserError` otherwise."""
    if isinstance(spec, Injection):
        return spec
    kind, sep, step = str(spec).partition("@")
    if not sep or kind not in PATHOLOGIES or not (step.isascii() and step.isdigit()):
        raise UserError(f"--inject {spec!r}: expected KIND@STEP with KIND one of {', '.join(PATHOLOGIES)}")
    return Injection(kind, int(step))


@dataclass(frozen=True)
class SynthSpec:
    """Everything that determines a synthetic run's data."""

    steps: int = 10
    ranks: int = 1
    micro_batches: int = 1
    groups: int = 4
    generations: int = 4
    max_len: int = 256
    seed: int = 0
    vocab: int = 32_000
    texts: bool = False
    inject: tuple[Injection, ...] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("steps", "ranks", "micro_batches", "groups", "max_len"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.generations < 2:
            raise UserError(f"--generations must be >= 2 (group normalisation needs two), got {self.generations}")
        if self.micro_batches > self.completions_per_rank:
            raise UserError(
                f"--micro-batches {self.micro_batches} exceeds the {self.completions_per_rank} completions "
                f"per step and rank (groups × generations): some loss calls would be empty"
            )
        if self.vocab < 2:
            raise UserError(f"--vocab must be >= 2, got {self.vocab}")
        if self.seed < 0:
            raise UserError(f"--seed must be >= 0, got {self.seed}")
        for inj in self.inject:
            if not 0 <= inj.step < self.steps:
                raise UserError(f"--inject {inj}: step {inj.step} is outside the run (steps 0..{self.steps - 1})")

    @property
    def completions_per_rank(self) -> int:
        return self.groups * self.generations

    def config(self) -> dict:
        """The manifest ``config`` of the algorithm this run pretends to have trained with."""
        return {
            "loss_type": "grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.28,
            "beta": 0.04,
            "importance_sampling_level": "token",
            "temperature": 1.0,
            "max_completion_length": self.max_len,
            "num_generations": self.generations,
            "gradient_accumulation_steps": self.micro_batches,
            "scale_rewards": "group",
            "reward_weights": list(REWARD_WEIGHTS.values()),
            "reward_funcs": list(REWARD_WEIGHTS),
            "rollout_is": {
                "level": "token", "mode": "truncate", "lower": 0.5, "upper": 2.0,
                "veto_lower": 1e-4, "veto_upper": 1e4,
            },
        }


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


# Slow, step-dependent trends (functions of the absolute step, so a shorter run is a prefix).
def entropy_mean(step: int) -> float:
    return 0.45 + 1.1 * np.exp(-step / 250.0)


def ref_kl_target(step: int) -> float:
    """Approximate mean k3 KL(policy || ref) at ``step``: ~1e-3 at first, towards ~1e-2."""
    return 1e-3 + 9e-3 * (1.0 - np.exp(-step / 300.0))


def accuracy_mean(step: int) -> float:
    return 0.3 + 0.4 * (1.0 - np.exp(-step / 150.0))


# ---------------------------------------------------------------------------------------------
# Samples: one (step, rank)
# ---------------------------------------------------------------------------------------------

def generate_samples(spec: SynthSpec, step: int, rank: int) -> dict[str, np.ndarray]:
    """The samples columns of one (step, rank): ``groups × generations`` completions."""
    G, K, L = spec.groups, spec.generations, spec.max_len
    n = G * K
    rng = _rng(spec.seed, _SAMPLES, step, rank)
    raw_len = np.exp(rng.normal(np.log(0.45 * L), 0.5, n))
    truncated = raw_len > L
    lens = np.clip(np.ceil(raw_len), 1, L).astype(np.int32)

    p_correct = rng.beta(2 * accuracy_mean(step), 2 * (1 - accuracy_mean(step)), G)
    accuracy = ((rng.random(n) < np.repeat(p_correct, K)) & ~truncated).astype(np.float64)
    fmt = np.round(rng.beta(5.0, 2.0, n) * 4) / 4
    fmt[truncated] = 0.0
    for inj in spec.inject:
        if inj.kind in _SAMPLE_KINDS and inj.hits(step):
            lens, truncated, accuracy, fmt = _inject_samples(
                inj, step, G, K, L, lens, raw_len, truncated, accuracy, fmt, _rng(spec.seed, _INJECT[inj.kind], step, rank))
    reward = REWARD_WEIGHTS["accuracy"] * accuracy + REWARD_WEIGHTS["format"] * fmt
    grouped = reward.reshape(G, K)
    adv = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-4)

    first = (step * spec.ranks + rank) * n
    return {
        "sample_id": np.arange(first, first + n, dtype=np.int64),
        "group_id": np.repeat(np.arange((step * spec.ranks + rank) * G, (step * spec.ranks + rank + 1) * G), K),
        "prompt_len": np.repeat(rng.integers(16, 257, G), K).astype(np.int32),
        "completion_len": lens,
        "truncated": truncated,
        "reward": reward,
        "reward/accuracy": accuracy,
        "reward/format": fmt,
        "advantage": adv.reshape(n).astype(np.float32),
    }


def _inject_samples(inj: Injection, step: int, G: int, K: int, L: int, lens, raw_len, truncated, accuracy, fmt,
                    rng: np.random.Generator):
    """A pathology of the completions themselves: ``(lens, truncated, accuracy, format)`` after it."""
    n = G * K
    if inj.kind == "advantage-collapse":
        # every group's completions end alike: 70 % of the groups all right, the rest all wrong, one
        # format score per group, nothing truncated; the rewards have no spread, the advantages are 0
        right = np.repeat(rng.random(G) < 0.7, K)
        accuracy = right.astype(np.float64)
        fmt = np.repeat(np.round(rng.beta(5.0, 2.0, G) * 4) / 4, K)
        truncated = np.zeros(n, bool)
    elif inj.kind == "length-growth":
        # completions 1.5× longer at once, then 5 % more each step; more of them hit the limit
        grown = raw_len * (1.5 + 0.05 * (step - inj.step))
        truncated = grown > L
        lens = np.clip(np.ceil(grown), 1, L).astype(np.int32)
        accuracy = np.where(truncated, 0.0, accuracy)
        fmt = np.where(truncated, 0.0, fmt)
    elif inj.kind == "reward-hacking":
        # a shortcut the reward functions accept: short boilerplate answers (30 % of the length)
        # judged right 70 % of the time and almost always well formatted
        lens = np.maximum(np.ceil(raw_len * 0.3), 1).clip(max=L).astype(np.int32)
        truncated = np.zeros(n, bool)
        accuracy = (rng.random(n) < 0.7).astype(np.float64)
        fmt = np.where(rng.random(n) < 0.8, 1.0, 0.75)
    return lens, truncated, accuracy, fmt


def micro_batch_slices(spec: SynthSpec) -> list[slice]:
    """Completions of a (step, rank) dealt in order into ``micro_batches`` near-equal loss calls."""
    bounds = np.linspace(0, spec.completions_per_rank, spec.micro_batches + 1).round().astype(int)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# ---------------------------------------------------------------------------------------------
# Tokens: one (step, rank, micro_batch)
# ---------------------------------------------------------------------------------------------

def generate_tokens(spec: SynthSpec, step: int, rank: int, micro_batch: int,
                    samples: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The token columns of one loss call, sorted by (sample_id, pos), with injections applied."""
    if samples is None:
        samples = generate_samples(spec, step, rank)
    sl = micro_batch_slices(spec)[micro_batch]
    ids, lens, seq_adv = samples["sample_id"][sl], samples["completion_len"][sl], samples["advantage"][sl]
    T = int(lens.sum())
    starts = np.cumsum(lens) - lens
    rng = _rng(spec.seed, _TOKENS, step, rank, micro_batch)
    f32 = np.float32

    token_id = np.minimum((spec.vocab * rng.random(T, dtype=f32) ** 3).astype(np.int32), spec.vocab - 1)
    entropy = f32(entropy_mean(step) / 2) * rng.standard_gamma(2.0, T, dtype=f32)
    # The sampled token's surprisal has mean equal to the entropy.
    logp = np.maximum(-entropy * rng.standard_exponential(T, dtype=f32), f32(_LOGP_FLOOR))
    drift = (rng.standard_exponential(T, dtype=f32) - rng.standard_exponential(T, dtype=f32)) * f32(_OLD_DRIFT)
    old_logp = np.minimum(logp + drift, f32(0))
    ref_sd = f32(np.sqrt(2 * ref_kl_target(step)))  # k3 ≈ d²/2 for small d
    ref_logp = np.minimum(logp + ref_sd * rng.standard_normal(T, dtype=f32), f32(0))
    rollout_logp = np.minimum(old_logp + f32(_ROLLOUT_NOISE) * rng.standard_normal(T, dtype=f32), f32(0))
    mask = rng.random(T, dtype=f32) >= f32(_MASK_RATE)

    cols = {
        "sample_id": np.repeat(ids, lens),
        "pos": (np.arange(T, dtype=np.int64) - np.repeat(starts, lens)).astype(np.int32),
        "token_id": token_id,
        "logp": logp,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        "rollout_logp": rollout_logp,
        "advantage": np.repeat(seq_adv, lens),
        "mask": mask,
        "entropy": entropy,
    }
    for inj in spec.inject:
        if inj.hits(step):
            _inject(cols, inj, step, _rng(spec.seed, _INJECT[inj.kind], step, rank, micro_batch))
    return cols


def _inject(cols: dict[str, np.ndarray], inj: Injection, step: int, rng: np.random.Generator) -> None:
    f32 = np.float32
    T = len(cols["logp"])
    if inj.kind == "kl-spike":
        # The reference disagrees wildly: mean k3 KL of order 1.
        cols["ref_logp"] = np.minimum(cols["logp"] + f32(1.5) * rng.standard_normal(T, dtype=f32), f32(0))
    elif inj.kind == "rollout-drift":
        # Temperature-mismatch signature: the engine's log-probs sit a constant ~0.1 below.
        noise = f32(0.05) * rng.standard_normal(T, dtype=f32)
        cols["rollout_logp"] = np.minimum(cols["rollout_logp"] - f32(0.1) + noise, f32(0))
    elif inj.kind == "entropy-collapse":
        # The policy turns deterministic; the reference does not follow, so KL to it grows.
        scale = f32(0.01 / entropy_mean(step))
        for name in ("entropy", "logp", "old_logp", "rollout_logp"):
            cols[name] = cols[name] * scale
    elif inj.kind == "clip-drift":
        # The policy moves too far per step (learning rate, too many epochs on stale rollouts): the
        # current log-probs wander ~0.4 nats from the behaviour policy's, so a large share of ratios
        # leaves the clip range. The reference moves with the policy, so only clipping shows it.
        moved = cols["old_logp"] + (rng.standard_exponential(T, dtype=f32)
                                    - rng.standard_exponential(T, dtype=f32)) * f32(0.4)
        moved = np.minimum(moved, f32(0))
        cols["ref_logp"] = np.minimum(cols["ref_logp"] + (moved - cols["logp"]), f32(0))
        cols["logp"] = moved
    elif inj.kind == "clip-inactive":
        # the old log-probs are taken from the current policy (recomputed after the update): every
        # ratio is exactly 1, so the clip band cannot act
        cols["old_logp"] = cols["logp"].copy()
    elif inj.kind == "nan":
        k = max(3, T // 100)  # at least one NaN, one -inf and one +inf per loss call
        where = rng.choice(T, size=min(k, T), replace=False)
        logp = cols["logp"].copy()
        thirds = np.array_split(where, 3)
        logp[thirds[0]] = np.nan
        logp[thirds[1]] = -np.inf
        logp[thirds[2]] = np.inf
        cols["logp"] = logp


# ---------------------------------------------------------------------------------------------
# Texts: short fake prompts and completions, some with markup that display code must not render
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "the", "answer", "is", "therefore", "we", "compute", "sum", "of", "x", "y", "=", "+", "2", "7", "42",
    "step", "check", "so", "first", "then", "because", "<think>", "</think>", "<script>alert(1)</script>",
    "[bold]", "[/bold]", "[link=http://x]", "**", "`code`", "$\\frac{1}{2}$", "<b>", "&amp;", "{{x}}",
    "数学", "🙂", "\n", "\t", "'", '"',
)
_SUBJECTS = ("arithmetic", "algebra", "geometry", "logic", "<img src=x onerror=alert(1)>", "[red]colour[/red]")


def generate_texts(spec: SynthSpec, step: int, rank: int, samples: dict[str, np.ndarray]) -> dict[str, list[str]]:
    rng = _rng(spec.seed, _TEXTS, step, rank)
    G, K = spec.groups, spec.generations
    subj = rng.integers(0, len(_SUBJECTS), G)
    words = rng.integers(0, len(_WORDS), (G * K, 24))
    n_words = np.minimum(samples["completion_len"] // 2 + 1, 24)
    prompts = [f"Problem {gid} ({_SUBJECTS[subj[i // K]]}): what is {gid % 97} + {gid % 13}?"
               for i, gid in enumerate(samples["group_id"].tolist())]
    completions = [" ".join(_WORDS[w] for w in row[:nw]) + (" …" if tr else "")
                   for row, nw, tr in zip(words.tolist(), n_words.tolist(), samples["truncated"].tolist())]
    return {"prompt": prompts, "completion": completions}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def _write_steps(spec: SynthSpec, writers: list) -> None:
    """Every step of ``spec`` through ``writers`` (one per rank), then close them. All are open at
    once, as in training: their background threads encode Parquet (which releases the GIL) in
    parallel while this thread generates. A resumed writer drops the steps it already has."""
    with contextlib.ExitStack() as stack:
        for w in writers:
            stack.enter_context(w)
        for step in range(spec.steps):
            for rank, w in enumerate(writers):
                if step in w.kept_steps:
                    continue
                samples = generate_samples(spec, step, rank)
                sample_cols: dict = dict(samples)
                if spec.texts:
                    sample_cols.update(generate_texts(spec, step, rank, samples))
                w.add_samples(step, sample_cols)
                for mb in range(spec.micro_batches):
                    w.add_tokens(step, mb, generate_tokens(spec, step, rank, mb, samples))
                w.end_step(step)


def synth_run(out: os.PathLike | str, *, steps: int = 10, ranks: int = 1, micro_batches: int = 1, groups: int = 4,
              generations: int = 4, max_len: int = 256, seed: int = 0, vocab: int = 32_000, texts: bool = False,
              inject: Iterable[str | Injection] = (), overwrite: bool = False, resume: bool = False,
              run_name: str | None = None) -> Path:
    """Write a synthetic run to ``out`` and return its path.

    The run is built in a hidden sibling directory and renamed into place at the end, so ``out``
    never holds a half-written run. An existing ``out`` is replaced only with ``overwrite=True``,
    and only if it is empty or a grpolens run (never an arbitrary directory). ``resume=True``
    continues an existing synthetic run written with the same settings (``steps`` may be more):
    its complete steps are kept, its incomplete ones written again, the missing ones added.
    """
    import grpolens
    from grpolens.run.format import Manifest, is_run
    from grpolens.capture.writer import ShardWriter

    spec = SynthSpec(steps, ranks, micro_batches, groups, generations, max_len, seed, vocab, texts,
                     tuple(parse_injection(s) for s in inject))
    out = Path(out)
    settings = {"seed": seed, "steps": steps, "ranks": ranks, "micro_batches": micro_batches, "groups": groups,
                "generations": generations, "max_len": max_len, "vocab": vocab, "texts": texts,
                "inject": [str(i) for i in spec.inject]}
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if resume and out.exists():
        if not is_run(out):
            raise UserError(f"--resume: {out} is not a grpolens run")
        from grpolens.run.format import read_manifest, write_manifest

        manifest = read_manifest(out)
        before = manifest.extra.get("synth") or {}
        differ = [k for k in settings if k != "steps" and before.get(k) != settings[k]]
        if differ:
            k = differ[0]
            raise UserError(f"--resume: {out} was written with {k}={before.get(k)!r}, not {settings[k]!r}")
        _write_steps(spec, [ShardWriter(out, rank=rank, world_size=ranks, mode="resume") for rank in range(ranks)])
        manifest.extra["synth"] = {**before, "steps": max(steps, int(before.get("steps", 0)))}
        write_manifest(out, manifest)
        return out
    if out.exists():
        if not overwrite:
            raise UserError(f"{out} already exists (pass --overwrite to replace it, or --resume to continue it)")
        if not out.is_dir() or (any(out.iterdir()) and not is_run(out)):
            raise UserError(f"{out} exists and is not a grpolens run; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.synth-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)

    manifest = Manifest(
        run_name=run_name or out.name,
        world_size=ranks,
        trainer={"name": "grpolens-synth", "version": grpolens.__version__},
        config=spec.config(),
        extra={"synth": settings},
    )
    try:
        _write_steps(spec, [ShardWriter(tmp, rank=rank, world_size=ranks, manifest=manifest if rank == 0 else None)
                            for rank in range(ranks)])
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
