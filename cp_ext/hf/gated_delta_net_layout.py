"""Gated DeltaNet's tensors, transformers <-> megatron-core's layout (the HF adapters', `cp_ext.hf.qwen3_next`, and
the layer tests' map).

* Gated DeltaNet, Qwen3-Next: ``in_proj_qkvz`` groups its rows by key head g, [q_g | k_g | v_g | z_g] with the
  g-th key head's r = H_v / H_k value heads, and ``in_proj_ba`` as [b_g | a_g]; megatron's ``in_proj`` is
  [q | k | v | z | b | a], each section in head order, checkpointed as the units ``in_proj.weight.query`` /
  ``.key`` / ``.value`` / ``.z`` / ``.beta`` / ``.alpha`` (`qkvz_sections`, `ba_sections`). Qwen3.5 keeps them
  apart already: ``in_proj_qkv`` [q | k | v], ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
  ``conv1d.weight`` runs over [q | k | v] on both sides (units ``conv1d.weight.query`` / ``.key`` / ``.value``);
  ``A_log``, ``dt_bias``, ``out_proj`` as they are.
* The gated norm: transformers' ``Qwen3NextRMSNormGated`` scales by its weight w, megatron's (zero-centered,
  as every norm under --apply-layernorm-1p) by 1 + w': w' = w - 1, computed in fp64 and rounded once to the
  checkpoint's dtype. Export gives w back exactly wherever w - 1 was exact in that dtype: always for a bf16
  release stored as fp32 (w - 1 needs at most 8 + 8 bits there), and for fp32 weights in [0.5, 2]
  (Sterbenz); an fp32 w outside [0.5, 2] comes back within an ulp.
"""

import torch

IN_PROJ_SECTIONS = ("query", "key", "value", "z", "beta", "alpha")  # megatron's in_proj units, in row order
CONV_SECTIONS = ("query", "key", "value")


def qkvz_sections(qkvz, *, linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim):
    """transformers' grouped ``in_proj_qkvz`` rows [per key head g: q_g (K) | k_g (K) | v_g (r V) | z_g (r V)] ->
    megatron's (q, k, v, z) sections, each in head order (value head g r + j is the j-th of group g in both)."""
    hk, kd, vd = linear_num_key_heads, linear_key_head_dim, linear_value_head_dim
    r = linear_num_value_heads // hk
    grouped = qkvz.reshape(hk, 2 * kd + 2 * r * vd, *qkvz.shape[1:])
    return tuple(t.reshape(-1, *qkvz.shape[1:]) for t in grouped.split([kd, kd, r * vd, r * vd], dim=1))


def qkvz_grouped(q, k, v, z, *, linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
                 linear_value_head_dim):
    """The inverse of `qkvz_sections`."""
    hk, kd, vd = linear_num_key_heads, linear_key_head_dim, linear_value_head_dim
    r, rest = linear_num_value_heads // hk, q.shape[1:]
    parts = [t.reshape(hk, rows, *rest) for t, rows in ((q, kd), (k, kd), (v, r * vd), (z, r * vd))]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def ba_sections(ba, *, linear_num_key_heads, linear_num_value_heads):
    """transformers' ``in_proj_ba`` rows [per key head g: b_g (r) | a_g (r)] -> megatron's (b, a) sections."""
    r = linear_num_value_heads // linear_num_key_heads
    grouped = ba.reshape(linear_num_key_heads, 2 * r, *ba.shape[1:])
    return tuple(t.reshape(-1, *ba.shape[1:]) for t in grouped.split([r, r], dim=1))


def ba_grouped(b, a, *, linear_num_key_heads, linear_num_value_heads):
    """The inverse of `ba_sections`."""
    r, rest = linear_num_value_heads // linear_num_key_heads, b.shape[1:]
    return torch.cat([b.reshape(linear_num_key_heads, r, *rest), a.reshape(linear_num_key_heads, r, *rest)],
                     dim=1).reshape(-1, *rest)


def gated_norm_to_megatron(weight):
    """transformers' gated-norm gain w -> megatron's zero-centered w - 1, in fp64 (rounded once, by the caller's
    cast to the checkpoint's dtype; see the module docstring for when export gives w back exactly)."""
    return weight.double() - 1


def gated_norm_to_hf(weight):
    return weight.double() + 1


def hf_to_megatron_state_dict(hf: dict, *, linear_num_key_heads: int, linear_num_value_heads: int,
                              linear_key_head_dim: int, linear_value_head_dim: int,
                              zero_centered_gamma: bool = False) -> dict:
    """transformers' ``Qwen3NextGatedDeltaNet`` state dict (names relative to the layer: ``in_proj_qkvz.weight``,
    ``in_proj_ba.weight``, ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``, ``out_proj.weight``) ->
    megatron-core 0.19's GDN (and `cp_ext.transformer.gated_delta_net.GatedDeltaNet`'s) at TP = 1: ``in_proj``
    [q | k | v | z | b | a] (`qkvz_sections`, `ba_sections`); the gated norm's weight less 1 for a zero-centered
    megatron norm (in the tensors' dtype)."""
    dims = dict(linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads)
    q, k, v, z = qkvz_sections(hf["in_proj_qkvz.weight"], linear_key_head_dim=linear_key_head_dim,
                               linear_value_head_dim=linear_value_head_dim, **dims)
    b, a = ba_sections(hf["in_proj_ba.weight"], **dims)
    norm = hf["norm.weight"]
    norm = gated_norm_to_megatron(norm).to(norm.dtype) if zero_centered_gamma else norm
    return {"in_proj.weight": torch.cat([q, k, v, z, b, a]), "conv1d.weight": hf["conv1d.weight"],
            "dt_bias": hf["dt_bias"], "A_log": hf["A_log"], "out_norm.weight": norm,
            "out_proj.weight": hf["out_proj.weight"]}


def megatron_to_hf_state_dict(sd: dict, *, linear_num_key_heads: int, linear_num_value_heads: int,
                              linear_key_head_dim: int, linear_value_head_dim: int,
                              zero_centered_gamma: bool = False) -> dict:
    """The inverse of `hf_to_megatron_state_dict` (a TP = 1 megatron state dict to transformers' names)."""
    hk, hv, kd, vd = linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim
    dims = dict(linear_num_key_heads=hk, linear_num_value_heads=hv)
    q, k, v, z, b, a = torch.split(sd["in_proj.weight"], [hk * kd, hk * kd, hv * vd, hv * vd, hv, hv])
    norm = sd["out_norm.weight"]
    norm = gated_norm_to_hf(norm).to(norm.dtype) if zero_centered_gamma else norm
    return {"in_proj_qkvz.weight": qkvz_grouped(q, k, v, z, linear_key_head_dim=kd, linear_value_head_dim=vd, **dims),
            "in_proj_ba.weight": ba_grouped(b, a, **dims), "conv1d.weight": sd["conv1d.weight"],
            "dt_bias": sd["dt_bias"], "A_log": sd["A_log"], "norm.weight": norm,
            "out_proj.weight": sd["out_proj.weight"]}


def tp_shard_state_dict(sd: dict, tp_rank: int, tp_size: int, *, linear_num_key_heads: int,
                        linear_num_value_heads: int, linear_key_head_dim: int, linear_value_head_dim: int) -> dict:
    """TP rank ``tp_rank``'s part of a TP = 1 megatron GDN state dict (also of its gradients), as megatron shards
    its GDN: ``in_proj`` rows r/t of each of [q | k | v | z | b | a], ``conv1d`` channels r/t of each of
    [q | k | v], ``dt_bias`` / ``A_log`` entries r/t, ``out_proj`` columns r/t; ``out_norm`` whole."""
    qk, v = linear_num_key_heads * linear_key_head_dim, linear_num_value_heads * linear_value_head_dim
    hv = linear_num_value_heads

    def part(t, sections, dim=0):
        return torch.cat([p.chunk(tp_size, dim=dim)[tp_rank] for p in torch.split(t, sections, dim=dim)], dim=dim)

    return {"in_proj.weight": part(sd["in_proj.weight"], [qk, qk, v, v, hv, hv]),
            "conv1d.weight": part(sd["conv1d.weight"], [qk, qk, v]),
            "dt_bias": part(sd["dt_bias"], [hv]), "A_log": part(sd["A_log"], [hv]),
            "out_norm.weight": sd["out_norm.weight"], "out_proj.weight": part(sd["out_proj.weight"], [v], dim=1)}
