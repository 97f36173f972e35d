"""``grpolens check`` verdicts drawn over the curves."""

from __future__ import annotations

from pathlib import Path

from grpolens.serve.data.curves import read_metrics
from grpolens.serve.data.memo import _RUN_MEMO, run_key, run_version


def check_verdicts(run: Path, baseline: Path | None = None) -> list[dict]:
    """Failed ``grpolens check`` rules (the built-in defaults, against ``baseline`` when given)
    as ``{metric, step, status, message}``, to mark on the curves. Evaluated on the metrics
    already read (no recompute); empty when the check module cannot judge them."""
    def make() -> list[dict]:
        try:
            from grpolens.check.baseline import no_data_steps, run_series
            from grpolens.check.rules import default_rules
            from grpolens.check.evaluate import ERROR, FAIL, NO_DATA, evaluate

            df = read_metrics(run)
            cand, empty = run_series(df), no_data_steps(df)
            base = run_series(read_metrics(baseline)) if baseline is not None else None
            outs = []
            for rule in default_rules().rules:
                got = evaluate(rule, cand, base, empty, df["step"].to_list())
                outs += got if isinstance(got, list) else [got]
        except Exception:  # noqa: BLE001 - verdicts are an overlay; never break a page for them
            return []
        return [{"metric": o.metric, "step": o.step, "status": o.status, "message": o.message}
                for o in outs if o.status in (FAIL, NO_DATA, ERROR)]

    bkey = None if baseline is None else (run_key(baseline), run_version(baseline))
    return _RUN_MEMO.get(("verdicts", run_key(run), run_version(run), bkey), make)
