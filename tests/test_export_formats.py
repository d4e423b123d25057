"""Exports that serving engines load: compressed-tensors (checked against the package's own packer, decompressor
and transformers' loader) and GGUF (checked against naive Q8_0/Q4_0 from ggml's reference rules, the `gguf`
package's reader and dequantizer, and transformers' GGUF loader)."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantdiff.api import load, load_tokenizer
from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError
from quantdiff.models import loading
from quantdiff.models.names import resolve
from quantdiff.models.pairs import ALL_KINDS, SizePreset, build_pair
from quantdiff.quant.compressed_tensors import COMPRESSED_TENSORS_VERSION, CompressedTensorsExport, pack_int4, unpack_int4
from quantdiff.quant.export import export_quantized, stored_weights
from quantdiff.quant.formats import parse_export
from quantdiff.core.owned import GGUF_KEY
from quantdiff.quant.gguf_export import export_gguf
from quantdiff.quant.gguf_format import GGUFExport
from quantdiff.quant.numerics import absmax_weight_quantize, compressed_tensors_token_fake_quantize
from quantdiff.quant.sites import AbsmaxMethod, LinearSite, fake_quant_weight, linear_targets
from tests.test_export import IDS, PRESET


# PRESET's input widths are 64 (hidden) and 192 (intermediate): G = 48 does not divide 64, so those layers are
# written with g = gcd(48, 64) = 16 (the path SmolLM2's 576 inputs take at G = 128), down_proj with 48


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    models = build_pair(PRESET, seed=0, kinds=ALL_KINDS)
    for kind, model in models.items():
        model.save_pretrained(root / kind)
    return {kind: root / kind for kind in models}


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """A GGUF read back is dequantized into the user cache: keep those copies out of the shared one."""
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))


def _linear_weights(model):
    return {fqn: module.weight.detach() for fqn, module in linear_targets(model, LinearSite())}


def _site_weights(source, bits, group_size):
    """The `linear` site's fake-quantized weights: what every export of our absmax weights must hold."""
    model = loading.load(source, device="cpu")
    method = AbsmaxMethod(bits, weight_group_size=group_size)
    return {fqn: fake_quant_weight(w, method) for fqn, w in _linear_weights(model).items()}


# ---- compressed-tensors -----------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int4_packing_is_the_packages(rows, width, seed):
    codes = torch.randint(-7, 8, (rows, width), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (rows, -(-width // 8))
    assert torch.equal(packed, pack_to_int32(codes, 4))
    assert torch.equal(unpack_int4(packed, (rows, width)), codes)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([rows, width])), codes)


def test_eight_codes_per_int32_offset_eight_least_significant_first():
    word = pack_int4(torch.tensor([[-7, 7, 0, 1, -1, 2, 3, 1]], dtype=torch.int8))
    nibbles = [1, 15, 8, 9, 7, 10, 11, 9]
    assert word.item() == sum(n << (4 * i) for i, n in enumerate(nibbles)) - 2**32  # top nibble ≥ 8: negative int32


@pytest.mark.parametrize("kind", ["standard", "diff", "diffv2"])
@pytest.mark.parametrize("bits,group_size", [(4, None), (4, 16), (4, 48), (8, None)], ids=["w4-channel", "w4-g16", "w4-g48-gcd", "w8a8"])
def test_compressed_tensors_weights_are_the_linear_sites(sources, tmp_path, kind, bits, group_size):
    """quantdiff's reader, the package's decompressor and transformers' loader all give the site's weights."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ct"
    export_quantized(sources[kind], out, parse_export("absmax", bits, group_size=group_size, format="compressed-tensors"))
    want = _site_weights(sources[kind], bits, group_size)
    reloaded = _linear_weights(load(out))
    assert reloaded.keys() == want.keys() and all(torch.equal(w, want[fqn]) for fqn, w in reloaded.items())

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(qc)  # the package's own schema accepts it
    stored = load_file(str(out / "model.safetensors"))
    for name, scheme in config.config_groups.items():
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        for fqn in want if scheme.targets == ["Linear"] else scheme.targets:
            state = {k.removeprefix(f"{fqn}."): v for k, v in stored.items() if k.startswith(f"{fqn}.")}
            assert torch.equal(compressor.decompress(state, scheme)["weight"], want[fqn]), fqn

    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model(IDS[:1])  # transformers' default path decompresses on the first forward
    modules = dict(model.named_modules())
    assert all(torch.equal(modules[fqn].weight, w) for fqn, w in want.items())


def test_compressed_tensors_config_declares_the_scheme(sources, tmp_path):
    export_quantized(sources["standard"], tmp_path / "w4", parse_export("absmax", 4, group_size=48, format="compressed-tensors"))
    export_quantized(sources["standard"], tmp_path / "w8", parse_export("absmax", 8, format="compressed-tensors"))
    w4 = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    w8 = json.loads((tmp_path / "w8" / "config.json").read_text())["quantization_config"]
    assert (w4["quant_method"], w4["format"], w4["quantization_status"], w4["ignore"]) == ("compressed-tensors", "pack-quantized", "compressed", ["lm_head"])
    g16, g48 = w4["config_groups"].values()  # 64 inputs: gcd(48, 64) = 16; down_proj's 192: 48
    assert g16["weights"] == {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group", "group_size": 16}
    assert g48["weights"]["group_size"] == 48 and g48["targets"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert len(g16["targets"]) == 12 and g16["input_activations"] is None and w4["quantdiff"]["group_size"] == 48
    assert "absmax/7 " in w4["quantdiff"]["scale_rule"] and "version" in w4
    (group,) = w8["config_groups"].values()
    assert w8["format"] == "int-quantized" and group["weights"]["strategy"] == "channel"
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token", "group_size": None}


@pytest.mark.parametrize("strategy,group_size", [("channel", None), ("group", 16)])
def test_w4a16_layout_is_the_packages_own_compressors(sources, tmp_path, strategy, group_size):
    """llm-compressor's route (the package's `apply_quantization_config` + `ModelCompressor`, pack-quantized)
    given the same weights and scales writes our tensors — names, shapes, dtypes, bits — and our config."""
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config
    from safetensors.torch import load_file

    export_quantized(sources["standard"], tmp_path / "ours", parse_export("absmax", 4, group_size=group_size, format="compressed-tensors"))
    model = loading.load(sources["standard"], device="cpu")
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    # PRESET's 192-wide down_proj takes G = 16 as well: one config group, as ours writes for widths G divides
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=["lm_head"]))
    for _, module in linear_targets(model, LinearSite()):
        result = absmax_weight_quantize(module.weight.detach(), 4, group_size)
        module.weight.data, module.weight_scale.data = result.dequant, result.scale.reshape(module.weight_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    (tmp_path / "theirs").mkdir()
    compressor.update_config(str(tmp_path / "theirs"))

    theirs, ours = model.state_dict(), load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[key], theirs[key]) and ours[key].dtype == theirs[key].dtype for key in ours)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    config.pop("quantdiff")
    their_config = json.loads((tmp_path / "theirs" / "config.json").read_text())["quantization_config"]
    # `version` is the writer's stamp (the package writes its own release): ours names the release whose layout it
    # writes; every other field is the package's own.
    assert (config.pop("version"), their_config.pop("version")) == (COMPRESSED_TENSORS_VERSION, compressed_tensors.__version__)
    assert config == their_config


def test_compressed_tensors_layers_of_different_widths_get_their_own_groups():
    fmt = CompressedTensorsExport(4, 128)
    config = fmt.hf_config(["lm_head"], {"a": 576, "b": 1536, "c": 100})
    groups = {tuple(g["targets"]): g["weights"]["group_size"] for g in config["config_groups"].values()}
    assert groups == {("c",): None, ("a",): 64, ("b",): 128}  # 128 ≥ 100: one scale per row, the channel strategy
    assert {g["weights"]["strategy"] for g in config["config_groups"].values()} == {"channel", "group"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 64), (5, 64)], ids=["tokens", "2-d"])
def test_w8a8_activation_rule_is_the_packages(dtype, shape):
    """Our run-time W8A8 rule against compressed-tensors' own dynamic qparams and fake-quantize, massive values
    included (a token whose absmax is 10^4 puts its other entries on a grid of 10^4/127.5)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul(3).to(dtype)
    x[..., 1, 5] = 1e4
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token")
    scale, zero = compute_dynamic_scales_and_zp(x, args, torch.nn.Linear(1, 1))
    assert torch.equal(compressed_tensors_token_fake_quantize(x), fake_quantize(x, scale, zero, args))


def test_w8a8_reload_computes_what_transformers_computes(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    export_quantized(sources["standard"], tmp_path / "w8", parse_export("absmax", 8, format="compressed-tensors"))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "w8")(IDS).logits, AutoModelForCausalLM.from_pretrained(tmp_path / "w8")(IDS).logits)


@pytest.mark.slow(seconds=15)
def test_smollm2_w8a8_reload_equals_transformers_in_float32(smollm2_dir, tmp_path):
    """The acceptance check: SmolLM2's W8A8 figure in quantdiff is what transformers computes from the file.
    Float32: equal to float tolerance (bfloat16 is not — an ulp of difference flips int8 codes of tokens whose
    per-token scale is set by the massive activation, docs/quantization.md)."""
    from transformers import AutoModelForCausalLM

    export_quantized(smollm2_dir, tmp_path / "w8", parse_export("absmax", 8, format="compressed-tensors"))
    ids = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "w8", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "w8", dtype=torch.float32)(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-4)


def test_bfloat16_export_is_exact_where_scales_stay_float32(sources, tmp_path):
    """transformers' `dequantize=True` path keeps the stored float32 scales: bit for bit the site's bf16 weights."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    source = tmp_path / "bf16"
    loading.load(sources["standard"], device="cpu").to(torch.bfloat16).save_pretrained(source)
    export_quantized(source, tmp_path / "ct", parse_export("absmax", 4, group_size=16, format="compressed-tensors"))
    want = _site_weights(source, 4, 16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", quantization_config=CompressedTensorsConfig(dequantize=True))
    modules = dict(model.named_modules())
    assert all(modules[fqn].weight.dtype == torch.bfloat16 and torch.equal(modules[fqn].weight, w) for fqn, w in want.items())


# ---- GGUF -------------------------------------------------------------------------------------------------------


def _naive_q8_0(w):
    """ggml-quants.c's quantize_row_q8_0_ref, dequantized: d = amax/127, q = roundf(x · (1/d)), value q · fp16(d)."""
    blocks = w.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: half away from zero
    return (q * d.half().float()).reshape(w.shape)


def _naive_q4_0(w):
    """quantize_row_q4_0_ref: m = the signed value of largest |x|, d = m/−8, q = min(15, (int)(x/d + 8.5)) − 8."""
    blocks = w.float().reshape(-1, 32)
    m = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    d = m / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15) - 8
    return (q * d.half().float()).reshape(w.shape)


@pytest.mark.parametrize("bits,naive", [(8, _naive_q8_0), (4, _naive_q4_0)], ids=["Q8_0", "Q4_0"])
def test_gguf_block_formats_follow_ggml_reference_rules(bits, naive):
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 96)
    w[0, :32] = 0  # an all-zero block: d = 0, codes 0
    fmt = GGUFExport(bits)
    decoded = fmt.decode(fmt.encode(w), w.shape, torch.float32)
    assert torch.equal(decoded, naive(w))
    assert not torch.equal(decoded, fake_quant_weight(w, AbsmaxMethod(bits, weight_group_size=32)))  # not our absmax G32


@pytest.mark.parametrize("bits,lm_head", [(8, False), (4, True)], ids=["Q8_0", "Q4_0-with-lm_head"])
def test_gguf_export_round_trips_through_gguf_and_transformers(tmp_path, gguf_cache, bits, lm_head):
    import gguf

    fmt = parse_export("absmax", bits, format="gguf")
    out = tmp_path / "tiny.gguf"
    export_gguf("tiny/standard", out, fmt, include_lm_head=lm_head)
    source = loading.load(resolve("tiny/standard")[0], device="cpu")
    config = source.config

    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType[f"MOSTLY_{fmt.type_name}"]
    assert reader.get_field("tokenizer.ggml.pre").contents() == "gpt-2"
    assert json.loads(reader.get_field(GGUF_KEY).contents())["type"] == fmt.type_name
    tensors = {t.name: t for t in reader.tensors}
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type.name == fmt.type_name and tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert tensors["output.weight"].tensor_type.name == (fmt.type_name if lm_head else "F32")
    # llama.cpp's row order for Q: per head, the two rotary halves interleaved; the package's dequantizer on it
    heads, (rows, width) = config.num_attention_heads, source.model.layers[0].self_attn.q_proj.weight.shape
    file_q = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type)).reshape(rows, width)
    unpermuted = file_q.reshape(heads, rows // heads // 2, 2, width).swapaxes(1, 2).reshape(rows, width)
    naive = _naive_q8_0 if bits == 8 else _naive_q4_0
    assert torch.equal(unpermuted, naive(source.model.layers[0].self_attn.q_proj.weight.detach()))

    back = dict(load(out).named_parameters())  # through transformers' GGUF loader
    with stored_weights(source, fmt, include_lm_head=lm_head), torch.no_grad():
        assert all(torch.equal(p, back[name]) for name, p in source.named_parameters())
    text = "It is a truth universally acknowledged, that a single man"
    assert load_tokenizer(out)(text)["input_ids"] == load_tokenizer("tiny/standard")(text)["input_ids"]


@pytest.mark.parametrize("dtype,type_name", [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_gguf_16_bits_is_the_source_unquantized(tmp_path, gguf_cache, dtype, type_name):
    """`--bits 16`: every weight in the source's own float type, and the reload is the source, tensor for tensor."""
    import gguf

    source = tmp_path / "src"
    loading.load(resolve("tiny/standard")[0], device="cpu").to(dtype).save_pretrained(source)
    shutil.copy(resolve("tiny/standard")[0] / "tokenizer.json", source)
    out = tmp_path / "f.gguf"
    summary = export_gguf(source, out, parse_export("absmax", 16, format="gguf"))
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType["ALL_F32" if type_name == "F32" else f"MOSTLY_{type_name}"]
    assert {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.0.attn_q")} == {type_name}
    assert summary.description["type"] == type_name
    back = dict(load(out).named_parameters())
    want = loading.load(source, device="cpu").named_parameters()
    assert all(torch.equal(p.float(), back[name].float()) for name, p in want)


@pytest.fixture(scope="module")
def qwen_sources(tmp_path_factory):
    """Tiny random Qwen2 (Q/K/V biases, tied embeddings) and Qwen3 (q/k norms) with the shipped byte-level BPE."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    root, tokenizer = tmp_path_factory.mktemp("qwen"), resolve("tiny/standard")[0]
    sizes = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    out = {}
    for cls, config in [(Qwen2ForCausalLM, Qwen2Config(**sizes, tie_word_embeddings=True)), (Qwen3ForCausalLM, Qwen3Config(**sizes, head_dim=128))]:
        torch.manual_seed(0)
        model = cls(config)
        for name, p in model.named_parameters():  # biases and norms away from their 0 / 1 initialisation
            if name.endswith("bias") or "norm" in name:
                torch.nn.init.normal_(p, 0.5, 0.1)
        model.save_pretrained(root / config.model_type)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / file, root / config.model_type / file)
        out[config.model_type] = root / config.model_type
    return out


@pytest.mark.parametrize("arch,bits", [("qwen2", 8), ("qwen3", 4)])
def test_gguf_qwen_round_trips_through_transformers(qwen_sources, tmp_path, gguf_cache, arch, bits):
    import gguf

    out = tmp_path / f"{arch}.gguf"
    export_gguf(qwen_sources[arch], out, GGUFExport(bits))
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2") and ("blk.0.attn_q_norm.weight" in names) == (arch == "qwen3")
    assert ("output.weight" in names) == (arch == "qwen3")  # Qwen2's embeddings are tied
    source = loading.load(qwen_sources[arch], device="cpu")
    back = dict(load(out).named_parameters())
    with stored_weights(source, GGUFExport(bits)):
        assert all(torch.equal(p, back[name]) for name, p in source.named_parameters())


def test_gguf_qwen3_heads_transformers_cannot_read_back_are_refused(qwen_sources, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(qwen_sources["qwen3"])
    config.head_dim = 32
    config.save_pretrained(tmp_path / "q3")
    with pytest.raises(ConfigError, match="heads of 128; .* has 32"):
        export_gguf(tmp_path / "q3", tmp_path / "x.gguf", GGUFExport(8))


def test_gguf_out_is_replaced_only_when_quantdiff_wrote_it(tmp_path, gguf_cache):
    from quantdiff.core.owned import written_by_quantdiff

    out = tmp_path / "m.gguf"
    out.write_bytes(b"someone else's")
    fmt = GGUFExport(8)
    with pytest.raises(ConfigError, match="not written by quantdiff.*--force replaces it"):
        export_gguf("tiny/standard", out, fmt)
    assert out.read_bytes() == b"someone else's"
    export_gguf("tiny/standard", out, fmt, force=True)  # the file rule: any file with --force
    assert written_by_quantdiff(out)
    export_gguf("tiny/standard", out, GGUFExport(4))  # its own earlier export: replaced without --force
    import gguf

    assert gguf.GGUFReader(out).get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q4_0


@pytest.mark.parametrize(
    "args,message",
    [
        (["tiny/diff", "--format", "gguf", "--bits", "8", "--out", "x.gguf"], "llama.cpp has no DiffLlama architecture"),
        (["bb/diffv2", "--format", "gguf", "--bits", "4", "--out", "x.gguf"], "llama.cpp has no DIFF V2 architecture"),
        (["tiny/standard", "--format", "gguf", "--bits", "6", "--out", "x.gguf"], "gguf export takes --bits 8 (Q8_0), 4 (Q4_0) or 16 (unquantized), got 6"),
        (["tiny/standard", "--format", "gguf", "--out", "x"], "must end in .gguf"),
        (["tiny/standard", "--format", "gguf", "--group-size", "32", "--out", "x.gguf"], "no --group-size"),
        (["tiny/standard", "--format", "gguf", "--out", "x.gguf", "--attention-bits", "8"], "--attention-bits is recorded by --format quantdiff only: the loaders of --format gguf"),
        (["tiny/standard", "--format", "compressed-tensors", "--bits", "6", "--out", "y"], "takes --bits 4 (W4A16) or 8 (W8A8), got 6"),
        (["tiny/standard", "--format", "compressed-tensors", "--bits", "8", "--group-size", "32", "--out", "y"], "W8A8 has per-channel"),
        (["tiny/standard", "--format", "compressed-tensors", "--method", "nf4", "--out", "y"], "--method nf4 is a layout of --format quantdiff"),
        (["tiny/standard", "--format", "onnx", "--out", "y"], "unknown export format 'onnx'"),
    ],
)
def test_cli_bad_format_combinations_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", *args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code != 0 and err.startswith("error:") and message in err and "\n" not in err
    assert not any(tmp_path.iterdir())


def test_cli_gguf_export_summarises_and_stats_reads_it(tmp_path, capsys, gguf_cache):
    out = tmp_path / "tiny-q8.gguf"
    main(["quantize", "tiny/standard", "--format", "gguf", "--bits", "8", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "gguf 8-bit, blockwise-32" in printed and "llama.cpp's Q8_0" in printed
    (tmp_path / "text.txt").write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    main(["stats", str(out), "--data", str(tmp_path / "text.txt"), "--tokens", "64", "--seq-len", "32", "--json", str(tmp_path / "s.json")])
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["models"][0]["source"]["quantization"] == "Q8_0"


@pytest.mark.slow(seconds=15)
def test_smollm2_w4_g128_compressed_tensors_equals_our_g128_export(tmp_path):
    """The acceptance check: transformers with compressed-tensors loads SmolLM2 W4A16 G128 (576-wide layers in
    groups of 64, each scale twice) to exactly the weights of quantdiff's own G128 export."""
    from transformers import AutoModelForCausalLM

    ours = _site_weights(resolve("smollm2")[0], 4, 128)  # what our G128 export holds (tests/test_export.py)
    export_quantized(resolve("smollm2")[0], tmp_path / "ct", parse_export("absmax", 4, group_size=128, format="compressed-tensors"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ct")
    with torch.no_grad():
        model(IDS[:1])
    modules = dict(model.named_modules())
    assert len(ours) == 210 and all(torch.equal(modules[fqn].weight, w) for fqn, w in ours.items())


@pytest.mark.parametrize("args,fmt", [(["--format", "gguf", "--bits", "4"], GGUFExport(4)), (["--format", "compressed-tensors", "--bits", "4", "--group-size", "48"], CompressedTensorsExport(4, 48))],
                         ids=["gguf-Q4_0", "compressed-tensors-w4-g48"])
def test_cli_eval_of_the_written_file_gives_the_in_memory_figures(tmp_path, monkeypatch, gguf_cache, args, fmt):
    """`quantize --eval` reloads what it wrote (a GGUF file through transformers' loader); its figures are those
    of the source with the format's weights put in memory."""
    from quantdiff.eval.tasks.lm import LMTask
    from quantdiff.jobs import evaluate

    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife. " * 30
    (tmp_path / "text.txt").write_text(text)
    seen = []
    monkeypatch.setattr(evaluate, "report", lambda cells, task, json_path, quiet, **_: seen.append(cells))
    out = tmp_path / ("q.gguf" if isinstance(fmt, GGUFExport) else "q")
    main(["quantize", "tiny/standard", "--out", str(out), *args, "--eval", "lm", "--data", str(tmp_path / "text.txt"), "--context", "32", "--limit", "2"])
    source_cell, reloaded = seen.pop()
    source = loading.load(resolve("tiny/standard")[0], device="cpu")
    task = LMTask(path=tmp_path / "text.txt", context=32)
    tokenizer = load_tokenizer("tiny/standard")
    prepared = task.prepare(tokenizer, 2, bos_id=tokenizer.bos_token_id)  # tiny was trained with BOS first
    with stored_weights(source, fmt), torch.no_grad():
        expected = task.evaluate(source, prepared)
    assert reloaded.metrics["loss"] == pytest.approx(expected["loss"], rel=1e-6) and reloaded.metrics["tokens"] == expected["tokens"]
    assert reloaded.metrics["loss"] != pytest.approx(source_cell.metrics["loss"], rel=1e-4)  # the weights really changed


# ---- exit 0 means the export reloads: every format, every model kind, the `pair` byte tokenizer among them -----

# Vocabulary 2048: both the pair's byte tokenizer and tiny's BPE tokenizer (with merges) fit; GQA (4 heads, 2 KV).
RELOAD_PRESET = SizePreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=2048, max_position_embeddings=64)
EXPORT_ARGS = {
    "absmax": ["--bits", "4"],
    "llm-int8": ["--method", "llm-int8", "--bits", "8"],
    "nf4": ["--method", "nf4", "--bits", "4"],
    "compressed-tensors": ["--format", "compressed-tensors", "--bits", "4"],
    "gguf": ["--format", "gguf", "--bits", "8"],
}


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """Every kind as `quantdiff pair` writes it (byte-level BPE without merges), and a standard GQA model with a
    BPE tokenizer with merges (`merges`), which a GGUF file can hold."""
    import shutil

    from quantdiff.core.savedir import save_pair
    from quantdiff.models.tokenizer import bytes_tokenizer

    root = tmp_path_factory.mktemp("pair")
    models = build_pair(RELOAD_PRESET, seed=0, kinds=ALL_KINDS, init="authors")
    save_pair(models, root / "P", tokenizer=bytes_tokenizer())
    dirs = {kind: root / "P" / kind for kind in models}
    models["standard"].save_pretrained(root / "merges")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(resolve("tiny/standard")[0] / name, root / "merges" / name)
    return {**dirs, "merges": root / "merges"}


@pytest.mark.parametrize("fmt", list(EXPORT_ARGS))
@pytest.mark.parametrize("kind", [*ALL_KINDS, "merges"])
def test_an_export_that_exits_0_reloads_else_one_line_and_no_file(pair_dirs, tmp_path, capsys, gguf_cache, kind, fmt):
    out = tmp_path / ("q.gguf" if fmt == "gguf" else "q")
    try:
        main(["quantize", str(pair_dirs[kind]), "--out", str(out), "-q", *EXPORT_ARGS[fmt]])
        code = 0
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    if code == 0:
        load(out, device="cpu")
        load_tokenizer(out)
    else:
        assert err.startswith("error: ") and err.count("\n") == 1 and "internal error" not in err, err
        assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["cache"] or list(tmp_path.iterdir()) == []
    if fmt == "gguf":  # refused up front by name: a differential architecture, or a tokenizer without merges
        assert code == (0 if kind == "merges" else 1), err
        assert kind == "merges" or ("without merges" in err if kind == "standard" else "llama.cpp" in err), err


# ---- every quantize option changes the export as documented, or is refused by name: every format --------------

FORMATS = {**{k: v for k, v in EXPORT_ARGS.items()}, "fp4": ["--method", "fp4", "--bits", "4"]}
SMOOTH = ["--smooth", "0.5", "--calibration", "{cal}", "--calibration-tokens", "256"]
# option -> (its arguments, the arguments it is compared against): the export must differ from the baseline's
OPTION_CASES = {
    "group_size": (["--group-size", "32"], []),
    "threshold": (["--threshold", "4.0"], []),
    "include_lm_head": (["--include-lm-head"], []),
    "attention_bits": (["--attention-bits", "8"], []),
    "attention_method": (["--attention-bits", "8", "--attention-site", "qk", "--attention-method", "llm-int8"], ["--attention-bits", "8", "--attention-site", "qk"]),
    "attention_site": (["--attention-bits", "8", "--attention-site", "qk"], ["--attention-bits", "8"]),
    "attention_granularity": (["--attention-bits", "8", "--attention-granularity", "tensor"], ["--attention-bits", "8"]),
    "rotate": (["--rotate", "hadamard"], []),
    "smooth": (SMOOTH, []),
    "calibration": ([*SMOOTH[:2], "--calibration", "{other_cal}", *SMOOTH[4:]], SMOOTH),
    "calibration_tokens": ([*SMOOTH[:4], "--calibration-tokens", "128"], SMOOTH),
    "trust_remote_code": (["--trust-remote-code"], []),
    "plan": (["--plan", "{plan}"], []),
}
# Options that choose the format, the run or what else is reported, not what the export holds (tested elsewhere).
NOT_EXPORT_CONTENT = {"model", "out", "bits", "method", "export_format", "force", "eval_task", "data", "context", "limit",
                      "allow_partial", "revision", "json_path", "quiet"}


def test_the_option_table_covers_every_quantize_option():
    import inspect

    from quantdiff.cli.commands.quantize import quantize

    assert set(inspect.signature(quantize).parameters) == set(OPTION_CASES) | NOT_EXPORT_CONTENT


def _run_export(source, out, args, capsys) -> tuple[int, str]:
    try:
        main(["quantize", str(source), "--out", str(out), "-q", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _digest(out) -> str:
    import hashlib

    files = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def calibration_files(tmp_path_factory):
    """Two calibration texts, and a mixed-precision plan file ({plan})."""
    root = tmp_path_factory.mktemp("cal")
    words = "the of and to a in is it that was he for on with as his at by".split()
    texts = {}
    for name, seed in (("cal", 0), ("other_cal", 1)):
        rng = __import__("random").Random(seed)
        (root / f"{name}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(100)))
        texts[name] = str(root / f"{name}.txt")
    from quantdiff.quant.precision_plan import save_plan
    from tests.test_precision_plan import _plan

    bits = (8,) + (4,) * (RELOAD_PRESET.num_layers - 1)  # a mixed-precision plan for the pair's layers
    save_plan(_plan(bits=bits, budget_bits=8.0), root / "plan.json")
    return {**texts, "plan": str(root / "plan.json")}


@pytest.mark.parametrize("option", list(OPTION_CASES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_option_changes_the_export_or_is_refused_by_name(pair_dirs, calibration_files, tmp_path, capsys, gguf_cache, fmt, option):
    args, baseline = ([a.format(**calibration_files) for a in case] for case in OPTION_CASES[option])
    suffix = ".gguf" if fmt == "gguf" else ""
    base_code, base_err = _run_export(pair_dirs["merges"], tmp_path / f"base{suffix}", [*FORMATS[fmt], *baseline], capsys)
    code, err = _run_export(pair_dirs["merges"], tmp_path / f"with{suffix}", [*FORMATS[fmt], *args], capsys)
    if code == 0:
        assert base_code == 0, base_err
        assert _digest(tmp_path / f"with{suffix}") != _digest(tmp_path / f"base{suffix}"), f"{option} is ignored by {fmt}"
    else:
        assert err.startswith("error: ") and err.count("\n") == 1, err
        named = "--" + option.replace("_", "-")
        assert named in err or (base_code != 0 and err == base_err), err  # by name, or the baseline's own refusal
