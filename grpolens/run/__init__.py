"""The run on disk: its format (manifest, shards, atomic writes), its validation, token decoding."""
