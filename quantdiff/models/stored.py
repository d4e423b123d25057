"""What a model directory stores, read from safetensors headers only (no tensor is read or allocated): exactly
the files transformers' `from_pretrained` will load, and each tensor's dtype and shape in them.

transformers decides which files load (`model.safetensors`, else the shards its index names, or the file
`transformers_weights` in config.json names); `weight_files` asks transformers' own resolver, so every check
here looks at the same files, and a stray unindexed `*.safetensors` beside them can hide nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from quantdiff.core.errors import LoadError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
# Safetensors dtypes a float model's weights may be stored in (cast to the compute dtype on load); an integer,
# boolean or 8-bit float tensor in a model without a quantization_config would be cast and run as numbers.
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


@dataclass(frozen=True)
class StoredTensor:
    dtype: str  # the safetensors header's name: F32, BF16, I32, ...
    shape: tuple[int, ...]
    file: Path
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_config_json(path: Path) -> dict:
    """config.json as a dict; LoadError when it is not a JSON object."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadError(f"cannot read {file}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise LoadError(f"{file} must hold a JSON object, not a {type(config).__name__}")
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files `from_pretrained(path)` loads, as transformers' own resolver names them."""
    from transformers.modeling_utils import _get_resolved_checkpoint_files

    explicit = read_config_json(path).get("transformers_weights")
    try:
        files, _ = _get_resolved_checkpoint_files(
            str(path), variant=None, gguf_file=None, use_safetensors=True, user_agent=None, is_remote_code=False,
            transformers_explicit_filename=explicit if isinstance(explicit, str) else None,
            download_kwargs={"local_files_only": True},
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"no loadable safetensors weights in {path}: {' '.join(str(exc).split())}") from None
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise LoadError(f"{path}: the weight index names {Path(missing[0]).name}, which does not exist")
    return [Path(f) for f in files]


def read_header(file: Path) -> dict[str, StoredTensor]:
    """{name: StoredTensor} from one safetensors header; LoadError when the file is corrupt or truncated."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > min(size - 8, MAX_HEADER_BYTES):  # read nothing absurd into memory
                raise LoadError(f"corrupt safetensors file {file}: its header claims {header_len:,} bytes of a {size:,}-byte file")
            header = json.loads(f.read(header_len))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        tensors = {
            k: StoredTensor(str(v["dtype"]), tuple(int(n) for n in v["shape"]), file, int(v["data_offsets"][1]) - int(v["data_offsets"][0]))
            for k, v in entries.items()
        }
        data_end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise LoadError(f"unreadable safetensors header in {file}: {type(exc).__name__}") from None
    if size < 8 + header_len + data_end:
        raise LoadError(f"truncated safetensors file {file}: {size} bytes, its header needs {8 + header_len + data_end}")
    return tensors


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the files that will be loaded; a name stored in two of them is refused (which one wins
    would depend on the order transformers reads them in)."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, StoredTensor] = {}
    for file in weight_files(path):
        found = read_header(file)
        twice = sorted(set(found) & set(tensors))
        if twice:
            raise LoadError(f"{path}: tensor {twice[0]} is stored in both {tensors[twice[0]].file.name} and {file.name}")
        try:
            with safe_open(str(file), framework="pt"):  # the library's own validation of offsets and dtypes
                pass
        except (SafetensorError, OSError) as exc:
            raise LoadError(f"unreadable safetensors file {file}: {str(exc).splitlines()[0]}") from None
        tensors.update(found)
    return tensors


def check_float_dtypes(tensors: dict[str, StoredTensor], where: Path, tolerated: set[str] = frozenset()) -> None:
    """Refuse integer, boolean or 8-bit-float tensors in an unquantized model: transformers would cast them to
    floats and run them (`tolerated`: stored copies of buffers the model computes itself, such as position ids)."""
    wrong = sorted(name for name, t in tensors.items() if t.dtype not in FLOAT_DTYPES and name not in tolerated)
    if wrong:
        first = tensors[wrong[0]]
        more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
        raise LoadError(
            f"{where} stores {wrong[0]} as {first.dtype}{more}, but the model's weights are floating point "
            f"({', '.join(FLOAT_DTYPES)}) and config.json declares no quantization"
        )


def stored_bytes(tensors: dict[str, StoredTensor]) -> int:
    return sum(t.nbytes for t in tensors.values())
