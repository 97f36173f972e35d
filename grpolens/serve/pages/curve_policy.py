"""The Policy page: only its families' curves (see :mod:`grpolens.serve.pages.curves`), and what
it says when the runs have none."""

EMPTY = "no policy metrics in these runs (do their token shards have old_logp / ref_logp?)"
