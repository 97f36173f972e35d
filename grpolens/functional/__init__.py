"""Pure maths on arrays, with no knowledge of runs, registries or trainers."""
