"""Dense code packing (quantdiff/quant/packing.py, what `quantize --method absmax` writes and reads back),
against the bit-stream implementation it replaced, measured side by side in one run.

The old implementation is read from git (commit e4b1ca6, the last one that had it), so the comparison
regenerates from the repository. Both must give the same bytes; the ratio is old time / new time for a pack
and an unpack of the same codes (medians of the repeats).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/packing_bench.py [--codes 4000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quantdiff.quant import packing

OLD_COMMIT = "e4b1ca6"


def old_packing():
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:quantdiff/quant/packing.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / "old_packing.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_packing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seconds(module, codes: torch.Tensor, bits: int) -> float:
    started = time.perf_counter()
    module.unpack_codes(module.pack_codes(codes, bits), bits, codes.shape)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codes", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    old = old_packing()
    print(f"{args.codes:,} codes, {torch.get_num_threads()} thread(s); ratio = old / new (pack + unpack)")
    print("| bits | old s | new s | ratio |\n|---|---|---|---|")
    for bits in (2, 3, 4, 5, 6, 8, 12, 16):
        q = 2 ** (bits - 1) - 1
        codes = torch.randint(-q, q + 1, (args.codes,), generator=torch.Generator().manual_seed(bits))
        if not torch.equal(old.pack_codes(codes, bits), packing.pack_codes(codes, bits)):
            sys.exit(f"{bits} bits: the two implementations write different bytes")
        timings = {"old": [], "new": []}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            timings["old"].append(seconds(old, codes, bits))
            timings["new"].append(seconds(packing, codes, bits))
        o, n = (statistics.median(timings[k]) for k in ("old", "new"))
        print(f"| {bits} | {o:.3f} | {n:.3f} | {o / n:.1f}× |")


if __name__ == "__main__":
    main()
