"""The gated delta rule on one process: the chunked form against the token-by-token recurrence and
transformers' two torch fallbacks (float64, 1e-10), packed documents, gradients, segment summaries, and the
causal conv. The CP op itself: tests/linear_attention/test_state_passing.py.
"""

import pytest
import torch
import torch.nn.functional as F

from cp_ext.linear_attention import (causal_conv1d, context_parallel_gated_delta, gated_delta_recurrent,
                                     gated_delta_rule, segment_summary)
from tests.linear_attention.reference import documents, hf_float64, inputs, max_err

EXACT = 1e-10
RULE_ARGS = ("q", "k", "v", "g", "beta")


def _args(x, dtype=torch.float64, grad=False):
    return [x[n].to(dtype).detach().requires_grad_(grad) for n in RULE_ARGS]


def _hf(fn, args, **kw):
    return fn(*args, output_final_state=True, **kw)


SHAPES = [  # (s, chunk, hk, hv, with initial state)
    pytest.param(50, 16, 2, 2, False, id="s50-c16", marks=pytest.mark.quick),
    pytest.param(130, 64, 2, 2, True, id="s130-c64-initial"),
    pytest.param(64, 64, 1, 2, True, id="s64-c64-gva"),
    pytest.param(37, 8, 2, 2, True, id="s37-c8-initial"),
]


@pytest.mark.parametrize("s,chunk,hk,hv,initial", SHAPES)
def test_chunked_equals_recurrence_and_transformers(s, chunk, hk, hv, initial):
    x = inputs(2, s, hk, hv, 8, 6, seed=s)
    args = _args(x)
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(2, hv, 8, 6, dtype=torch.float64, generator=gen) if initial else None
    o, final = gated_delta_rule(*args, chunk_size=chunk, initial_state=state)
    for name, (o_ref, final_ref) in {
        "ours, token by token": gated_delta_recurrent(*args, initial_state=state),
        "transformers' recurrent": _hf(hf_float64("torch_recurrent_gated_delta_rule"), args, initial_state=state),
        "transformers' chunked": _hf(hf_float64("torch_chunk_gated_delta_rule"), args, initial_state=state,
                                     chunk_size=chunk),
    }.items():
        assert o.dtype == o_ref.dtype == torch.float64
        assert max_err(o, o_ref) < EXACT and max_err(final, final_ref) < EXACT, name


def _fallback(where):
    if where == "transformers":
        import transformers.models.qwen3_next.modeling_qwen3_next as hf

        return hf.torch_chunk_gated_delta_rule
    gdn = pytest.importorskip("megatron.core.ssm.gated_delta_net")  # megatron-core's deterministic-mode fallback
    return gdn.torch_chunk_gated_delta_rule


@pytest.mark.parametrize("where", ["transformers", "megatron"])
def test_fp32_agrees_with_the_torch_fallbacks(where):
    """transformers' and megatron-core's fp32 fallbacks (as they ship) land on our float64 truth to fp32
    precision, so the conventions (layouts, scale, decay, delta rule) are theirs; and our fp32 error stays
    within 2x of theirs."""
    x = inputs(2, 130, 2, 2, 16, 16, seed=3)
    truth, _ = gated_delta_rule(*_args(x))
    ours, final = gated_delta_rule(*_args(x, torch.float32))
    theirs, _ = _fallback(where)(*_args(x, torch.float32), chunk_size=64)
    assert ours.dtype == torch.float32 and final.dtype == torch.float32
    assert max_err(theirs, truth) < 1e-5, max_err(theirs, truth)
    assert max_err(ours, truth) <= 2 * max_err(theirs, truth) + 1e-7, (max_err(ours, truth), max_err(theirs, truth))


@pytest.mark.parametrize("s,chunk", [(50, 16), (41, 8)])
def test_documents_reset_the_state(s, chunk):
    """Packed documents equal each document run on its own (transformers', float64), chunks and
    documents cutting each other anywhere (a start at a chunk boundary, 1-token documents)."""
    x = inputs(2, s, 2, 2, 8, 6, seed=s + 1)
    ids = documents(2, s, chunk)
    args = _args(x)
    o, _ = gated_delta_rule(*args, chunk_size=chunk, document_ids=ids)
    o_rec, _ = gated_delta_recurrent(*args, document_ids=ids)
    assert max_err(o, o_rec) < EXACT
    hf = hf_float64("torch_recurrent_gated_delta_rule")
    for i in range(2):
        for doc in ids[i].unique():
            at = (ids[i] == doc).nonzero().flatten()
            alone, _ = hf(*[a[i:i + 1, at] for a in args])
            assert max_err(o[i:i + 1, at], alone) < EXACT, (i, doc)
    assert (ids[0, chunk + 3] != ids[0, chunk + 2]) and (ids[0, chunk + 4] != ids[0, chunk + 3])  # a 1-token document


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_gradients_equal_the_recurrence(per_channel):
    """float64 gradients of the chunked rule equal the token-by-token recurrence's, for Gated DeltaNet's
    per-head decay and KDA's per-channel one (dg then [b, s, h, K])."""
    x = inputs(2, 45, 1, 2, 8, 6, seed=7, per_channel=per_channel)
    ids = documents(2, 45, 8)
    state0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for run in (lambda a, st: gated_delta_rule(*a, chunk_size=16, document_ids=ids, initial_state=st),
                lambda a, st: gated_delta_recurrent(*a, document_ids=ids, initial_state=st)):
        args, state = _args(x, grad=True), state0.clone().requires_grad_()
        o, final = run(args, state)
        ((o * x["dout"]).sum() + final.square().sum()).backward()
        grads.append([a.grad for a in args] + [state.grad])
    for name, a, b in zip(RULE_ARGS + ("initial_state",), *grads):
        assert max_err(a, b) < EXACT, name
        assert a.abs().max() > 1e-3, name  # a real gradient, not zeros on both sides
    assert grads[0][3].shape == ((2, 45, 2, 8) if per_channel else (2, 45, 2))  # dg: per channel, or per head


def _run_from(x, state, ids, prev, chunk):
    return gated_delta_rule(*x, initial_state=state, chunk_size=chunk, document_ids=ids, previous_document_id=prev)


@pytest.mark.parametrize("with_docs", [False, True], ids=["one-document", "documents"])
def test_segment_summary_is_the_affine_map_of_the_state(with_docs):
    """Run from any S_in: o = o0 + Qtilde S_in and S_out = M S_in + E (float64)."""
    x = _args(inputs(2, 29, 2, 2, 8, 6, seed=11))
    ids = documents(2, 29, 5) if with_docs else None
    summary = segment_summary(*x, chunk_size=8, document_ids=ids)
    for seed in (0, 1):
        s_in = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        o, s_out = _run_from(x, s_in, ids, None, 8)
        assert max_err(o, summary.o0 + torch.einsum("bshk,bhkv->bshv", summary.qtilde, s_in)) < EXACT
        assert max_err(s_out, summary.transition @ s_in + summary.contribution) < EXACT
    if with_docs:  # both samples start a document inside the segment: nothing before it passes through
        assert summary.transition.abs().max() == 0
        after = ids[:, -1:] != ids[:, :1]
        assert (summary.qtilde.abs().amax(dim=(2, 3))[after.expand(-1, 29) & (ids == ids[:, -1:])] == 0).all()


def test_segment_starting_a_document_ignores_the_state_before_it():
    x = _args(inputs(1, 12, 2, 2, 8, 6, seed=5))
    ids = torch.full((1, 12), 4)
    summary = segment_summary(*x, chunk_size=8, document_ids=ids, previous_document_id=torch.tensor([3]))
    assert summary.transition.abs().max() == 0 and summary.qtilde.abs().max() == 0
    same = segment_summary(*x, chunk_size=8, document_ids=ids, previous_document_id=torch.tensor([4]))
    assert same.transition.abs().max() > 0.01


def test_causal_conv1d_matches_transformers_and_documents():
    import transformers.models.qwen3_next.modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((2, 30, 12), (12, 1, 4), (12,)))
    padded = F.pad(x, (0, 0, 3, 0))
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), bias, activation="silu").transpose(1, 2)
    assert max_err(causal_conv1d(padded, w, bias), ref) < EXACT
    ids = documents(2, 30, 5)
    out = causal_conv1d(padded, w, bias, document_ids=F.pad(ids, (3, 0), value=-1))
    for i in range(2):
        for doc in ids[i].unique():
            at = (ids[i] == doc).nonzero().flatten()
            alone = causal_conv1d(F.pad(x[i:i + 1, at], (0, 0, 3, 0)), w, bias)
            assert max_err(out[i:i + 1, at], alone) < EXACT, (i, doc)


def test_bad_inputs_are_clear_errors():
    from cp_ext.token_partition import DocumentZigzag

    x = _args(inputs(1, 16, 2, 2, 8, 6, seed=0))
    with pytest.raises(ValueError, match="h_k dividing h_v"):
        gated_delta_rule(x[0], x[1], x[2], x[3][..., :1], x[4])
    with pytest.raises(ValueError, match="document_ids must be"):
        gated_delta_rule(*x, document_ids=torch.zeros(1, 15, dtype=torch.int64))
    with pytest.raises(ValueError, match="layouts"):
        context_parallel_gated_delta(*x, group=None, layout=DocumentZigzag((16,), 1))
    with pytest.raises(ValueError, match="positive multiple of 2"):
        context_parallel_gated_delta(*[a[:, :15] for a in x], group=None, layout="zigzag")


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out, fp32 state and sums: the error is bf16's rounding of the inputs and the output."""
    x = inputs(2, 70, 2, 2, 16, 16, seed=9)
    rounded = [a.to(torch.bfloat16).double() for a in _args(x)]  # the inputs as bf16 holds them, in float64
    truth, truth_state = gated_delta_rule(*rounded, chunk_size=16)
    o, state = gated_delta_rule(*_args(x, torch.bfloat16), chunk_size=16)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert max_err(o, truth) <= 2.0 ** -8 * truth.abs().max().item()  # one bf16 rounding of o
    assert max_err(state, truth_state) < 1e-5  # fp32 sums of bf16 inputs
