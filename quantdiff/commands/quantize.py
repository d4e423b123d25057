"""`quantdiff quantize MODEL --bits B --method M --out DIR`: a quantized checkpoint that reloads exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def quantize(
    model: Annotated[str, typer.Argument(help="Model directory or built-in name (e.g. tiny/diff).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output model directory (written atomically).")],
    bits: Annotated[str, typer.Option("--bits", help="absmax: 2–8 or 16; llm-int8: 8; nf4/fp4: 4.")] = "4",
    method: Annotated[str, typer.Option("--method", help="absmax (packed, ours), llm-int8, nf4 or fp4 (bitsandbytes layouts).")] = "absmax",
    threshold: Annotated[float, typer.Option("--threshold", help="llm-int8 outlier threshold, applied to activations at run time.")] = 6.0,
    include_lm_head: Annotated[bool, typer.Option("--include-lm-head", help="Quantize lm_head too (default: decoder-layer linears only).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing non-empty --out.")] = False,
) -> None:
    """Quantize the linear weights inside the decoder layers and write a complete model directory."""
    from rich.console import Console

    from ..errors import LoadError
    from ..export import export_quantized, parse_export
    from ..savedir import check_target
    from ..zoo import resolve

    fmt = parse_export(method, bits, threshold)  # every argument is checked before anything is loaded or written
    check_target(out, force)
    sources = resolve(model)
    if len(sources) != 1:
        raise LoadError(f"{model!r} names {len(sources)} models; quantize one at a time (e.g. {model}/diff)")
    summary = export_quantized(sources[0], out, fmt, include_lm_head=include_lm_head, force=force)
    console = Console(highlight=False)
    d = summary.description
    console.print(f"[bold]{summary.out}[/bold]: {d['method']} {d['bits']}-bit, {d['granularity']}")
    console.print(
        f"size {summary.out_bytes / 1e6:.2f} MB vs {summary.source_bytes / 1e6:.2f} MB source ({summary.size_ratio:.2f}×); "
        f"quantized weights {summary.quantized_bytes / summary.quantized_bf16_bytes:.2f}× their bf16 size"
    )
    console.print(f"modules quantized: {len(summary.modules)}; skipped (kept in {d['dtype']}): {', '.join(summary.skipped) or 'none'}")
