"""quantdiff: where are a model's activation outliers, and how many bits does it survive?

The public Python API (imported on first use, so `import quantdiff` stays light):

    model = quantdiff.load("tiny/diff")                     # a built-in name, a local directory or an export
    config = quantdiff.parse_config("absmax", 4, "logits")  # or the config types in quantdiff.quant.sites
    with quantdiff.quantized(model, config):                # applied inside attention, removed on exit
        ...
    stats = quantdiff.collect_stats(model, input_ids)       # the statistics object `quantdiff stats` writes
    quantdiff.export_quantized("tiny/diff", "out", quantdiff.parse_export("absmax", 4))
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "load": "quantdiff.api",
    "load_tokenizer": "quantdiff.api",
    "collect_stats": "quantdiff.api",
    "export_quantized": "quantdiff.api",
    "parse_config": "quantdiff.api",
    "damage": "quantdiff.api",
    "quantized": "quantdiff.api",
    "apply_quantization": "quantdiff.api",
    "kv_cache": "quantdiff.api",
    "QuantConfig": "quantdiff.quant.sites",
    "AbsmaxMethod": "quantdiff.quant.sites",
    "LLMInt8Method": "quantdiff.quant.sites",
    "LogitsSite": "quantdiff.quant.sites",
    "QKSite": "quantdiff.quant.sites",
    "LinearSite": "quantdiff.quant.sites",
    "KVSite": "quantdiff.quant.sites",
    "HadamardRotation": "quantdiff.quant.transforms",
    "Smoothing": "quantdiff.quant.transforms",
    "Calibration": "quantdiff.quant.smoothing",
    "calibrated_configs": "quantdiff.api",
    "parse_export": "quantdiff.api",
    "ModelStats": "quantdiff.stats.model_stats",
    "PrecisionPlan": "quantdiff.quant.precision_plan",
    "load_plan": "quantdiff.quant.precision_plan",
    "save_plan": "quantdiff.quant.precision_plan",
    "QuantdiffError": "quantdiff.core.errors",
}

__all__ = ["__version__", *_API]

# once per process: a warning (never a refusal) when torch or transformers is newer than the newest release tested
from quantdiff.core.versions import warn_if_untested  # noqa: E402

warn_if_untested()
del warn_if_untested


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'quantdiff' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
