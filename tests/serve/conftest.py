"""Two small synthetic runs with texts (some completions contain ``<script>``), metrics recomputed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def serve_runs(tmp_path_factory):
    import grpolens
    from grpolens.adapters.synth import synth_run

    root = tmp_path_factory.mktemp("serve-runs")
    common = dict(steps=14, ranks=2, micro_batches=2, groups=4, generations=4, max_len=40, texts=True)
    alpha = synth_run(root / "alpha", seed=0, inject=["kl-spike@9"], **common)
    beta = synth_run(root / "beta", seed=1, inject=["rollout-drift@7"], **common)
    for run in (alpha, beta):
        grpolens.recompute(run, write=True)
    return root, alpha, beta


@pytest.fixture(scope="session")
def runset(serve_runs):
    from grpolens.serve.runs import resolve_runs

    root, _, _ = serve_runs
    return resolve_runs([root])
