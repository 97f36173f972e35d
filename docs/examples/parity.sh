# The bundled run was recorded from real TRL training; TRL's own log is beside it.
grpolens parity sample_runs/trl-tiny
