"""Overhead of the post-hoc remedies, measured side by side in one run.

A whole model forward with the linear site fake-quantized (absmax 4-bit weights and inputs) — plain, with the
Hadamard rotation (each linear's input rotated on the fly, weights stored rotated), with SmoothQuant folded into
the norms (no run-time work: the ratio should be 1), and with SmoothQuant unfolded (each linear divides its input)
— as ratios to the plain fake-quantized forward; plus the one-off calibration pass of SmoothQuant (reading and
tokenizing the data, the observed forwards, the folding check) as a ratio to unquantized forwards over as many
tokens.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/remedies_bench.py [--model smollm2] [--batch 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_bench import interleaved  # noqa: E402  (the same interleaved-median timing as the other benchmarks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the contenders (machine noise hits all alike)")
    parser.add_argument("--calibration-tokens", type=int, default=8192, help="as scripts/remedies.py calibrates")
    args = parser.parse_args()

    import quantdiff
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.quant.sites import parse_config, quantized
    from quantdiff.quant.smoothing import Calibration, calibrate
    from quantdiff.quant.transforms import HadamardRotation, Smoothing, calibrated_configs

    device = torch.device(args.device)
    model = quantdiff.load(args.model, device=device)
    tokenizer = load_tokenizer(quantdiff.api._one_model(args.model))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    calibration = Calibration("builtin:corpus-train", tokens=args.calibration_tokens, seq_len=args.seq)
    smooth = calibrated_configs([parse_config("absmax", 4, "linear", transform=Smoothing(calibration))], model, tokenizer)[0]
    configs = {
        "plain": parse_config("absmax", 4, "linear"),
        "hadamard": parse_config("absmax", 4, "linear", transform=HadamardRotation()),
        "smooth (folded)": smooth,
    }
    unfolded = smooth.site.transform.calibrated
    configs["smooth (unfolded)"] = _with_fold(smooth, unfolded, folded=False)

    def forward(config):
        def run():
            with torch.no_grad(), quantized(model, config):
                return model(ids).logits
        return run

    print(f"{args.model}: batch {args.batch} × seq {args.seq}, {device}, absmax 4-bit at site linear (weights + inputs)")
    times = interleaved({name: forward(config) for name, config in configs.items()}, device, args.repeats, args.rounds)
    for name, seconds in times.items():
        print(f"  {name:18s} {seconds * 1e3:9.1f} ms   ratio to plain {seconds / times['plain']:.2f}×")
    start = time.perf_counter()
    calibrate(model, tokenizer, calibration, batch_size=args.batch)
    calibration_s = time.perf_counter() - start
    plain = interleaved({"unquantized": forward(None)}, device, args.repeats, args.rounds)["unquantized"]
    as_many = plain * args.calibration_tokens / (args.batch * args.seq)  # unquantized forwards over the calibration's tokens
    print(f"  calibration pass over {args.calibration_tokens} tokens {calibration_s:.1f} s = {calibration_s / as_many:.2f}× unquantized "
          f"forwards over as many tokens ({as_many:.1f} s)")


def _with_fold(config, calibrated, folded: bool):
    """The same smoothing config with its calibration's fold decision overridden (the unfolded contender)."""
    import dataclasses

    transform = dataclasses.replace(config.site.transform, calibrated=dataclasses.replace(calibrated, folded=folded))
    return dataclasses.replace(config, site=dataclasses.replace(config.site, transform=transform))


if __name__ == "__main__":
    main()
