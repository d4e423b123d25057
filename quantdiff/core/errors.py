"""One error family, so the CLI can turn every expected failure into a one-line message."""


class QuantdiffError(Exception):
    """Base class: anything raised on purpose because of bad input or a missing resource."""


class LoadError(QuantdiffError):
    """A model directory could not be loaded (missing, malformed, pickled, unsupported)."""


class ConfigError(QuantdiffError):
    """A recipe, quantization setting or CLI option is invalid."""


class DataError(QuantdiffError):
    """Input data is missing, empty, malformed or does not fit the model."""


class DiskFullError(QuantdiffError):
    """An output could not be written because its file system is full (nothing partial is left)."""
