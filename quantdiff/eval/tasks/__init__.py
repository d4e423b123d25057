"""Evaluation tasks and the synthetic documents they are built from (one file per task)."""
