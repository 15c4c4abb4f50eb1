"""Quantized Hugging Face releases, dequantized on read (`cp_ext.hf.reader.HFCheckpoint.get`), in pure torch.

* ``fp8``: DeepSeek-V3's block-scaled FP8. ``X`` is stored in float8_e4m3fn next to ``X_scale_inv``, one fp32 per
  [128, 128] block (config.json's ``weight_block_size``); blocks at the bottom and right edges are partial, so the
  grid is [ceil(rows/128), ceil(cols/128)] (DeepSeek-V3's inference/kernel.py ``weight_dequant``; its
  kv_a_proj_with_mqa is [576, 7168]).
* ``mxfp4``: GPT-OSS's experts. ``Y_blocks`` (uint8 [..., rows, G, 16], two FP4 e2m1 codes a byte, low nibble
  first) and ``Y_scales`` (uint8 [..., rows, G], an E8M0 exponent biased by 127) hold the rows of ``Y``'s
  *transpose* in groups of 32; the dequantized tensor is ``Y`` in the bf16 release's layout (gate_up_proj
  [E, hidden, 2 x ffn], down_proj [E, ffn, hidden]).

* ``fp8`` as DeepSeek-V4 ships it: ``X.weight`` next to ``X.scale`` (transformers renames it ``X.weight_scale_inv``;
  both names are read), the scales UE8M0 (``float8_e8m0fnu``, powers of two); the experts' weights FP4: int8
  [rows, cols / 2], two e2m1 codes a byte (low nibble first, the even column), one UE8M0 scale per 32 columns
  (``dequantize_fp4_rows``). Which one a weight is follows from its stored dtype.

All give, in fp32, exactly what transformers' ``_dequantize_fp8_weight``, ``Fp8Dequantize`` and
``convert_moe_packed_tensors`` give (tests/hf/test_quantized.py checks it bit for bit). For block-scaled FP8,
transformers' load-time ``Fp8Dequantize`` agrees where the blocks tile the weight exactly; it derives the block from
the scale grid (rows // grid rows), so at a partial edge it raises or mis-tiles (576 rows in 5 blocks), where
DeepSeek's kernel and this one do not. The quantizers make such tensors, for tests or a user who wants them.
"""

import torch

METHODS = {"fp8": "block-scaled FP8 (DeepSeek-V3; DeepSeek-V4 with its FP4 experts)",
           "mxfp4": "MXFP4 experts (GPT-OSS)"}
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_INV, BLOCKS, SCALES = "_scale_inv", "_blocks", "_scales"
WEIGHT, V4_SCALE = ".weight", ".scale"  # DeepSeek-V4's release: X.weight scaled by X.scale
FP4_PACKED = torch.int8  # DeepSeek-V4's FP4 experts: two e2m1 codes a byte
MX_GROUP = 32  # elements sharing one E8M0 scale
# e2m1 code -> value; bit 3 is the sign, so codes 8..15 are 0..7 negated
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _cdiv(a, b):
    return -(-a // b)


def _scale_values(scale_inv):
    # ue8m0 releases may store their power-of-two scales as raw bytes: 2 ** (byte - 127), as transformers reads them
    if scale_inv.dtype == torch.uint8:
        return (scale_inv.float() - 127.0).exp2()
    return scale_inv.float()  # fp32, or float8_e8m0fnu (exact: a power of two)


def dequantize_fp8_blocks(weight, scale_inv, block=(128, 128)) -> torch.Tensor:
    """fp32 ``weight * scale_inv`` with each scale spread over its block ([..., rows, cols]); ``block=None``: one
    scale for the whole tensor. One fp32 multiply per element, as in transformers' ``_dequantize_fp8_weight``."""
    out = weight.float()
    scale = _scale_values(scale_inv)
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"a per-tensor scale has one element, not shape {tuple(scale.shape)}")
        return out.mul_(scale.reshape(()))
    (rows, cols), (bm, bn) = out.shape[-2:], block
    grid = (*out.shape[:-2], _cdiv(rows, bm), _cdiv(cols, bn))
    if tuple(scale.shape) != grid:
        raise ValueError(f"weight {tuple(out.shape)} in [{bm}, {bn}] blocks needs scales {grid}, "
                         f"not {tuple(scale.shape)}")
    # spread the scales over rows only and walk the column blocks: a full-size scale tensor would double the memory
    scale = scale.repeat_interleave(bm, dim=-2)[..., :rows, :]
    for j in range(grid[-1]):
        out[..., j * bn:(j + 1) * bn].mul_(scale[..., j:j + 1])
    return out


def quantize_fp8_blocks(weight, block=(128, 128)):
    """(float8_e4m3fn weight, fp32 scale_inv) as DeepSeek-V3's ``weight_quant``: scale_inv = block amax / 448,
    weight / scale_inv; an all-zero block gets scale 1 (DeepSeek's would divide by 0)."""
    w = weight.float()
    (rows, cols), (bm, bn) = w.shape[-2:], block
    gr, gc = _cdiv(rows, bm), _cdiv(cols, bn)
    padded = torch.nn.functional.pad(w, (0, gc * bn - cols, 0, gr * bm - rows))  # zeros do not change an amax
    amax = padded.unflatten(-1, (gc, bn)).unflatten(-3, (gr, bm)).abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    spread = scale_inv.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return (w / spread).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale_inv


def _fp4_values(packed) -> torch.Tensor:
    """fp32 [..., 2 n] from bytes [..., n]: the low nibble is the even element."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)


def dequantize_mxfp4(blocks, scales) -> torch.Tensor:
    """fp32 [..., G x 32, rows] from blocks [..., rows, G, 16] and scales [..., rows, G]: transformers'
    ``convert_moe_packed_tensors`` (low nibble first, ``ldexp`` by scale - 127, then the last two dims swapped; it
    swaps dims 1 and 2, the same for GPT-OSS's 4-d blocks)."""
    if blocks.dim() < 3 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"blocks {tuple(blocks.shape)} need scales of shape blocks.shape[:-1] (at least 2-d), "
                         f"not {tuple(scales.shape)}")
    *lead, rows, groups, half = blocks.shape
    out = torch.empty(*lead, groups * 2 * half, rows)
    flat_out, flat_b = out.view(-1, groups * 2 * half, rows), blocks.reshape(-1, rows, groups, half)
    flat_e = scales.reshape(-1, rows, groups).to(torch.int32) - 127
    for i in range(flat_b.shape[0]):  # one expert at a time: the int64 codes of all would be 8x the packed size
        values = _fp4_values(flat_b[i])  # [rows, G, 32]
        flat_out[i] = torch.ldexp(values, flat_e[i].unsqueeze(-1)).flatten(-2).T
    return out


def quantize_mxfp4(tensor):
    """(blocks, scales), the inverse of `dequantize_mxfp4` for ``tensor`` [..., K, rows] with K a multiple of 32 (the
    format has no partial group): per 32 values along K, the smallest power of two 2**e with amax / 2**e <= 6, then
    each value / 2**e rounded to the nearest e2m1 value (ties to the even code, as IEEE rounds)."""
    t = tensor.float().transpose(-2, -1).contiguous()  # [..., rows, K]: the groups run along the stored rows
    if t.shape[-1] % MX_GROUP:
        raise ValueError(f"MXFP4 groups {MX_GROUP} values along dim -2; {tuple(tensor.shape)} has {t.shape[-1]}")
    t = t.unflatten(-1, (t.shape[-1] // MX_GROUP, MX_GROUP))
    amax = t.abs().amax(dim=-1)
    # E8M0 holds exponents -127..127 (byte 255 is NaN); an all-zero group takes the smallest
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).nan_to_num(-127).to(torch.int32)
    mag = torch.ldexp(t.abs(), -e.unsqueeze(-1))
    mids = torch.tensor([(a + b) / 2 for a, b in zip(FP4_VALUES[:7], FP4_VALUES[1:8])])
    down, up = torch.bucketize(mag, mids), torch.bucketize(mag, mids, right=True)  # differ only on a tie
    code = torch.where(down % 2 == 1, up, down) | (torch.signbit(t).long() << 3)  # beyond 6 saturates at code 7
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return packed.contiguous(), (e + 127).to(torch.uint8)


def dequantize_fp4_rows(packed, scale) -> torch.Tensor:
    """fp32 [..., rows, 2 n] from DeepSeek-V4's FP4 ``packed`` [..., rows, n] (int8) and ``scale`` [..., rows, G]
    (UE8M0, or fp32), each scale over ``2 n / G`` consecutive columns of its row (32 in the release)."""
    values = _fp4_values(packed)
    scale = _scale_values(scale)
    rows, cols = values.shape[-2:]
    if scale.dim() < 2 or tuple(scale.shape[:-1]) != tuple(values.shape[:-1]) or cols % scale.shape[-1]:
        raise ValueError(f"an FP4 weight of {cols} columns ({tuple(packed.shape)} bytes) needs scales "
                         f"[{', '.join(map(str, values.shape[:-1]))}, G] with G dividing {cols}, "
                         f"not {tuple(scale.shape)}")
    return values.unflatten(-1, (scale.shape[-1], -1)).mul_(scale.unsqueeze(-1)).flatten(-2)


def power_of_two_scales(scale_inv) -> torch.Tensor:
    """UE8M0 scales (``float8_e8m0fnu``): each fp32 scale rounded up to a power of two, as DeepSeek-V4's release
    stores them (rounding up keeps every value within FP8's range)."""
    return torch.exp2(torch.ceil(torch.log2(scale_inv.float()))).to(torch.float8_e8m0fnu)


def quantize_fp8_ue8m0(weight, block=(128, 128)):
    """(float8_e4m3fn weight, float8_e8m0fnu scale): `quantize_fp8_blocks` with DeepSeek-V4's power-of-two scales."""
    _, scale_inv = quantize_fp8_blocks(weight, block)
    scale = power_of_two_scales(scale_inv)
    (rows, cols), (bm, bn) = weight.shape[-2:], block
    spread = scale.float().repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return (weight.float() / spread).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_fp4_rows(weight, group: int = MX_GROUP):
    """(int8 packed, float8_e8m0fnu scales), the inverse of `dequantize_fp4_rows` for ``weight`` [..., rows, cols]
    with cols a multiple of ``group``: `quantize_mxfp4`'s rounding, along each row."""
    if weight.shape[-1] % group:
        raise ValueError(f"FP4 groups {group} columns; {tuple(weight.shape)} has {weight.shape[-1]}")
    blocks, scales = quantize_mxfp4(weight.transpose(-2, -1))  # quantize_mxfp4 groups along dim -2
    packed = blocks.flatten(-2).view(torch.int8)  # [..., rows, G, 16] -> [..., rows, cols / 2], the same nibbles
    return packed, scales.view(torch.float8_e8m0fnu)
