"""Check a run against the format contract and report every problem at once.

:func:`validate_run` streams the run one Parquet file at a time, reading only the columns a check
needs, in record batches, so its memory is bounded by one batch plus one integer per completion
(the set of sample ids, for the tokens→samples join). Problems are *errors* (the run breaks the
contract; analysis may be wrong or fail) or *warnings* (suspicious but analysable: non-finite
log-probs, token rows without a samples row, leftover temporary files).

Every other command reads a run only after :func:`check_before_reading`, which applies the same
checks with the same messages at the cost of the Parquet footers: the manifest, the layout, each
file's schema, and the row-group statistics (nulls, negative keys, step/rank against the path,
positive log-probs, micro-batch ranges of part files). A file whose statistics are suspicious or
absent gets the full row checks of ``grpolens validate``. What statistics cannot show -- the order
and uniqueness of the keys within a tokens shard, and invalid UTF-8 in text -- is checked by the
readers on the columns they hold in memory (:func:`key_order_problems`, :mod:`grpolens.run.text_columns`),
with these same messages.
"""

from __future__ import annotations

# A package since it outgrew one module (#29): every name is re-exported here, so callers
# import from ``grpolens.run.validate`` as before.
from grpolens.run.validate.checks import (  # noqa: F401
    ERROR,
    WARNING,
    _TMP_RE,
    _FLOAT_TOKEN_COLUMNS,
    _LOGP_COLUMNS,
    POSITIVE_LOGP_TOLERANCE,
    _ORDER,
    _TEXT_COLUMNS,
    positive_logp_message,
    NON_NEGATIVE,
    NEGATIVE_MESSAGE,
    too_long_message,
    _count_below,
    _count_above,
    rejected_in_loss_message,
    _count_rejected_in_loss,
    refuse_bad_values,
    unsorted_message,
    duplicates_message,
    key_order_problems,
    _adjacent_order,
    _sorted_duplicates,
    Problem,
    Report,
    _same_type,
    _ints,
    _non_null,
    _NonFinite,
    _count_duplicates,
    _count_positive,
)
from grpolens.run.validate.validator import (  # noqa: F401
    _BATCH_ROWS,
    validate_run,
    _Validator,
)
from grpolens.run.validate.footer import (  # noqa: F401
    check_before_reading,
    _CheckMemo,
    _stat,
    _FooterValidator,
    _span_set,
    _column_stats,
    _path_and_nulls_suspicious,
    _tokens_suspicious,
    _samples_suspicious,
)
