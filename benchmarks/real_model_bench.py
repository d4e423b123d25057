"""Benchmark of the real-model section of `quantdiff reproduce`: each built-in real model's load and measurement
(`jobs.real_model.measure_target`, with the plan `make reproduce` uses) in one run, and each model's seconds as a
ratio to the first model's, so the section's cost can be read against a known one (SmolLM2's) on a noisy machine.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/real_model_bench.py [--models smollm2,gemma3]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console

from quantdiff.jobs.real_model import DEFAULT_REAL_MODELS, RealModelPlan, measure_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_REAL_MODELS), help="comma-separated built-in names or directories")
    args = parser.parse_args()
    console = Console(stderr=True)
    seconds = {}
    for target in args.models.split(","):
        started = time.perf_counter()
        doc = measure_target(target, "cpu", console, RealModelPlan())
        seconds[target] = time.perf_counter() - started
        windows = doc.get("plan", {}).get("windows", "–")
        print(f"{target}: {seconds[target]:.0f} s load + measure ({doc.get('seconds', '–')} s measure; {windows} lm windows)")
    first = next(iter(seconds))
    for target, value in seconds.items():
        print(f"{target} ÷ {first}: {value / seconds[first]:.2f}×")


if __name__ == "__main__":
    main()
