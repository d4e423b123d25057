"""A GGUF file's structure checked once, at the door (models.gguf_header), before gguf's reader or transformers
touches it: tensor infos, types, dimensions, offsets, alignment and the data section. Each malformed file is
crafted from a good one by patching its bytes at positions found independently (the tensor's name in the file),
and each is refused by `info` as one `error:` line naming the file as the user gave it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import quantdiff
from quantdiff.cli.app import main
from tests.test_gguf import TINY_LLAMA, _tiny_llama_gguf

LAST = list(TINY_LLAMA)[-1]  # the writer keeps insertion order: the last tensor info and the last data
FIRST = list(TINY_LLAMA)[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _info_at(data: bytes, name: str) -> int:
    """Where tensor `name`'s dimension count lies: just after its length-prefixed name (found in the bytes)."""
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return at + 8 + len(encoded)


def _patched(data: bytes, name: str, field: str, value: int) -> bytes:
    """`data` with tensor `name`'s dimension count, first dimension, type or offset set to `value`."""
    at = _info_at(data, name)
    dims = struct.unpack_from("<I", data, at)[0]
    where, fmt = {"dims": (at, "<I"), "first": (at + 4, "<Q"), "type": (at + 4 + 8 * dims, "<I"),
                  "offset": (at + 4 + 8 * dims + 4, "<Q")}[field]
    return data[:where] + struct.pack(fmt, value) + data[where + struct.calcsize(fmt):]


def _offset(data: bytes, name: str) -> int:
    at = _info_at(data, name)
    dims = struct.unpack_from("<I", data, at)[0]
    return struct.unpack_from("<Q", data, at + 4 + 8 * dims + 4)[0]


def _counts(data: bytes, tensors: int = 0, keys: int = 0) -> bytes:
    """`data` with its tensor and key counts (bytes 8-23) moved by `tensors` and `keys`."""
    count, key_count = struct.unpack_from("<QQ", data, 8)
    return data[:8] + struct.pack("<QQ", count + tensors, key_count + keys) + data[24:]


MALFORMED = {  # id: (bytes of the good file -> bad bytes, words of the refusal)
    "tensor-count-minus-1": (lambda d: _counts(d, tensors=-1), "tensor count"),
    "tensor-count-plus-1": (lambda d: _counts(d, tensors=+1), "unreadable GGUF file"),
    "key-count-minus-1": (lambda d: _counts(d, keys=-1), "unreadable GGUF file"),
    "key-count-plus-1": (lambda d: _counts(d, keys=+1), "unreadable GGUF file"),
    "offset-moved-3": (lambda d: _patched(d, LAST, "offset", _offset(d, LAST) + 3), f"tensor {LAST} lies at data offset"),
    "offset-moved-4": (lambda d: _patched(d, FIRST, "offset", 4), f"tensor {FIRST} lies at data offset 4"),
    "offsets-overlap": (lambda d: _patched(d, LAST, "offset", 0), f"tensor {LAST} lies at data offset 0"),
    "data-cut-short": (lambda d: d[:-64], f"tensor {LAST} ends"),
    "trailing-bytes": (lambda d: d + bytes(4096), "bytes after its last tensor"),
    "five-dimensions": (lambda d: _patched(d, FIRST, "dims", 5), f"tensor {FIRST} has 5 dimensions"),
    "huge-dimension": (lambda d: _patched(d, FIRST, "first", 2**63), f"tensor {FIRST} of shape"),
    "zero-dimension": (lambda d: _patched(d, FIRST, "first", 0), f"tensor {FIRST} has a dimension of 0"),
    "unknown-type": (lambda d: _patched(d, FIRST, "type", 999), f"tensor {FIRST} has an unknown type 999"),
    "rows-not-whole-blocks": (lambda d: _patched(d, FIRST, "type", 2), f"tensor {FIRST}'s rows of 8 are not whole blocks of 32"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_gguf_is_one_line_naming_the_users_file(tmp_path, cache, capsys, name):
    """On 505bb40 the offset moved by 4 loaded shifted weights and `info` exited 0; the counts ±1 ended in
    "IndexError: index 0 is out of bounds"; hostile dimensions and types in numpy's or gguf's wording."""
    make, words = MALFORMED[name]
    good = tmp_path / "good.gguf"
    _tiny_llama_gguf(good)
    file = tmp_path / "model.gguf"
    file.write_bytes(make(good.read_bytes()))
    with pytest.raises(SystemExit) as exit_info:
        main(["info", str(file)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and err.startswith("error:"), err
    assert words in err and str(file) in err and str(cache) not in err, err
    assert "Error" not in err, err  # no exception class names (IndexError, ValueError) from inside gguf or numpy


def test_the_python_api_refuses_it_naming_the_users_file(tmp_path, cache):
    """The offset moved by 4 bytes loaded on 505bb40, every weight of the first tensor shifted by one."""
    good = tmp_path / "good.gguf"
    _tiny_llama_gguf(good)
    file = tmp_path / "model.gguf"
    file.write_bytes(MALFORMED["offset-moved-4"][0](good.read_bytes()))
    with pytest.raises(quantdiff.QuantdiffError, match="lies at data offset 4") as raised:
        quantdiff.load(file, device="cpu")
    assert str(file) in str(raised.value) and str(cache) not in str(raised.value) and "\n" not in str(raised.value)


def test_the_good_file_and_the_real_models_pass_the_door(tmp_path):
    """The check refuses no well-formed file: the tiny one the tests patch, and both real models (Q4_1, Q4_K_M)."""
    from quantdiff.models.gguf_header import check_gguf_structure
    from quantdiff.models.wheels import wheel_file

    _tiny_llama_gguf(tmp_path / "good.gguf")
    for path in (tmp_path / "good.gguf", Path(wheel_file("smollm2")), Path(wheel_file("gemma3"))):
        check_gguf_structure(path)
