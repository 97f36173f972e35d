"""The keys of a recompute's per-step cache: shard fingerprints, the config hash, the outputs key."""

from __future__ import annotations

import hashlib
import json

from grpolens.metrics.registry import REGISTRY
from grpolens.run import format as fmt

CACHE_VERSION = 2  # 2: rows of a profile with a log schedule carry appended-value counts


def _fingerprint(shards: list[fmt.Shard]) -> list:
    return [sh.fingerprint() for sh in shards]



def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _config_hash(cfg: dict, profile: str) -> str:
    blob = json.dumps({"cfg": cfg, "profile": profile, "cache": CACHE_VERSION, "metrics": sorted(REGISTRY)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
