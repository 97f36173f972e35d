"""The validate tests' run: a small synthetic run (module-scoped) and a fresh copy of it per test."""

from __future__ import annotations

import shutil

import pytest

from grpolens.adapters.synth import synth_run


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("good") / "run", steps=3, ranks=2, micro_batches=2, groups=2,
                     generations=3, max_len=16, seed=1, texts=True)


@pytest.fixture
def run(good, tmp_path):
    return shutil.copytree(good, tmp_path / "run")
