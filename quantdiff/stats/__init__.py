"""Activation statistics: per-element tile work, histogram, located top-k and moments composed into `AbsStats`,
per-channel outliers, per-model `ModelStats` and its JSON schema, collection through hooks, torchrun merge."""
