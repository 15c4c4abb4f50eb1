"""Quantized Hugging Face releases read as their unquantized twins (cp_ext/hf/quantized.py, cp_ext/hf/reader.py).

DeepSeek-V3's block-scaled FP8, DeepSeek-V4's (UE8M0 scales, FP4 experts) and GPT-OSS's MXFP4 experts: our
dequantization equals transformers' own bit for bit
(`_dequantize_fp8_weight`, `Fp8Dequantize`, `convert_moe_packed_tensors`, `Mxfp4Dequantize` into a GptOss model's
parameters), blocks whose scales differ by powers of two pin the tiling and the transpose, the quantizers round-trip
within FP8 / FP4 precision, and an HF directory (sharded with a partner in another shard, or one file) shows logical
names only and dequantizes on `get`. Bad inputs are an HFError naming config.json or the tensor.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from cp_ext.hf import quantized as q
from cp_ext.hf.reader import HFCheckpoint, HFError

FP8_SHAPES = [(256, 384), (200, 300), (3, 130, 129)]  # multiples of 128 and not (partial edge blocks), a stack
MX_SHAPES = [(2, 64, 40), (3, 96, 45), (1, 32, 7)]  # [E, K, rows]: K a multiple of 32 (the format's), rows not


def random_fp8(*shape, seed=0):
    """Every float8_e4m3fn byte but NaN's (0x7f, 0xff)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return torch.where((b & 0x7F) == 0x7F, b ^ 1, b).view(torch.float8_e4m3fn)


def grid(shape, block=(128, 128)):
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def spread(scale, shape, block=(128, 128)):
    """Each element's block scale, by index arithmetic."""
    i = torch.arange(shape[-2]) // block[0]
    j = torch.arange(shape[-1]) // block[1]
    return scale[..., i[:, None], j[None, :]]


# --- FP8 -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_round_trip_within_fp8_precision(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # per-block ranges differ by orders of magnitude
    fp8, scale_inv = q.quantize_fp8_blocks(w)
    assert fp8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == grid(shape)
    s = spread(scale_inv, shape)
    # DeepSeek's scale: the block's amax / 448, so each block's largest value lands on FP8's largest
    amax = (w.abs() / s).amax()
    assert torch.allclose(amax, torch.tensor(448.0))
    back = q.dequantize_fp8_blocks(fp8, scale_inv)
    # e4m3: 3 mantissa bits (half an ulp: 1/16 relative), subnormals spaced 2^-9 (in units of the block's scale)
    assert ((back - w).abs() <= w.abs() / 16 + s * 2 ** -10).all()
    assert (back - w).abs().max() > 0  # it did quantize


def test_fp8_block_tiling_and_edges():
    """Each element takes the scale of block (row // 128, col // 128), partial edge blocks included: scales that
    are distinct powers of two show a transposed, shifted or mis-tiled grid."""
    shape = (200, 300)
    scale_inv = 2.0 ** torch.arange(6.0).reshape(2, 3)
    ones = torch.ones(shape).to(torch.float8_e4m3fn)
    out = q.dequantize_fp8_blocks(ones, scale_inv)
    assert out[127, 255] == 2.0 and out[128, 255] == 16.0 and out[199, 299] == 32.0 and out[0, 256] == 4.0
    assert torch.equal(out, spread(scale_inv, shape))
    # and the quantizer's per-block amax: block (r, c) holds values of 10^(r*3 + c)
    w = torch.ones(shape) * 10.0 ** (torch.arange(200)[:, None] // 128 * 3 + torch.arange(300)[None, :] // 128)
    _, scale_inv = q.quantize_fp8_blocks(w)
    assert torch.allclose(scale_inv, 10.0 ** torch.arange(6.0).reshape(2, 3) / 448)
    with pytest.raises(ValueError, match=r"needs scales \(2, 3\)"):
        q.dequantize_fp8_blocks(ones, scale_inv.T)


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_matches_transformers_bit_for_bit(shape):
    from transformers.integrations.finegrained_fp8 import FP8Linear, Fp8Dequantize, _dequantize_fp8_weight

    w = random_fp8(*shape)
    scale_inv = torch.rand(grid(shape), generator=torch.Generator().manual_seed(1)) * 1e-2 + 1e-4
    ours = q.dequantize_fp8_blocks(w, scale_inv)
    assert torch.equal(ours, _dequantize_fp8_weight(w, scale_inv, [128, 128], torch.float32))
    if shape[-1] % 128 == 0 and shape[-2] % 128 == 0:
        # the load-time op with `dequantize=True` derives the block from the scale grid (rows // grid rows), so it
        # agrees only where the blocks tile exactly; at [200, 300] it would take 100-row blocks
        out = Fp8Dequantize(None).convert({"weight": w, "weight_scale_inv": scale_inv})["weight"]
        assert torch.equal(ours, out)
    # transformers' FP8Linear [out, in] allocates the same scale grid, partial blocks rounded up
    assert tuple(FP8Linear(shape[-1], shape[-2], block_size=(128, 128)).weight_scale_inv.shape) == grid(shape)[-2:]
    per_tensor = q.dequantize_fp8_blocks(w, torch.tensor(0.5), block=None)
    assert torch.equal(per_tensor, _dequantize_fp8_weight(w, torch.tensor(0.5), None, torch.float32))


# --- MXFP4 -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", MX_SHAPES)
def test_mxfp4_round_trip_within_fp4_precision(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 2.0 ** torch.randint(-8, 8, shape[:-2] + (1, shape[-1])).float()
    blocks, scales = q.quantize_mxfp4(x)
    e, k, rows = shape
    assert blocks.dtype == scales.dtype == torch.uint8
    assert tuple(blocks.shape) == (e, rows, k // 32, 16) and tuple(scales.shape) == (e, rows, k // 32)
    back = q.dequantize_mxfp4(blocks, scales)
    assert back.shape == x.shape and back.dtype == torch.float32
    # the scale 2^s is the smallest power of two with the group's amax / 2^s <= 6, so the amax lands in (3, 6]
    s = (scales.float() - 127).exp2().repeat_interleave(32, dim=-1).transpose(-2, -1)  # each element's scale
    group_amax = x.abs().transpose(-2, -1).unflatten(-1, (k // 32, 32)).amax(-1).repeat_interleave(32, -1)
    ratio = group_amax.transpose(-2, -1) / s
    assert ((ratio > 3) & (ratio <= 6)).all()
    # e2m1's grid 0, .5, 1, 1.5, 2, 3, 4, 6: half a gap is at most max(1/4, |v| / 4) of the scale
    assert ((back - x).abs() <= torch.maximum(s / 4, x.abs() / 4)).all()
    # values already on the grid come back exactly
    assert torch.equal(q.dequantize_mxfp4(*q.quantize_mxfp4(back)), back)


def test_mxfp4_nibbles_groups_and_transpose():
    """Hand-made bytes: low nibble first, group g holds K indices 32g..32g+31, and blocks' row r is column r of
    the result; each group's scale is a different power of two, so a wrong group or row shows."""
    e, rows, groups = 2, 3, 2
    blocks = torch.zeros(e, rows, groups, 16, dtype=torch.uint8)
    scales = (127 + torch.arange(e * rows * groups).reshape(e, rows, groups)).to(torch.uint8)
    blocks[1, 2, 1, 5] = 0xF2  # low nibble 2 (1.0), high nibble 15 (-6.0)
    out = q.dequantize_mxfp4(blocks, scales)
    assert out.shape == (e, groups * 32, rows)
    scale = 2.0 ** (scales[1, 2, 1].item() - 127)
    assert out[1, 32 + 10, 2] == 1.0 * scale and out[1, 32 + 11, 2] == -6.0 * scale
    assert out.count_nonzero() == 2
    # the quantizer's per-group scales follow the magnitudes: group g of row r, expert i scaled by 2^(i*6 + r*2 + g)
    x = torch.ones(e, groups * 32, rows) * 6.0 * 2.0 ** (
        torch.arange(e)[:, None, None] * 6 + torch.arange(rows)[None, None, :] * 2
        + torch.arange(groups * 32)[None, :, None] // 32).float()
    b, s = q.quantize_mxfp4(x)
    assert torch.equal(s.int() - 127, torch.arange(e * rows * groups).reshape(e, rows, groups).int())
    assert torch.equal(q.dequantize_mxfp4(b, s), x)
    with pytest.raises(ValueError, match="groups 32 values"):
        q.quantize_mxfp4(torch.ones(2, 40, 8))


def test_fp4_rounding_ties_to_even():
    # magnitudes between the grid's values: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    # (one group, scale 2^0 from the 6.0; beyond 6 saturates)
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.6, -5.1, 6.0, -0.0] + [0.0] * 20)
    out = q.dequantize_mxfp4(*q.quantize_mxfp4(v.reshape(1, 32, 1))).flatten()
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, -6.0, 6.0, -0.0] + [0.0] * 20)
    assert torch.equal(out, expect) and torch.signbit(out[11])


def tiny_gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, layer_types=["full_attention"])
    return GptOssForCausalLM(config).float()


def test_mxfp4_matches_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import Mxfp4Dequantize, convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=g)  # every e2m1 pair
    scales = torch.randint(100, 150, (3, 40, 2), dtype=torch.uint8, generator=g)
    ours = q.dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales).float())  # exact in bf16 too
    # GptOss's parameters, in the bf16 release's layout: gate_up_proj [E, hidden, 2 x ffn], down_proj [E, ffn, hidden];
    # transformers' load-time op turns our quantizer's bytes back into exactly them
    model = tiny_gpt_oss()
    experts = model.model.layers[0].mlp.experts
    for proj, shape in (("gate_up_proj", (4, 64, 192)), ("down_proj", (4, 96, 64))):
        param = getattr(experts, proj)
        assert tuple(param.shape) == shape
        w = q.dequantize_mxfp4(*q.quantize_mxfp4(torch.randn(shape, generator=g)))  # on the grid
        b, s = q.quantize_mxfp4(w)
        assert tuple(b.shape) == (4, shape[2], shape[1] // 32, 16)  # the release's: groups run along the input dim
        theirs = Mxfp4Dequantize(None).convert({f"{proj}_blocks": b, f"{proj}_scales": s}, model=model,
                                               full_layer_name=f"model.layers.0.mlp.experts.{proj}")
        theirs = theirs[f"model.layers.0.mlp.experts.{proj}"]
        assert theirs.shape == param.shape and torch.equal(theirs, w) and torch.equal(q.dequantize_mxfp4(b, s), w)


# --- DeepSeek-V4: FP8 with UE8M0 scales, FP4 experts -----------------------------------------------------------------

def random_e8m0(*shape, seed=0):
    """UE8M0 scales 2**-20 .. 2**4 (float8_e8m0fnu)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(127 - 20, 127 + 5, shape, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)


def test_v4_fp8_and_fp4_match_transformers_bit_for_bit():
    """transformers' load-time ``Fp8Dequantize`` (which DeepSeek-V4's release goes through) on an e4m3 weight with
    UE8M0 block scales and on an FP4-packed expert weight with a UE8M0 scale per 32 columns: ours, bit for bit."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    theirs = Fp8Dequantize(None)._dequantize_one
    w, scale = random_fp8(256, 384), random_e8m0(2, 3)
    assert torch.equal(q.dequantize_fp8_blocks(w, scale), theirs(w, scale, output_dtype=torch.float32))
    packed = torch.randint(-128, 128, (64, 48), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    scales = random_e8m0(64, 3, seed=3)
    ours = q.dequantize_fp4_rows(packed, scales)
    assert ours.shape == (64, 96) and torch.equal(ours, theirs(packed, scales, output_dtype=torch.float32))
    # the nibbles: byte 0x7A holds code 10 (-1.0) in column 0 and code 7 (6.0) in column 1
    one = q.dequantize_fp4_rows(torch.tensor([[0x7A] + [0] * 15], dtype=torch.uint8).view(torch.int8),
                                torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert one[0, :2].tolist() == [-2.0, 12.0] and not one[0, 2:].any()


def test_v4_quantizers_round_trip():
    """The quantizers the release tests use: power-of-two scales (rounded up, so no block saturates) and FP4 rows."""
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-2, 2, 300)
    fp8, scale = q.quantize_fp8_ue8m0(w)
    assert fp8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    assert torch.equal(scale.float(), torch.exp2(torch.log2(scale.float()).round()))  # powers of two
    s = spread(scale.float(), w.shape)
    back = q.dequantize_fp8_blocks(fp8, scale)
    assert ((back - w).abs() <= w.abs() / 16 + s * 2 ** -10).all() and (back - w).abs().max() > 0
    e = torch.randn(6, 64)
    packed, scales = q.quantize_fp4_rows(e)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32) and scales.shape == (6, 2)
    again = q.dequantize_fp4_rows(packed, scales)
    assert torch.equal(again, q.dequantize_fp4_rows(*q.quantize_fp4_rows(again)))  # FP4 values are fixed points
    with pytest.raises(ValueError, match="needs scales"):
        q.dequantize_fp4_rows(packed, scales[:, :1].repeat(1, 3))


# --- HFCheckpoint ----------------------------------------------------------------------------------------------------

def write_hf(path, tensors, quantization_config=None, shards=None):
    """An HF directory: one model.safetensors, or ``shards`` {file: [names]} with an index."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["X"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    if shards is None:
        save_file(tensors, path / "model.safetensors")
        return path
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, path / file)
    weight_map = {n: file for file, names in shards.items() for n in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
QA, O = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.o_proj.weight"


def fp8_tensors():
    torch.manual_seed(0)
    t = {"model.norm.weight": torch.randn(300).bfloat16(), "model.embed_tokens.weight": torch.randn(10, 300).bfloat16()}
    for name, shape in ((QA, (200, 300)), (O, (300, 256))):
        t[name], t[name + "_scale_inv"] = q.quantize_fp8_blocks(torch.randn(shape) * torch.logspace(-2, 2, shape[-1]))
    return t


@pytest.mark.parametrize("sharded", [True, False])
def test_fp8_checkpoint_reads_dequantized(tmp_path, sharded):
    t = fp8_tensors()
    shards = {"model-00001-of-00002.safetensors": [QA, O, O + "_scale_inv", "model.norm.weight"],
              "model-00002-of-00002.safetensors": [QA + "_scale_inv", "model.embed_tokens.weight"]}
    hf = HFCheckpoint(write_hf(tmp_path, t, FP8_CONFIG, shards if sharded else None))
    assert hf.quantization == "fp8"
    assert hf.names() == {QA, O, "model.norm.weight", "model.embed_tokens.weight"}
    for name in (QA, O):
        got = hf.get(name, t[name].shape)
        assert got.dtype == torch.float32
        assert torch.equal(got, t[name].float() * spread(t[name + "_scale_inv"], t[name].shape))
        assert len(hf._open) == 1  # one shard open at a time, though QA's scale lives in the other shard
    assert torch.equal(hf.get("model.norm.weight", (300,)), t["model.norm.weight"].float())
    with pytest.raises(HFError, match=rf"tensor {QA} \(dequantized from {QA} and {QA}_scale_inv\) has shape "
                                      rf"\(200, 300\), config.json implies \(300, 200\)"):
        hf.get(QA, (300, 200))
    with pytest.raises(HFError, match=f"tensor {QA}_scale_inv is missing"):
        hf.get(QA + "_scale_inv")


@pytest.mark.parametrize("sharded", [True, False])
def test_mxfp4_checkpoint_reads_dequantized(tmp_path, sharded):
    at = "model.layers.0.mlp.experts."
    torch.manual_seed(0)
    w = {p: q.dequantize_mxfp4(*q.quantize_mxfp4(torch.randn(s))) for p, s in
         (("gate_up_proj", (4, 64, 192)), ("down_proj", (4, 96, 64)))}
    t = {at + "gate_up_proj_bias": torch.randn(4, 192).bfloat16(), "model.layers.0.mlp.router.weight": torch.randn(4, 64)}
    for p in w:
        t[at + p + "_blocks"], t[at + p + "_scales"] = q.quantize_mxfp4(w[p])
    shards = {"a.safetensors": [at + "gate_up_proj_blocks", at + "down_proj_blocks", at + "down_proj_scales"],
              "b.safetensors": [at + "gate_up_proj_scales", at + "gate_up_proj_bias", "model.layers.0.mlp.router.weight"]}
    hf = HFCheckpoint(write_hf(tmp_path, t, {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
                               shards if sharded else None))
    assert hf.quantization == "mxfp4"
    assert hf.names() == {at + "gate_up_proj", at + "down_proj", at + "gate_up_proj_bias",
                          "model.layers.0.mlp.router.weight"}
    assert torch.equal(hf.get(at + "gate_up_proj", (4, 64, 192)), w["gate_up_proj"])
    assert torch.equal(hf.get(at + "down_proj", (4, 96, 64)), w["down_proj"])
    assert len(hf._open) == 1
    with pytest.raises(HFError, match=r"down_proj \(dequantized from .*down_proj_blocks and .*down_proj_scales\) has "
                                      r"shape \(4, 96, 64\), config.json implies \(4, 64, 96\)"):
        hf.get(at + "down_proj", (4, 64, 96))


def test_unquantized_checkpoint_keeps_its_names(tmp_path):
    """Without quantization_config, names ending in _scales or _scale_inv are tensors like any other."""
    t = {"a.layer_scales": torch.ones(3), "b.weight": torch.ones(2, 2), "b.weight_scale_inv": torch.ones(1, 1)}
    hf = HFCheckpoint(write_hf(tmp_path, t))
    assert hf.quantization is None and hf.names() == set(t)
    assert torch.equal(hf.get("b.weight", (2, 2)), torch.ones(2, 2))


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", None])
def test_unsupported_quant_method(tmp_path, method):
    qc = {"bits": 4} if method is None else {"quant_method": method, "bits": 4}
    write_hf(tmp_path, {"w": torch.ones(2)}, qc)
    with pytest.raises(HFError, match=rf"config.json: quantization_config's quant_method {method!r} is not "
                                      rf"supported; supported: 'fp8' \(block-scaled FP8.*'mxfp4' \(MXFP4"):
        HFCheckpoint(tmp_path)


def test_bad_quantized_tensors(tmp_path):
    t = fp8_tensors()
    # an FP8 weight without its scales
    write_hf(tmp_path / "a", {QA: t[QA]}, FP8_CONFIG)
    with pytest.raises(HFError, match=rf"model.safetensors: tensor {QA} is stored in float8_e4m3fn, but there is no "
                                      rf"{QA}_scale_inv"):
        HFCheckpoint(tmp_path / "a").get(QA)
    # ... nor in a checkpoint whose config does not say fp8
    write_hf(tmp_path / "b", {QA: t[QA]})
    with pytest.raises(HFError, match=rf"{QA} is stored in float8_e4m3fn.*quant_method is None"):
        HFCheckpoint(tmp_path / "b").get(QA)
    # scales without their weight
    write_hf(tmp_path / "c", {QA + "_scale_inv": t[QA + "_scale_inv"]}, FP8_CONFIG)
    with pytest.raises(HFError, match=rf"tensor {QA}_scale_inv scales {QA}, which the checkpoint lacks"):
        HFCheckpoint(tmp_path / "c")
    # a scale grid that does not fit: the other weight's
    write_hf(tmp_path / "d", {QA: t[QA], QA + "_scale_inv": t[O + "_scale_inv"]}, FP8_CONFIG)
    with pytest.raises(HFError, match=rf"tensor {QA}_scale_inv does not fit {QA}: .*needs scales \(2, 3\), not "
                                      rf"\(3, 2\)"):
        HFCheckpoint(tmp_path / "d").get(QA)
    # a scaled weight that is not FP8
    write_hf(tmp_path / "e", {QA: t[QA].float(), QA + "_scale_inv": t[QA + "_scale_inv"]}, FP8_CONFIG)
    with pytest.raises(HFError, match=rf"tensor {QA} is stored in torch.float32; fp8 stores it in "
                                      rf"torch.float8_e4m3fn"):
        HFCheckpoint(tmp_path / "e").get(QA)
    # MXFP4: blocks without scales, scales without blocks
    blocks, scales = q.quantize_mxfp4(torch.ones(1, 32, 2))
    for d, tensors, have, missing in (("f", {"e.gate_up_proj_blocks": blocks}, "_blocks", "_scales"),
                                      ("g", {"e.gate_up_proj_scales": scales}, "_scales", "_blocks")):
        write_hf(tmp_path / d, tensors, {"quant_method": "mxfp4"})
        with pytest.raises(HFError, match=rf"model.safetensors: tensor e.gate_up_proj{have} has no "
                                          rf"e.gate_up_proj{missing} \(MXFP4 stores e.gate_up_proj as"):
            HFCheckpoint(tmp_path / d)
    write_hf(tmp_path / "h", {"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales[..., :0]},
             {"quant_method": "mxfp4"})
    with pytest.raises(HFError, match=r"tensor e.gate_up_proj_scales does not fit e.gate_up_proj_blocks: blocks "
                                      r"\(1, 2, 1, 16\) need scales"):
        HFCheckpoint(tmp_path / "h").get("e.gate_up_proj")
    write_hf(tmp_path / "i", {QA: t[QA], QA + "_scale_inv": t[QA + "_scale_inv"]},
             {"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(HFError, match=r"config.json: quantization_config's weight_block_size \[128\] is not two"):
        HFCheckpoint(tmp_path / "i")


def test_v4_release_reads_dequantized(tmp_path):
    """DeepSeek-V4's naming: ``X.weight`` with ``X.scale`` (FP8, UE8M0 blocks) and the experts' FP4 ``X.weight``
    (int8, half the columns) with ``X.scale``; the logical names are the weights', their shapes the dequantized ones
    (from the headers alone as well); the hyper-connections' ``hc_attn_scale`` is a tensor of its own."""
    torch.manual_seed(0)
    wq, w1 = "layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight"
    t = {"layers.0.hc_attn_scale": torch.randn(3), "layers.0.attn.attn_sink": torch.randn(4)}
    t[wq], t["layers.0.attn.wq_a.scale"] = q.quantize_fp8_ue8m0(torch.randn(200, 300), (128, 128))
    t[w1], t["layers.0.ffn.experts.0.w1.scale"] = q.quantize_fp4_rows(torch.randn(16, 64))
    config = {**FP8_CONFIG, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    hf = HFCheckpoint(write_hf(tmp_path, t, config))
    assert hf.names() == {wq, w1, "layers.0.hc_attn_scale", "layers.0.attn.attn_sink"}
    assert torch.equal(hf.get(wq, (200, 300)), q.dequantize_fp8_blocks(t[wq], t["layers.0.attn.wq_a.scale"]))
    assert torch.equal(hf.get(w1, (16, 64)), q.dequantize_fp4_rows(t[w1], t["layers.0.ffn.experts.0.w1.scale"]))
    assert hf.shapes_only().get(w1, (16, 64)).shape == (16, 64)
    with pytest.raises(HFError, match=r"experts.0.w1.weight \(dequantized from .*w1.weight and .*w1.scale\) has "
                                      r"shape \(16, 64\), config.json implies \(16, 32\)"):
        hf.shapes_only().get(w1, (16, 32))
    assert torch.equal(hf.get("layers.0.hc_attn_scale"), t["layers.0.hc_attn_scale"])
