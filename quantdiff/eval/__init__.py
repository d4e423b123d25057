"""Evaluation: tasks, log-likelihood scoring, the quantization sweep, and the lm-evaluation-harness adapter."""
