"""Activation statistics: mergeable exact top-k and histogram engine, collection through hooks, distributed merge."""
