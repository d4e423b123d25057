"""Models: loading local checkpoints, names (built-in pair, directories), structure, matched pairs, tokenizer, DIFF V2."""

from quantdiff.models import diffv2 as _diffv2  # noqa: F401  registers the "quantdiff_diffv2" model type with the Auto classes
