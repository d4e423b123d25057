"""Whole jobs the CLI runs (stats, reproduce, evaluation across models): planning, validation, outputs."""
