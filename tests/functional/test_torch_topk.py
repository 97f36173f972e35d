"""grpolens.functional.torch_topk against torch.topk itself (torch's CPU kernel is the reference):
which tied elements it keeps, on both of its paths (partial sort when k·64 <= n, else nth_element),
and the doubt it reports when values are known only to within an error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpolens.functional.torch_topk import topk_indices


def torch_choice(x: np.ndarray, k: int) -> set[int]:
    return set(torch.topk(torch.tensor(x), k, largest=True).indices.tolist())


@pytest.mark.parametrize("seed", range(6))
def test_ties_are_broken_as_torch_breaks_them(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(1, 300)) if rng.random() < 0.8 else int(rng.integers(300, 4000))
        x = (rng.integers(0, int(rng.integers(1, 8)), n) * 0.37).astype(np.float32)  # few levels: many ties
        if rng.random() < 0.5:  # ties among distinct values
            x = np.where(rng.random(n) < 0.5, x, rng.normal(size=n).astype(np.float32))
        k = int(rng.integers(1, n + 1)) if rng.random() < 0.5 else max(1, int(n * rng.choice([0.0002, 0.01, 0.1])))
        got, sure = topk_indices(x, k)
        assert sure and set(got.tolist()) == torch_choice(x, k), (n, k)


@pytest.mark.parametrize("n, k", [(1, 1), (2, 1), (3, 1), (4, 2), (64, 1), (65, 1), (128, 2), (129, 2), (1000, 1),
                                  (1000, 999), (5, 5)])
def test_all_equal_values_at_the_path_boundaries(n, k):
    # every element tied: the choice is the replay alone (k·64 <= n: heap select; else introselect)
    x = np.zeros(n, dtype=np.float32)
    got, sure = topk_indices(x, k)
    assert sure and set(got.tolist()) == torch_choice(x, k) and len(got) == min(k, n)


def test_organ_pipe_of_ties():
    # runs of equal values rising then falling: partitions around a pivot equal to many elements
    for n in (50, 97, 200, 513):
        x = np.minimum(np.arange(n), np.arange(n)[::-1]).astype(np.float32) // 3
        for k in (1, 2, n // 3, n // 2, n - 1):
            assert set(topk_indices(x, k)[0].tolist()) == torch_choice(x, k), (n, k)


def test_no_tie_is_the_k_largest_and_empty_inputs():
    x = np.array([0.5, 3.0, -1.0, 2.0])
    assert topk_indices(x, 2)[0].tolist() == [1, 3]
    assert topk_indices(np.zeros(0), 3)[0].tolist() == []
    assert topk_indices(x, 0)[0].tolist() == []


def test_doubt_when_values_known_only_within_an_error():
    x = np.array([1.0, 0.9999999, 0.2])
    err = np.full(3, 1e-6)
    same = np.array([0, 1, 2])
    # 1.0 and 0.9999999 could be in the other order: the pick of one is not sure
    assert topk_indices(x, 1, err, same) == (np.array([0]), False) or not topk_indices(x, 1, err, same)[1]
    # both kept: sure whatever their order
    assert topk_indices(x, 2, err, same)[1]
    # an exact tie of the same inputs is never in doubt: torch's values are equal too
    y = np.array([0.5, 0.5, 0.1])
    assert topk_indices(y, 1, err, np.array([0, 0, 1]))[1]
    # the same tie from different inputs is: verl's values may differ in the last bits
    assert not topk_indices(y, 1, err, np.array([0, 1, 2]))[1]
    # no error: sure
    assert topk_indices(y, 1, np.zeros(3), np.array([0, 1, 2]))[1]
