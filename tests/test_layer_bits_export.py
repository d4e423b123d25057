"""Exports of a mixed-precision plan (issue 55, item 4): `export_quantized(..., layer_bits={layer: bits})` in
quantdiff's format, compressed-tensors and GGUF. Every reloaded weight is checked against an independent
fake-quantization of the source weight at its own layer's width: the symmetric absmax rule written out here
(quantdiff's format, compressed-tensors: bit for bit), and ggml's Q8_0 / Q4_0 reference rules (GGUF); the
compressed-tensors file through transformers' own loader too."""

from __future__ import annotations

import json

import pytest
import torch

import quantdiff
from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError
from quantdiff.models import loading
from quantdiff.models.names import resolve
from quantdiff.models.pairs import build_pair
from quantdiff.quant.layer_bits import plan_phrase
from quantdiff.quant.precision_plan import save_plan
from tests.test_export import IDS, PRESET
from tests.test_export_formats import _naive_q4_0, _naive_q8_0

PLAN = {0: 8, 1: 4}  # PRESET has two decoder layers


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random Llama with an untied lm_head (so --include-lm-head can quantize it alone)."""
    root = tmp_path_factory.mktemp("src") / "standard"
    model = build_pair(PRESET, seed=0, kinds=("standard",))["standard"]
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(root)
    return root


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """A GGUF read back is dequantized into the user cache: keep those copies out of the shared one."""
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))


def _absmax(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric absmax per output channel, from its definition (LLM.int8 paper §3.1, the vector-wise form):
    s = absmax(row) / (2^(b−1) − 1), codes round(w · (2^(b−1) − 1) / absmax) clamped to ±(2^(b−1) − 1), value codes · s."""
    q = 2 ** (bits - 1) - 1
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(amax > 0, q / amax, torch.zeros_like(amax))
    return ((w * inverse).round().clamp(-q, q) * (amax / q)).to(weight.dtype)


def _gguf_rule(weight: torch.Tensor, bits: int) -> torch.Tensor:
    return {8: _naive_q8_0, 4: _naive_q4_0, 16: lambda w: w.detach().float()}[bits](weight.detach())


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def _expected(source_dir, plan, fmt_bits, rule, lm_head=False):
    """{linear weight name: the source weight through `rule` at its layer's planned width} (lm_head at fmt's)."""
    model = loading.load(source_dir, device="cpu")
    want = {}
    for fqn, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (_layer_of(fqn) is not None or (lm_head and fqn == "lm_head")):
            want[f"{fqn}.weight"] = rule(module.weight, plan[_layer_of(fqn)] if _layer_of(fqn) is not None else fmt_bits)
    return want


def _printed(capsys) -> str:
    """What a command printed, on either stream, with line breaks (a narrow terminal's) as spaces."""
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


def _unequal(reloaded: torch.nn.Module, want: dict) -> list[str]:
    params = dict(reloaded.named_parameters())
    return [name for name, w in want.items() if not torch.equal(params[name].detach(), w)]


def test_quantdiff_format_reloads_every_layer_at_its_width(source, tmp_path, capsys):
    fmt = quantdiff.parse_export("absmax", 6)  # lm_head at the format's 6 bits: neither of the plan's widths
    summary = quantdiff.export_quantized(source, tmp_path / "q", fmt, layer_bits=PLAN, include_lm_head=True)
    assert summary.description["layer_bits"] == {"0": 8, "1": 4}
    assert summary.description["module_bits"]["model.layers.0.mlp.up_proj"] == 8 and summary.description["module_bits"]["lm_head"] == 6
    assert not _unequal(quantdiff.load(tmp_path / "q"), _expected(source, PLAN, 6, _absmax, lm_head=True))
    # 4-bit codes of layer 1 take half the bytes of layer 0's 8-bit ones: each tensor is packed at its own width
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight_packed"].numel() == 2 * stored["model.layers.1.mlp.up_proj.weight_packed"].numel()

    main(["info", str(tmp_path / "q"), "--json", str(tmp_path / "info.json")])
    assert "8 bits: layer 0; 4 bits: layer 1" in _printed(capsys)
    assert json.loads((tmp_path / "info.json").read_text())["models"][0]["layer_bits"] == {"0": 8, "1": 4}


def test_compressed_tensors_plan_is_one_config_group_per_width_and_transformers_reads_it(source, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ct"
    quantdiff.export_quantized(source, out, quantdiff.parse_export("absmax", 4, format="compressed-tensors"), layer_bits=PLAN)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and qc["ignore"] == ["lm_head"]
    groups = {g["weights"]["num_bits"]: g for g in qc["config_groups"].values()}
    assert {b: (g["format"], {_layer_of(t) for t in g["targets"]}, len(g["targets"])) for b, g in groups.items()} == {
        8: ("int-quantized", {0}, 7), 4: ("pack-quantized", {1}, 7)}
    assert groups[4]["input_activations"] is None and groups[8]["input_activations"]["strategy"] == "token"

    want = _expected(source, PLAN, 4, _absmax)
    ours = quantdiff.load(out)
    assert not _unequal(ours, want)
    theirs = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        theirs_logits = theirs(IDS).logits  # transformers decompresses on the first forward
        assert not _unequal(theirs, want)
        # layer 0's inputs quantized per token at run time (W8A8), layer 1's not (W4A16): the same in both loaders
        assert torch.equal(ours(IDS).logits, theirs_logits)
    assert ours.quantdiff_recorded == [{"method": "compressed-tensors", "bits": 8, "site": "linear", "granularity": "row"}]


@pytest.mark.slow(seconds=15)
def test_gguf_plan_writes_each_tensor_in_its_widths_type(tmp_path, gguf_cache, capsys):
    import gguf

    out, plan = tmp_path / "plan.gguf", {0: 8, 1: 4, 2: 16, 3: 4}  # the shipped tiny has four layers
    quantdiff.export_quantized("tiny/standard", out, quantdiff.parse_export("absmax", 4, format="gguf"), layer_bits=plan)
    reader = gguf.GGUFReader(out)
    types = {(int(t.name.split(".")[1]), t.tensor_type.name) for t in reader.tensors if t.name.startswith("blk.") and "norm" not in t.name}
    assert types == {(0, "Q8_0"), (1, "Q4_0"), (2, "F32"), (3, "Q4_0")}
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q4_0  # the format's; each tensor names its own
    section = json.loads(reader.get_field("quantdiff.quantization_config").contents())
    assert section["layer_bits"] == {"0": 8, "1": 4, "2": 16, "3": 4}

    source = resolve("tiny/standard")[0]
    assert not _unequal(quantdiff.load(out), _expected(source, plan, 4, _gguf_rule))  # transformers' GGUF loader, type by type
    main(["info", str(out)])
    assert "16 bits: layer 2; 8 bits: layer 0; 4 bits: layers 1, 3" in _printed(capsys)


@pytest.mark.parametrize("fmt_args,plan,message", [
    (("absmax", 4), {0: 8}, "decoder layer 1 (model.layers.1) has no width"),
    (("absmax", 4), {0: 8, 1: 4, 2: 4}, "layer 2 is out of range"),
    (("absmax", 4), {-1: 8, 0: 8, 1: 4}, "layer -1 is out of range"),
    (("absmax", 4), {0: 9, 1: 4}, "layer 0 at 9 bits: absmax export takes bits 2–8 or 16"),
    (("absmax", 4), {"0": 8, 1: 4}, "a layer index must be an integer, got '0'"),
    (("absmax", 4), {0: 8.0, 1: 4}, "layer 0's width must be an integer"),
    (("absmax", 4), {}, "layer_bits must map each decoder layer"),
    (("absmax", 4), [8, 4], "e.g. {0: 8, 1: 4}; got list"),
    (("absmax", 4, None, "compressed-tensors"), {0: 6, 1: 4}, "layer 0 at 6 bits: compressed-tensors export takes --bits 4 (W4A16) or 8"),
    (("absmax", 4, 16, "compressed-tensors"), {0: 8, 1: 4}, "layer 0 at 8 bits: compressed-tensors W8A8 has per-channel weight scales"),
    (("absmax", 4, None, "gguf"), {0: 5, 1: 4}, "layer 0 at 5 bits: gguf export takes --bits 8 (Q8_0), 4 (Q4_0) or 16"),
    (("nf4", 4), {0: 4, 1: 4}, "--method nf4 (bitsandbytes' layout) stores every layer at 4 bits"),
    (("llm-int8", 8), {0: 8, 1: 8}, "--method llm-int8 (bitsandbytes' layout) stores every layer at 8 bits"),
], ids=["missing", "past-the-end", "negative", "absmax-9", "string-index", "float-width", "empty", "a-list", "ct-6", "ct-w8a8-grouped",
        "gguf-5", "nf4", "llm-int8"])
def test_a_plan_the_format_cannot_hold_is_refused_by_name(source, tmp_path, fmt_args, plan, message):
    method, bits, *rest = fmt_args
    fmt = quantdiff.parse_export(method, bits, group_size=rest[0] if rest else None, format=rest[1] if len(rest) > 1 else "quantdiff")
    out = tmp_path / ("q.gguf" if fmt.name == "gguf" else "q")
    with pytest.raises(ConfigError, match="^layer_bits") as refused:
        quantdiff.export_quantized(source, out, fmt, layer_bits=plan)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not out.exists()


def test_plan_phrase_groups_layers_into_runs():
    assert plan_phrase({"0": 8, "1": 4, "2": 4, "3": 4, "4": 8, "6": 4}) == "8 bits: layers 0, 4; 4 bits: layers 1–3, 6"
    assert plan_phrase({0: 16}) == "16 bits: layer 0"


@pytest.mark.slow(seconds=300)  # three exports of a 135M model: 436 s wall, 150 s CPU on a shared 2-core machine
@pytest.mark.real_exports
def test_smollm2_plan_exports_and_reloads_in_every_format(smollm2_dir, tmp_path, monkeypatch):
    """A 4/8-bit plan on SmolLM2 (8 bits on its first and last five layers) in all three formats: each reloads
    with every linear at its planned width."""
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))  # a GGUF read back is dequantized there
    layers = json.loads((smollm2_dir / "config.json").read_text())["num_hidden_layers"]
    plan = {i: 8 if i < 5 or i >= layers - 5 else 4 for i in range(layers)}
    for fmt, rule, out in [(quantdiff.parse_export("absmax", 4), _absmax, tmp_path / "q"),
                           (quantdiff.parse_export("absmax", 4, format="compressed-tensors"), _absmax, tmp_path / "ct"),
                           (quantdiff.parse_export("absmax", 4, format="gguf"), _gguf_rule, tmp_path / "q.gguf")]:
        summary = quantdiff.export_quantized("smollm2", out, fmt, layer_bits=plan)  # by name, as `quantize --plan` will
        assert summary.description["layer_bits"] == {str(i): b for i, b in plan.items()}
        unequal = _unequal(quantdiff.load(out, dtype=torch.float32), _expected(smollm2_dir, plan, 4, rule))
        assert not unequal, (fmt.name, unequal[:5])


def test_quantize_plan_exports_the_plans_widths(source, tmp_path, capsys):
    """`quantdiff quantize --plan`: the plan file's widths (sensitivity's `--out`) reach the export layer by layer."""
    from tests.test_precision_plan import _plan

    save_plan(_plan(bits=(8, 4), budget_bits=6.0), tmp_path / "plan.json")
    main(["quantize", str(source), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "q")])
    assert "8 bits: layer 0; 4 bits: layer 1" in _printed(capsys)
    assert not _unequal(quantdiff.load(tmp_path / "q"), _expected(source, PLAN, 8, _absmax))


@pytest.mark.parametrize(("changes", "message"), [
    ({"method": "llm-int8", "bits": (8, 8), "candidates": (8,), "budget_bits": 8.0}, "takes a plan measured with --method absmax --site linear"),
    ({"bits": (8, 4, 4), "budget_bits": 6.0}, "layer_bits: layer 2 is out of range"),
])
def test_quantize_refuses_a_plan_it_cannot_export(source, tmp_path, capsys, changes, message):
    from tests.test_precision_plan import _plan

    save_plan(_plan(**{"bits": (8, 4), **changes}), tmp_path / "plan.json")
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(source), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "q")])
    assert exit_info.value.code != 0 and message in _printed(capsys)
    assert not (tmp_path / "q").exists()
