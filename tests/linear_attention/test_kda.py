"""Kimi Delta Attention (the gated delta rule with a per-key-channel decay, g [b, s, h, K]) on one process:
the chunked form against the token-by-token recurrence and transformers' (5.25) ``recurrent_kimi_delta_attention``
and ``chunk_kimi_delta_attention`` (float64 to 1e-10, fp32 as they ship), their in-kernel q/k normalization,
packed documents, gradients, segment summaries, decays too strong to factor, and Gated DeltaNet as the
special case of a g constant across channels. Under CP: tests/linear_attention/test_state_passing.py.
"""

import pytest
import torch

from cp_ext.linear_attention import gated_delta_recurrent, gated_delta_rule, segment_summary
from tests.linear_attention.reference import documents, hf_float64, inputs, max_err

EXACT = 1e-10
RULE_ARGS = ("q", "k", "v", "g", "beta")
KIMI = "kimi_linear"


def _args(x, dtype=torch.float64, grad=False):
    return [x[n].to(dtype).detach().requires_grad_(grad) for n in RULE_ARGS]


def _heads(args, hv):
    """q, k repeated to the value heads: transformers' KDA functions take one q/k head per value head."""
    return [a.repeat_interleave(hv // a.shape[2], dim=2) if i < 2 else a for i, a in enumerate(args)]


def _hf(name, args, **kw):
    return hf_float64(name, KIMI)(*_heads(args, args[2].shape[2]), output_final_state=True, **kw)


@pytest.mark.parametrize("s,chunk,hk,hv,initial", [
    pytest.param(50, 16, 2, 2, False, id="s50-c16", marks=pytest.mark.quick),
    pytest.param(130, 64, 2, 2, True, id="s130-c64-initial"),
    pytest.param(37, 8, 1, 2, True, id="s37-c8-gva-initial"),
])
def test_chunked_equals_recurrence_and_transformers(s, chunk, hk, hv, initial):
    x = inputs(2, s, hk, hv, 8, 6, seed=s, per_channel=True)
    args = _args(x)
    state = torch.randn(2, hv, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) if initial else None
    o, final = gated_delta_rule(*args, chunk_size=chunk, initial_state=state)
    for name, (o_ref, final_ref) in {
        "ours, token by token": gated_delta_recurrent(*args, initial_state=state),
        "transformers' recurrent": _hf("recurrent_kimi_delta_attention", args, initial_state=state),
        "transformers' chunked": _hf("chunk_kimi_delta_attention", args, initial_state=state, chunk_size=chunk),
    }.items():
        assert o.dtype == o_ref.dtype == torch.float64
        assert max_err(o, o_ref) < EXACT and max_err(final, final_ref) < EXACT, name


def test_in_kernel_l2norm_is_transformers():
    """Kimi-Linear calls its rule with ``use_qk_l2norm_in_kernel=True`` on raw q and k: ``qk_l2norm=True`` is that
    (normalized after the cast, before the scale), and equals normalizing first."""
    x = inputs(2, 40, 2, 2, 8, 6, seed=4, per_channel=True)
    gen = torch.Generator().manual_seed(4)
    raw = [3 * torch.randn(2, 40, 2, 8, dtype=torch.float64, generator=gen) for _ in "qk"] + _args(x)[2:]
    o, final = gated_delta_rule(*raw, chunk_size=16, qk_l2norm=True)
    for name in ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention"):
        o_ref, final_ref = _hf(name, raw, initial_state=None, use_qk_l2norm_in_kernel=True)
        assert max_err(o, o_ref) < EXACT and max_err(final, final_ref) < EXACT, name
    o_rec, _ = gated_delta_recurrent(*raw, qk_l2norm=True)
    assert max_err(o, o_rec) < EXACT
    unnormalized, _ = gated_delta_rule(*raw, chunk_size=16)
    assert max_err(o, unnormalized) > 0.1  # the flag did something


def test_fp32_agrees_with_transformers():
    """transformers' fp32 fallbacks (as they ship) land on our float64 truth to fp32 precision, so the convention
    is theirs; and our fp32 error stays within 2x of their chunked form's."""
    import transformers.models.kimi_linear.modeling_kimi_linear as hf

    x = inputs(2, 130, 2, 2, 16, 16, seed=3, per_channel=True)
    truth, truth_state = gated_delta_rule(*_args(x))
    ours, final = gated_delta_rule(*_args(x, torch.float32))
    assert ours.dtype == torch.float32 and final.dtype == torch.float32
    chunked, _ = hf.chunk_kimi_delta_attention(*_args(x, torch.float32), chunk_size=64)
    recurrent, _ = hf.recurrent_kimi_delta_attention(*_args(x, torch.float32), None, False)
    for theirs in (chunked, recurrent):
        assert max_err(theirs, truth) < 1e-5, max_err(theirs, truth)
    assert max_err(ours, truth) <= 2 * max_err(chunked, truth) + 1e-7, (max_err(ours, truth), max_err(chunked, truth))
    assert max_err(final, truth_state) < 1e-5


@pytest.mark.parametrize("s,chunk", [(50, 16), (41, 8)])
def test_documents_reset_the_state(s, chunk):
    """Packed documents equal each document run on its own (transformers' recurrent, float64), chunks and
    documents cutting each other anywhere (a start at a chunk boundary, 1-token documents)."""
    x = inputs(2, s, 2, 2, 8, 6, seed=s + 1, per_channel=True)
    ids = documents(2, s, chunk)
    args = _args(x)
    o, _ = gated_delta_rule(*args, chunk_size=chunk, document_ids=ids)
    o_rec, _ = gated_delta_recurrent(*args, document_ids=ids)
    assert max_err(o, o_rec) < EXACT
    hf = hf_float64("recurrent_kimi_delta_attention", KIMI)
    for i in range(2):
        for doc in ids[i].unique():
            at = (ids[i] == doc).nonzero().flatten()
            alone, _ = hf(*[a[i:i + 1, at] for a in args], None, False)
            assert max_err(o[i:i + 1, at], alone) < EXACT, (i, doc)


def test_a_decay_constant_across_channels_is_gated_deltanet():
    """g [b, s, h] broadcast over K: the same outputs, states, summaries and (summed over K) decay gradients."""
    x = inputs(2, 45, 2, 2, 8, 6, seed=12)
    ids = documents(2, 45, 8)
    gdn, kda = _args(x, grad=True), _args(x, grad=True)
    kda[3] = x["g"].unsqueeze(-1).expand(-1, -1, -1, 8).clone().requires_grad_()
    (o_gdn, s_gdn), (o_kda, s_kda) = (gated_delta_rule(*a, chunk_size=16, document_ids=ids) for a in (gdn, kda))
    assert max_err(o_gdn, o_kda) < EXACT and max_err(s_gdn, s_kda) < EXACT
    for o, final in ((o_gdn, s_gdn), (o_kda, s_kda)):
        ((o * x["dout"]).sum() + final.square().sum()).backward()
    for name, a, b in zip(RULE_ARGS, gdn, kda):
        assert max_err(a.grad, b.grad.sum(-1) if name == "g" else b.grad) < EXACT, name
    summaries = [segment_summary(*a, chunk_size=8, document_ids=ids) for a in (gdn, kda)]
    assert all(max_err(a, b) < EXACT for a, b in zip(*summaries))
    # token by token, fp32: the same products in the same order, so bit for bit the same
    fp32 = [[a.detach().float() for a in args] for args in (gdn, kda)]
    assert all(torch.equal(a, b) for a, b in zip(*(gated_delta_recurrent(*a, document_ids=ids) for a in fp32)))


@pytest.mark.parametrize("with_docs", [False, True], ids=["one-document", "documents"])
def test_segment_summary_is_the_affine_map_of_the_state(with_docs):
    """Run from any S_in: o = o0 + Qtilde S_in and S_out = M S_in + E (float64), M now a per-channel product."""
    x = _args(inputs(2, 29, 2, 2, 8, 6, seed=11, per_channel=True))
    ids = documents(2, 29, 5) if with_docs else None
    summary = segment_summary(*x, chunk_size=8, document_ids=ids)
    for seed in (0, 1):
        s_in = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        o, s_out = gated_delta_rule(*x, initial_state=s_in, chunk_size=8, document_ids=ids)
        assert max_err(o, summary.o0 + torch.einsum("bshk,bhkv->bshv", summary.qtilde, s_in)) < EXACT
        assert max_err(s_out, summary.transition @ s_in + summary.contribution) < EXACT
    assert (summary.transition.abs().max() == 0) == with_docs  # both samples start a document inside it


def test_decays_too_strong_to_factor():
    """Channels decaying by e^-30 a token: exp(-cumsum g) over a chunk would overflow even float64, the pairwise
    per-channel decays do not: fp32 stays finite and at fp32 precision, float64 exact."""
    x = inputs(2, 70, 2, 2, 8, 6, seed=13, per_channel=True)
    x["g"][..., ::3] = -30.0
    truth, truth_state = gated_delta_recurrent(*_args(x))
    o, final = gated_delta_rule(*_args(x), chunk_size=64)
    assert max_err(o, truth) < EXACT and max_err(final, truth_state) < EXACT
    o32, final32 = gated_delta_rule(*_args(x, torch.float32), chunk_size=64)
    assert torch.isfinite(o32).all() and max_err(o32, truth) < 1e-5 and max_err(final32, truth_state) < 1e-5


def test_bad_decay_shapes_are_clear_errors():
    x = _args(inputs(1, 16, 2, 2, 8, 6, seed=0, per_channel=True))
    with pytest.raises(ValueError, match=r"\[b, s, h_v, K\] \(per channel\)"):
        gated_delta_rule(*x[:3], x[3][..., :7], x[4])
