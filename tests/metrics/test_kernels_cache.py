"""The token families' kernels load from numba's on-disk cache in a fresh process and give the values
they gave when compiled. A cached numba function can fail only there (a recursive one once crashed
this way on loading, while the compiling process was fine), and every recompute after the first
runs from the cache, so the test compiles in one process and reloads in two more."""

from __future__ import annotations

import pytest

from tests.kernel_cache import outputs_over_one_cache

# every kernel-backed producer of the ratio families on one ragged batch with NaN/inf, printed exactly
SCRIPT = """
import numpy as np
from tests.metrics.test_kernels import _batch, _BASE
from grpolens.metrics.partials import PRODUCERS
b = _batch(np.random.default_rng(0), big=0.05)
cfg = {**_BASE, "loss_type": "grpo", "beta": 0.04, "temperature": 1.0, "entropy_coef": 0.01}
out = []
for name in ("health", "entropy", "policy", "kl", "clip", "loss", "twinkle_loss"):
    for k, v in sorted(PRODUCERS[name].fn(b, cfg).items()):
        out.append(k + " " + np.asarray(v, dtype=np.float64).tobytes().hex())
print("\\n".join(out))
"""


@pytest.mark.timeout(300)
def test_kernels_reload_from_the_cache_with_the_same_values(tmp_path):
    out = outputs_over_one_cache(SCRIPT, tmp_path / "cache")
    assert out[0] and out[0] == out[1] == out[2]
