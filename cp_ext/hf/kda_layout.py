"""Kimi Delta Attention's tensors, transformers <-> megatron's layout (`cp_ext.transformer.kimi_delta_attention`'s
parameters, Megatron-LM's KDA names): the HF adapter's map (`cp_ext.hf.kimi_linear`) and the layer tests'.

Two transformers namings of one KDA layer, both [H heads of K for q and k, of V for v]:

* the checkpoint's (what ``save_pretrained`` writes and the release holds, `CHECKPOINT_NAMES`): ``q_proj``,
  ``k_proj``, ``v_proj``; ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` ([H K or H V, 1, w] each); ``f_a_proj``,
  ``f_b_proj``, ``dt_bias`` [H K], ``A_log`` [1, 1, H, 1]; ``b_proj``; ``g_a_proj``, ``g_b_proj``; ``o_norm``;
  ``o_proj``;
* the module's (transformers 5.25's ``KimiLinearDeltaAttention`` after its load-time conversion, what
  `hf_to_megatron_state_dict` reads): the three convs stacked as ``conv1d`` [q | k | v], the forget gate's
  tensors under ``forget_gate.``.

megatron's: ``in_proj`` [q | k | v] (units ``in_proj.weight.query`` / ``.key`` / ``.value``: q_proj, k_proj,
v_proj as they are), ``conv1d`` the same sections (``conv1d.weight.query`` ...: the three convs), ``A_log`` [H],
``beta_proj`` (b_proj), ``out_norm`` (o_norm), ``out_proj`` (o_proj), the rest by name. Every gain is plain on both
sides: transformers' ``KimiLinearRMSNormGated`` scales by its weight (ones at init), and so does megatron's
``out_norm`` unless ``--apply-layernorm-1p`` makes it zero-centered (the import never sets it).
"""

import torch

SECTIONS = ("query", "key", "value")  # megatron's in_proj / conv1d units, in row order
PROJECTIONS = dict(zip(SECTIONS, ("q_proj", "k_proj", "v_proj")))
CONVS = dict(zip(SECTIONS, ("q_conv1d", "k_conv1d", "v_conv1d")))
# megatron's name -> the checkpoint's, for the tensors that are only renamed (A_log is reshaped as well)
CHECKPOINT_NAMES = {"f_a_proj.weight": "f_a_proj.weight", "f_b_proj.weight": "f_b_proj.weight", "dt_bias": "dt_bias",
                    "beta_proj.weight": "b_proj.weight", "g_a_proj.weight": "g_a_proj.weight",
                    "g_b_proj.weight": "g_b_proj.weight", "out_norm.weight": "o_norm.weight",
                    "out_proj.weight": "o_proj.weight"}


def a_log_to_megatron(a_log: torch.Tensor) -> torch.Tensor:
    """transformers' ``A_log`` [1, 1, H, 1] -> megatron's [H]."""
    return a_log.reshape(-1)


def a_log_to_hf(a_log: torch.Tensor) -> torch.Tensor:
    return a_log.reshape(1, 1, -1, 1)


# --- the module's names (the layer tests: transformers' KimiLinearDeltaAttention state dict) ------------------

_RENAMES = {"forget_gate.f_a_proj.weight": "f_a_proj.weight", "forget_gate.f_b_proj.weight": "f_b_proj.weight",
            "forget_gate.dt_bias": "dt_bias", "b_proj.weight": "beta_proj.weight", "g_a_proj.weight": "g_a_proj.weight",
            "g_b_proj.weight": "g_b_proj.weight", "conv1d.weight": "conv1d.weight", "o_proj.weight": "out_proj.weight"}


def hf_to_megatron_state_dict(hf: dict, *, zero_centered_gamma: bool = False) -> dict:
    """transformers' ``KimiLinearDeltaAttention`` state dict (the module's names, relative to the layer) -> cp_ext's
    (and Megatron-LM's KDA) at TP = 1: ``in_proj`` = [q_proj | k_proj | v_proj], ``A_log`` [1, 1, H, 1] -> [H], the
    gated norm's gain less 1 for a zero-centered norm, the rest renamed."""
    out = {new: hf[old] for old, new in _RENAMES.items()}
    out["in_proj.weight"] = torch.cat([hf["q_proj.weight"], hf["k_proj.weight"], hf["v_proj.weight"]])
    out["A_log"] = a_log_to_megatron(hf["forget_gate.A_log"])
    out["out_norm.weight"] = hf["o_norm.weight"] - 1 if zero_centered_gamma else hf["o_norm.weight"]
    return out


def megatron_to_hf_state_dict(sd: dict, *, linear_num_key_heads: int, linear_key_head_dim: int,
                              zero_centered_gamma: bool = False) -> dict:
    """The inverse of `hf_to_megatron_state_dict` (a TP = 1 state dict to transformers' module names)."""
    qk = linear_num_key_heads * linear_key_head_dim
    out = {old: sd[new] for old, new in _RENAMES.items()}
    out["q_proj.weight"], out["k_proj.weight"], out["v_proj.weight"] = torch.split(
        sd["in_proj.weight"], [qk, qk, sd["in_proj.weight"].shape[0] - 2 * qk])
    out["forget_gate.A_log"] = a_log_to_hf(sd["A_log"])
    out["o_norm.weight"] = sd["out_norm.weight"] + 1 if zero_centered_gamma else sd["out_norm.weight"]
    return out


def tp_shard_state_dict(sd: dict, tp_rank: int, tp_size: int, *, linear_num_key_heads: int, linear_key_head_dim: int,
                        linear_value_head_dim: int) -> dict:
    """TP rank ``tp_rank``'s part of a TP = 1 megatron KDA state dict (also of its gradients): ``in_proj`` rows and
    ``conv1d`` channels r/t of each of [q | k | v], the per-head tensors (``f_b_proj``, ``beta_proj``, ``g_b_proj``,
    ``dt_bias``, ``A_log``) rows r/t, ``out_proj`` columns r/t; the down projections and ``out_norm`` whole."""
    qk, v = linear_num_key_heads * linear_key_head_dim, linear_num_key_heads * linear_value_head_dim

    def part(t, sections, dim=0):
        return torch.cat([p.chunk(tp_size, dim=dim)[tp_rank] for p in torch.split(t, sections, dim=dim)], dim=dim)

    out = {name: sd[name] for name in ("f_a_proj.weight", "g_a_proj.weight", "out_norm.weight")}
    out.update({name: sd[name].chunk(tp_size)[tp_rank]
                for name in ("f_b_proj.weight", "beta_proj.weight", "g_b_proj.weight", "dt_bias", "A_log")})
    out["in_proj.weight"] = part(sd["in_proj.weight"], [qk, qk, v])
    out["conv1d.weight"] = part(sd["conv1d.weight"], [qk, qk, v])
    out["out_proj.weight"] = part(sd["out_proj.weight"], [v], dim=1)
    return out
