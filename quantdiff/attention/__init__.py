"""The quantdiff attention backend: explicit tiled logits through a Tap, and observation hooks."""
