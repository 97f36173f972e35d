"""Ways in from elsewhere: importers of other tools' logs and the synthetic-run generator."""
