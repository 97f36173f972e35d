"""Small runs for the explain tests, written through the real writer: completions as plain
dictionaries (so a test can plant a pathology in a few of them), dealt to ranks and loss calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CONFIG = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04,
          "importance_sampling_level": "token", "num_generations": 4}


@dataclass
class Completion:
    sample_id: int
    group_id: int
    reward: float
    token_id: np.ndarray
    logp: np.ndarray
    old_logp: np.ndarray
    ref_logp: np.ndarray
    entropy: np.ndarray
    advantage: float
    mask: np.ndarray = field(default=None)
    rollout_logp: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.mask is None:
            self.mask = np.ones(len(self.token_id), dtype=bool)
        if self.rollout_logp is None:
            self.rollout_logp = np.minimum(self.old_logp - 0.01 * np.cos(np.arange(len(self.token_id))), 0.0)


def random_step(rng: np.random.Generator, step: int, groups: int = 4, generations: int = 4, max_len: int = 24,
                vocab: int = 50, masked: float = 0.1) -> list[Completion]:
    out = []
    for g in range(groups):
        rewards = rng.integers(0, 2, generations).astype(float) * rng.choice([1.0, -1.0, 0.5])
        adv = rewards - rewards.mean()
        for k in range(generations):
            n = int(rng.integers(1, max_len + 1))
            logp = -rng.gamma(1.0, 1.0, n)
            out.append(Completion(
                sample_id=step * 1000 + g * generations + k, group_id=step * 100 + g, reward=float(rewards[k]),
                token_id=rng.integers(0, vocab, n), logp=logp, old_logp=np.minimum(logp + rng.laplace(0, 0.1, n), 0.0),
                ref_logp=np.minimum(logp + rng.normal(0, 0.1, n), 0.0), entropy=rng.gamma(2.0, 0.5, n), advantage=float(adv[k]),
                mask=rng.random(n) >= masked))
    return out


def write_run(path, steps: dict[int, list[Completion]], ranks: int = 1, micro_batches: int = 2,
              config: dict | None = None, deal=None, max_part_rows: int | None = None):
    """Write ``steps`` as a run; completion i of a step goes to rank ``deal(i) % ranks`` (round
    robin by default), and into that rank's loss calls in order."""
    from grpolens.capture.writer import ShardWriter
    from grpolens.run.format import Manifest

    man = Manifest(run_name="explain-test", world_size=ranks, config=dict(config or CONFIG))
    parts = {} if max_part_rows is None else {"max_part_rows": max_part_rows}
    writers = [ShardWriter(path, rank=r, world_size=ranks, manifest=man if r == 0 else None, **parts)
               for r in range(ranks)]
    for step, comps in sorted(steps.items()):
        mine = [[c for i, c in enumerate(comps) if (deal(i) if deal else i) % ranks == r] for r in range(ranks)]
        for r, w in enumerate(writers):
            cs = mine[r]
            w.add_samples(step, {
                "sample_id": np.array([c.sample_id for c in cs], dtype=np.int64),
                "group_id": np.array([c.group_id for c in cs], dtype=np.int64),
                "completion_len": np.array([len(c.token_id) for c in cs], dtype=np.int32),
                "truncated": np.zeros(len(cs), dtype=bool),
                "reward": np.array([c.reward for c in cs], dtype=np.float64),
            })
            for mb, part in enumerate(np.array_split(np.arange(len(cs)), micro_batches)):
                part = [cs[i] for i in part]
                if not part:
                    continue
                cat = lambda f, dt: np.concatenate([np.asarray(getattr(c, f), dtype=dt) for c in part])  # noqa: E731
                w.add_tokens(step, mb, {
                    "sample_id": np.concatenate([np.full(len(c.token_id), c.sample_id, np.int64) for c in part]),
                    "pos": np.concatenate([np.arange(len(c.token_id), dtype=np.int32) for c in part]),
                    "token_id": cat("token_id", np.int32),
                    "logp": cat("logp", np.float32), "old_logp": cat("old_logp", np.float32),
                    "ref_logp": cat("ref_logp", np.float32), "rollout_logp": cat("rollout_logp", np.float32),
                    "entropy": cat("entropy", np.float32),
                    "advantage": np.concatenate([np.full(len(c.token_id), c.advantage, np.float32) for c in part]),
                    "mask": cat("mask", bool),
                })
            w.end_step(step)
    for w in writers:
        w.close()
    return path
