"""Models: loading local checkpoints, names (built-in pair, directories), structure, matched pairs, tokenizer, and
quantdiff's own kinds (DIFF V2, gated, sink), registered with transformers' Auto classes on import."""

from quantdiff.models import diffv2 as _diffv2  # noqa: F401  registers the "quantdiff_diffv2" model type with the Auto classes
from quantdiff.models import gated as _gated  # noqa: F401  "quantdiff_gated"
from quantdiff.models import sink as _sink  # noqa: F401  "quantdiff_sink"
