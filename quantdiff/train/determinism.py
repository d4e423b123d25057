"""Reproducible CPU training: the settings under which a recipe's seed gives the same weights bit for bit on any
x86-64 CPU with AVX2 of the same vendor, whatever its own instruction set and thread count (docs/training.md).

Where the last bits came from (the bb recipe's standard arm; the first differing aten op found by hashing every
op's outputs in two runs):
- ATen compiles its kernels once per instruction set and picks one by CPU capability at run time. The scalar
  (DEFAULT) `normal_` draws other last bits than the AVX2/AVX512 one, so even the initial weights differ; AVX2 and
  AVX512 first differ in SDPA's CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu`) at step 0.
- MKL picks its own code path by CPU: the same flash attention (its blocks are MKL sgemm calls) differs between
  MKL's AVX2 and AVX512 branches.
- Threads split reductions: the lm_head weight gradient (an MKL sgemm summing over the batch's 4096 tokens)
  differs between 1 and 2 threads at step 0, and so do ATen's whole-tensor sums over more than 32768 elements.
- MKL's AVX2 branch (MKL_CBWR=AVX2) exists on Intel CPUs only: on an AMD CPU MKL takes its AUTO branch instead
  (Intel's CNR documentation), so the pinned bb run on an AMD EPYC follows another trajectory than on the Intel
  machine of the committed 60-step reference (equal losses to step 21). MKL_CBWR=COMPATIBLE (SSE2 on both) would
  join them, at about 2.1x the bb training time (benchmarks/determinism_bench.py on the AMD EPYC); not adopted, not verified on Intel.
oneDNN (torch.backends.mkldnn) and torch.use_deterministic_algorithms change no bit of this training on CPU.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

# Read once, when ATen and MKL first compute: they must be in the environment before torch is imported.
# AVX2, not DEFAULT: every x86-64 CPU since about 2015 has it, and the scalar kernels train ~2.5x slower.
ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
CPU_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports when the pin took effect
THREADS = 1  # one thread: no reduction is split by the machine's core count


def cpu_vendor() -> str:
    """The CPU's vendor (`GenuineIntel`, `AuthenticAMD`, …) as Linux reports it, else 'unknown': MKL's code path,
    and so the last bits, follow it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), "unknown")
    except OSError:
        return "unknown"


def pin_environment() -> list[str]:
    """Put ENVIRONMENT in os.environ (overriding the user's values) while this process has not imported torch: the
    kernels it and its children will use. A process that already imported torch (the Python API, tests) keeps its
    kernels, and its environment is left alone: otherwise only the processes it starts later would change kernels
    (`pinned_children` pins the workers that training starts). Returns a note per value of the user's replaced,
    which the command prints: a setting is never changed without saying so."""
    if "torch" in sys.modules:
        return []
    notes = [f"sets {name}={value} (it was {os.environ[name]})" for name, value in ENVIRONMENT.items() if os.environ.get(name, value) != value]
    os.environ.update(ENVIRONMENT)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and threads != str(THREADS):
        notes.append(f"trains on {THREADS} thread(s), not OMP_NUM_THREADS={threads}")
    return [f"note: this run {note}, for bit-identical training" for note in notes]


@contextmanager
def pinned_children() -> Iterator[None]:
    """ENVIRONMENT in os.environ for the block — the processes started in it import torch under the pinned
    kernels — and the caller's values restored after."""
    previous = {name: os.environ.get(name) for name in ENVIRONMENT}
    os.environ.update(ENVIRONMENT)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def settings() -> dict:
    """What this process computes with, and whether it is the pinned setting: recorded in every train log."""
    import torch

    current = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),  # MKL reads it at its first call; torch offers no way to ask MKL
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_vendor": cpu_vendor(),
    }
    pinned = current["cpu_capability"] == CPU_CAPABILITY and current["mkl_cbwr"] == ENVIRONMENT["MKL_CBWR"] and current["threads"] == THREADS
    return current | {"pinned": pinned}


def describe(current: dict) -> str:
    """One console line saying whether this run reproduces on other machines."""
    line = f"kernels {current['cpu_capability']}, MKL_CBWR={current['mkl_cbwr']}, {current['threads']} thread(s), {current['cpu_vendor']}"
    if current["pinned"]:
        return line + f": pinned, bit-reproducible on any {current['cpu_vendor']} x86-64 CPU with AVX2 (MKL's path follows the vendor)"
    return (line + f": NOT the pinned setting (ATEN_CPU_CAPABILITY={ENVIRONMENT['ATEN_CPU_CAPABILITY']}, "
            f"MKL_CBWR={ENVIRONMENT['MKL_CBWR']} before torch is imported: `quantdiff train` sets them), so these "
            "weights reproduce only on this CPU type")


@contextmanager
def pinned_threads() -> Iterator[None]:
    """THREADS torch threads for the block, the caller's count restored after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
