"""`quantdiff quantize MODEL --bits B --method M --out DIR`: a quantized checkpoint that reloads exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.options import JsonOpt, QuietOpt, RevisionOpt
from quantdiff.cli.transform_options import CalibrationOpt, CalibrationTokensOpt, RotateOpt, SmoothOpt


def quantize(
    model: Annotated[str, typer.Argument(help="Model directory, GGUF file (dequantized first), built-in name (tiny/diff, smollm2, gemma3) or hub id (org/name).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output model directory, or FILE.gguf with --format gguf (written atomically).")],
    bits: Annotated[Optional[str], typer.Option("--bits", help="Default 4. absmax: 2–8 or 16; llm-int8: 8; nf4/fp4: 4; compressed-tensors: 4 (W4A16) or 8 (W8A8); gguf: 8 (Q8_0), 4 (Q4_0) or 16 (unquantized: the source's own F32/F16/BF16, the reference). With --plan: lm_head's width (--include-lm-head); default the plan's widest.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="absmax (packed, ours; the default), llm-int8, nf4 or fp4 (bitsandbytes layouts): for --format quantdiff.")] = None,
    export_format: Annotated[str, typer.Option("--format", help="quantdiff (a model directory, --method's layout), compressed-tensors (a model directory vLLM and transformers load; our absmax weights) or gguf (one file for llama.cpp: Q8_0 / Q4_0, or unquantized; Llama, Qwen2, Qwen3).")] = "quantdiff",
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="absmax: one scale per group of G inputs of each output channel (e.g. 32, 64, 128; a width G does not divide ends in a shorter group). Default: one per output channel.")] = None,
    threshold: Annotated[Optional[float], typer.Option("--threshold", help="llm-int8 outlier threshold, applied to activations at run time (default: the LLM.int8 paper's 6.0).")] = None,
    include_lm_head: Annotated[bool, typer.Option("--include-lm-head", help="Quantize lm_head too (default: decoder-layer linears only).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing non-empty --out.")] = False,
    attention_bits: Annotated[Optional[str], typer.Option("--attention-bits", help="Also record an attention quantization (2–16 bits); quantdiff re-applies it on load (--format quantdiff only: other formats' loaders would not).")] = None,
    attention_method: Annotated[Optional[str], typer.Option("--attention-method", help="absmax (default) or llm-int8 (with --attention-bits).")] = None,
    attention_site: Annotated[Optional[str], typer.Option("--attention-site", help="logits (default), qk or kv (with --attention-bits).")] = None,
    attention_granularity: Annotated[Optional[str], typer.Option("--attention-granularity", help="row (default, causal: per token, query row, or token and KV head) or tensor (NON-CAUSAL: one scale per sequence, the former default), with --attention-bits.")] = None,
    plan: Annotated[Optional[Path], typer.Option("--plan", help="A mixed-precision plan (`quantdiff sensitivity --plan-budget --out`, site linear, absmax): each decoder layer's linear weights at the plan's width for it; --format quantdiff (absmax), compressed-tensors (4 and 8) or gguf (4, 8, 16).")] = None,
    rotate: RotateOpt = None,
    smooth: SmoothOpt = None,
    calibration: CalibrationOpt = None,
    calibration_tokens: CalibrationTokensOpt = None,
    eval_task: Annotated[Optional[str], typer.Option("--eval", help="Also evaluate source and reloaded export on this task (choice, lm, retrieval).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Data file for --eval (see `quantdiff eval --help`).")] = None,
    context: Annotated[Optional[int], typer.Option("--context", help="Tokens per window (lm) or document (retrieval) for --eval.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="--eval on the first N items only.")] = None,
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Accept decoder layers without an nn.Linear to quantize.")] = False,
    revision: RevisionOpt = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run the model's own Python code and keep it (*.py, auto_map) in the export, which records this; off by default: the export carries no code.")] = False,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Save a quantized copy of a model that loads back exactly (quantdiff, bitsandbytes, compressed-tensors, GGUF).

    The linear weights inside the decoder layers are quantized and written as a complete model directory (with
    --format gguf, one GGUF file); with --eval, the source and the reloaded export are scored side by side."""
    from quantdiff.cli.output import check_json, result_console, write_result
    from quantdiff.cli.task_options import check_limit, make_cli_task
    from quantdiff.cli.transform_options import calibration_file, make_transform
    from quantdiff.cli.validate import check_positive, refuse_unused
    from quantdiff.core.errors import ConfigError, LoadError
    from quantdiff.core.savedir import check_target
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.models.names import resolve
    from quantdiff.quant.export import export_quantized
    from quantdiff.quant.gguf_export import export_gguf
    from quantdiff.quant.formats import AbsmaxExport, check_attention_recordable, parse_export
    from quantdiff.quant.numerics import LLM_INT8_THRESHOLD
    from quantdiff.quant.registry import ATTENTION_SITE_NAMES, DEFAULT_GRANULARITY
    from quantdiff.quant.sites import parse_config
    from quantdiff.quant.transforms import check_exportable

    # Every argument is checked before anything is loaded or written; an option the mode ignores is an error.
    gguf = export_format == "gguf"
    if gguf:
        refuse_unused("with --format gguf (llama.cpp runs no model code)", trust_remote_code=trust_remote_code)
    method = method or "absmax"
    if method != "llm-int8":
        refuse_unused(f"with --method {method} (it is the llm-int8 outlier threshold)", threshold=threshold)
    if method != "absmax":
        refuse_unused(f"with --method {method} (group-wise scales are an absmax option)", group_size=group_size)
    check_positive(threshold=threshold, group_size=group_size)  # also refuses nan and inf: an export with them would never load
    layer_bits = None
    if plan is not None:
        if export_format == "quantdiff" and method != "absmax":
            raise ConfigError(f"--plan writes a width per layer: --method {method} stores one width for every layer; use --method absmax")
        layer_bits, bits = _plan_widths(plan, bits)
    fmt = parse_export(method, bits or "4", LLM_INT8_THRESHOLD if threshold is None else threshold, group_size, export_format)
    attention = None
    if attention_bits is None:
        refuse_unused("without --attention-bits", attention_method=attention_method, attention_site=attention_site, attention_granularity=attention_granularity)
    else:
        if (attention_site or "logits") not in ATTENTION_SITE_NAMES:
            raise ConfigError(f"--attention-site must be {' or '.join(ATTENTION_SITE_NAMES)}, got {attention_site!r}")
        check_attention_recordable(fmt)
        attention = parse_config(attention_method or "absmax", attention_bits, attention_site or "logits", attention_granularity or DEFAULT_GRANULARITY)
    if eval_task is None:
        refuse_unused("without --eval", data=data, context=context, limit=limit)
    transform = make_transform(rotate, smooth, calibration, calibration_tokens, eval_task, data)
    check_exportable(transform, isinstance(fmt, AbsmaxExport))  # before anything loads
    check_limit(limit)
    sources = resolve(model, revision)
    if len(sources) != 1:
        raise LoadError(f"{model!r} names {len(sources)} models; quantize one at a time (e.g. {model}/diff)")
    inputs = model_inputs([model], sources) + ([data] if data else []) + calibration_file(transform)
    if not gguf:  # a GGUF file's target is checked by export_gguf
        check_target(out, force, inputs, flag="--out", kind="export")
    check_json(json_path, inputs, force, [("--out", out)])
    task = make_cli_task(eval_task, batch_size=8, data=data, context=context) if eval_task is not None else None
    tokenizer = load_tokenizer(sources[0]) if task is not None else None
    if gguf:
        summary = export_gguf(model, out, fmt, include_lm_head=include_lm_head, force=force, allow_partial=allow_partial, revision=revision,
                              transform=transform, layer_bits=layer_bits)
    else:
        summary = export_quantized(
            sources[0], out, fmt, include_lm_head=include_lm_head, force=force, attention=attention, allow_partial=allow_partial,
            trust_remote_code=trust_remote_code, transform=transform, layer_bits=layer_bits,
        )
    console = result_console(json_path, quiet)
    for line in summary_lines(summary, trust_remote_code, attention):
        console.print(line)
    evaluated = _evaluate(sources[0], out, task, tokenizer, limit, trust_remote_code, console) if task is not None else None
    write_result(json_path, "quantize", {
        "model": model, "out": str(out), "format": export_format, "quantization": summary.description,  # modules, skipped_modules too
        "bytes": {"export": summary.out_bytes, "source": summary.source_bytes, "quantized_weights": summary.quantized_bytes,
                  "quantized_weights_bf16": summary.quantized_bf16_bytes},
        "eval": evaluated,
    }, force)


def _plan_widths(path: Path, bits: str | None) -> tuple[dict[int, int], str]:
    """The plan's width per decoder layer, and the format's own width (lm_head's): --bits, else the plan's widest.
    A plan measured at another site or with LLM.int8 is refused: exports write absmax-style weight codes."""
    from quantdiff.core.errors import ConfigError
    from quantdiff.quant.precision_plan import load_plan

    loaded = load_plan(path)
    if loaded.site != "linear" or loaded.method != "absmax":
        raise ConfigError(f"--plan {path}: a plan at site {loaded.site} with {loaded.method}; an export writes absmax weight codes, "
                          "so it takes a plan measured with --method absmax --site linear")
    layer_bits = loaded.bits_per_layer()
    return layer_bits, bits if bits is not None else str(max(layer_bits.values()))


def summary_lines(summary, trust_remote_code: bool, attention) -> list[str]:
    """What an export holds, one line each: format, scale rule, source, sizes, modules, kept code, remedies, attention."""
    from quantdiff.models.source import describe_source
    from quantdiff.quant.layer_bits import plan_phrase

    d = summary.description
    widths = f"{d['bits']}-bit" if "layer_bits" not in d else f"mixed precision ({d['bits']}-bit outside the plan's layers)"
    lines = [f"[bold]{summary.out}[/bold]: {d['method']} {widths}, {d['granularity']}"]
    if "scale_rule" in d:
        lines.append(f"scale rule: {d['scale_rule']}")
    if "activation_rule" in d:
        lines.append(f"activations at run time: {d['activation_rule']} ({d['dtype']} here; on a model with massive "
                     "activations a W8A8 figure differs between float32 and bfloat16: docs/quantization.md)")
    if d.get("source") is not None:
        lines.append(f"source: {describe_source(d['source'])} (the dequantized weights are what was quantized)")
    lines.append(
        f"size {summary.out_bytes / 1e6:.2f} MB vs {summary.source_bytes / 1e6:.2f} MB source ({summary.size_ratio:.2f}×); "
        f"quantized weights {summary.quantized_bytes / summary.quantized_bf16_bytes:.2f}× their bf16 size"
    )
    lines.append(f"modules quantized: {len(summary.modules)}; skipped (kept in {d['dtype']}): {', '.join(summary.skipped) or 'none'}")
    if "layer_bits" in d:
        lines.append(f"per-layer widths (a mixed-precision plan): {plan_phrase(d['layer_bits'])}")
    if trust_remote_code:
        lines.append("kept the model's own code (*.py, auto_map), recorded as trust_remote_code")
    recorded = d.get("transform")
    if recorded is not None:
        rotated = recorded["name"] == "hadamard"
        how = "rotated (hadamard; the loader rotates the inputs again)" if rotated else f"smoothed (α {recorded['alpha']:g}, folded into the norms)"
        lines.append(f"weights written {how}")
    if attention is not None:
        a = attention.to_dict()
        lines.append(f"attention recorded: {a['method']['name']} {a['method']['bits']}-bit at site {a['site']['name']} (re-applied on load)")
    return lines


def _evaluate(source: Path, out: Path, task, tokenizer, limit: int | None, trust_remote_code: bool, console) -> dict:
    """The task on the source model and on the export as quantdiff reloads it (a GGUF file through transformers'
    GGUF loader), one model in memory at a time; printed as a table (unless the console is quiet) and returned as
    a sweep document (cells "source" and "quantized")."""
    from quantdiff.api import load as load_any
    from quantdiff.eval.sweep import cells_to_json, run_sweep
    from quantdiff.jobs.evaluate import report
    from quantdiff.models.bos import decide_bos
    from quantdiff.quant.checkpoint import load

    bos = decide_bos(source, tokenizer)  # both as the source model was trained
    cells = []
    for name, load_model in (("source", lambda: load(source, trust_remote_code=trust_remote_code)), ("quantized", lambda: load_any(out))):
        model = load_model()
        cells.extend(run_sweep({name: (model, tokenizer)}, task, [], limit, bos_ids={name: bos.token_id}))
        del model
    report(cells, task, None, quiet=console.quiet, bos={"source": bos, "quantized": bos}, stderr=console.stderr)
    return cells_to_json(cells, bos={name: bos.to_dict() for name in ("source", "quantized")})
