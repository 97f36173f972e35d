"""The dashboard's data layer: everything the pages show, computed server-side with polars.

Each function takes run *directories* (already checked against the allow-list by the caller, see
:mod:`grpolens.serve.runs`) and returns small frames or numpy arrays. Nothing here returns raw
token tables to the browser: curves are per step and downsampled, token views cover one step
(the top-K table) or one completion. Results are memoised per run and step, keyed by a
fingerprint of the files they were read from, so a growing run (``--watch``) is re-read only
where it changed.

One module per kind of view (:mod:`~grpolens.serve.data.curves`, :mod:`~grpolens.serve.data.tokens`,
:mod:`~grpolens.serve.data.completions`, :mod:`~grpolens.serve.data.mismatch`,
:mod:`~grpolens.serve.data.verdicts`) over one cache (:mod:`~grpolens.serve.data.memo`); the
pages use them through this package.
"""

from __future__ import annotations

from grpolens.serve.data.memo import (  # noqa: F401
    Memo, clear_caches, run_version,
)
from grpolens.serve.data.curves import (  # noqa: F401
    CURVE_POINTS, QUANTILES, SAMPLES_PREFIX, compare, curve, delta_curve, downsample_minmax,
    ema, family_metrics, metric_docs, metric_families, metrics_path, overview_metrics,
    overview_slots, page_families, read_metrics, samples_summary, series, step_bounds,
)
from grpolens.serve.data.tokens import (  # noqa: F401
    COLOR_BY, DIVERGING, RANK_BY, SCORES, TOP_COLUMNS, step_samples, step_tokens, top_tokens,
    top_tokens_file,
)
from grpolens.serve.data.completions import (  # noqa: F401
    COMPLETION_COLUMNS, PREVIEW_CHARS, completion, completions_file, completions_page, decoder,
    parse_filter_query, score_scale, sequence_table,
)
from grpolens.serve.data.mismatch import (  # noqa: F401
    IS_LOG10_EDGES, IS_STEP_METRICS, is_heatmap, is_hist_file, is_hist_table, is_step_detail,
)
from grpolens.serve.data.verdicts import (  # noqa: F401
    check_verdicts,
)
