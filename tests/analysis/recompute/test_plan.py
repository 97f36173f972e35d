"""recompute's decisions (grpolens.analysis.recompute.plan.Decisions): each yes/no is taken once, and
over every combination of the request's switches they keep the promises the docs make: nothing
written without ``write``; ``--only`` keeps away from the cache and the other outputs; the caller's
visitors and on_step keep the work in this process; a what-if or a run on object storage is never
stamped; ``--out s3://`` is staged only when something is written or the run is remote."""

import itertools

import pytest

from grpolens.analysis.recompute.plan import Decisions, Request
from grpolens.metrics.engine import ThreadEngine

SWITCHES = list(itertools.product(
    [True, False],                    # write
    [True, False],                    # incremental
    [None, ["clip"]],                 # only
    [None, [object()]],               # extra_visitors
    [None, "out-dir", "s3://b/out"],  # out
    [None, {"clip_eps": 0.3}],        # overrides
    [True, False],                    # the run is on object storage
))


def _decide(write, incremental, only, extra, out, overrides, remote_run, **kw) -> Decisions:
    req = Request(write=write, incremental=incremental, only=only, extra_visitors=extra, out=out, overrides=overrides, **kw)
    variant = object() if overrides else None  # Variant.of(run, overrides): a what-if
    return Decisions.of(req, remote_run, variant)


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_decisions_keep_the_documented_promises(switches):
    write, incremental, only, extra, out, overrides, remote_run = switches
    d = _decide(*switches)
    written = (d.keeps_step_outputs, d.skips_when_fresh, d.stamps, d.remembers_checks, d.records_variant)
    assert d.writes == write
    if not write:
        assert not any(written)
    assert d.selective == (only is not None)
    if only is not None:  # beside the full outputs, away from the cache
        assert not (d.reuses_rows or d.keeps_step_outputs or d.stamps or d.remembers_checks or d.skips_when_fresh)
    if extra is not None:  # their pieces come back here, and their results are not in the cache
        assert not (d.reuses_rows or d.may_use_workers or d.stamps or d.skips_when_fresh)
    if not incremental:
        assert not (d.reads_state or d.reuses_rows or d.skips_when_fresh or d.stamps or d.remembers_checks)
    if remote_run:
        assert not (d.stamps or d.remembers_checks or d.may_use_workers)
    if overrides:  # a what-if is never stamped as the run's own request
        assert not d.stamps
        assert d.records_variant == (write and only is None and out is None)
    assert d.remote_out == (out == "s3://b/out")
    assert d.stages_remote_out == (d.remote_out and (write or remote_run))
    if d.skips_when_fresh:
        assert d.reuses_rows and d.writes and not d.stages_remote_out
    # the plain request of `grpolens recompute RUN` is the one that is stamped
    plain = write and incremental and only is None and extra is None and not overrides and not remote_run
    assert d.stamps == (plain and out != "s3://b/out")


def test_workers_only_with_the_default_or_thread_engine_and_no_on_step():
    base = dict(write=True, incremental=True, only=None, extra=None, out=None, overrides=None, remote_run=False)
    assert _decide(**base).may_use_workers
    assert _decide(**base, engine=ThreadEngine()).may_use_workers
    assert not _decide(**base, engine=object()).may_use_workers  # e.g. the Ray engine
    assert not _decide(**base, on_step=lambda step, pieces: None).may_use_workers
