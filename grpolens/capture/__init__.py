"""Capture: what training ranks run. The torch hook and the numpy/pyarrow shard writer."""
