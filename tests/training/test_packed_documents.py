"""CP=1 with a document mask is the same model as each document run as its own sample.

A real GPTModel (`cp_ext.models.gpt_moe.build_model`, one process) runs one packed sample of
four documents (lengths 5, 1, 11, 7) with document ids in megatron's attention-mask seat and
per-document position ids (`--reset-attention-mask --reset-position-ids`), then each document
alone as a sample of its own length. Per-token losses and the parameter gradients of their
sum agree to fp32 rounding; without the mask they do not. (With the mask, global positions
give the same model up to rounding: RoPE only sees offsets inside a document.)
"""

import textwrap

import pytest

from tests.launch import one_rank_megatron, run_code


@pytest.mark.quick
def test_packed_sample_equals_documents_as_samples(tmp_path):
    code = one_rank_megatron(tmp_path, cp_ext_groups=True) + textwrap.dedent("""
        from cp_ext.arguments import parse_args
        from cp_ext.config import transformer_config_from_args
        from cp_ext.models.gpt_moe import build_model

        lengths = [5, 1, 11, 7]
        s = sum(lengths)
        args = parse_args(["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                           "--group-query-attention", "--num-query-groups", "2", "--seq-length", str(s), "--seed", "3",
                           "--reset-attention-mask", "--reset-position-ids"], world_size=1)
        model = build_model(transformer_config_from_args(args), args, 384)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 257, (1, s), generator=g)
        labels = torch.randint(0, 257, (1, s), generator=g)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
        per_doc_positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

        def run(pieces):
            model.zero_grad()
            losses = [model(tokens[:, a:a + n], pos, ids, labels=labels[:, a:a + n]) for a, n, pos, ids in pieces]
            torch.cat(losses, dim=1).sum().backward()
            return torch.cat(losses, dim=1).detach(), [p.grad.clone() for p in model.parameters()]

        packed = run([(0, s, per_doc_positions, doc_ids)])
        alone = run([(a, n, torch.arange(n).unsqueeze(0), None) for a, n in zip(starts, lengths)])
        err = (packed[0] - alone[0]).abs().max().item()
        assert err <= 1e-5 * alone[0].abs().max().item(), ("losses", err)
        for p, q in zip(packed[1], alone[1]):
            assert (p - q).abs().max() <= 1e-5 * max(q.abs().max().item(), 1e-6), ("grads", (p - q).abs().max())
        # The mask is what makes it so: without it the packed sample differs.
        unmasked = run([(0, s, per_doc_positions, None)])
        assert (unmasked[0] - alone[0]).abs().max() > 1e-3, "no mask"
        # RoPE is relative: inside a document, shifting every position by the same offset leaves
        # q.k unchanged, so with the mask global positions give the same model up to rounding.
        global_positions = run([(0, s, torch.arange(s).unsqueeze(0), doc_ids)])
        assert (global_positions[0] - alone[0]).abs().max() <= 1e-4 * alone[0].abs().max(), "RoPE shift"
        print("ok", err)
    """)
    proc = run_code(code, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
