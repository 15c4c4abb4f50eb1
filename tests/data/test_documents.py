"""Packed documents, the data and position side: Megatron's --reset-position-ids, --reset-attention-mask,
--eod-mask-loss (`cp_ext.data.documents`, `cp_ext.data.datasets`, `cp_ext.training.batches`,
`cp_ext.transformer.rope`).

Single process throughout. The datasets are megatron's GPTDataset on the embedded default corpus
(the stdlib's sources, one document per file, so real samples hold EODs at any place, adjacent ones
from empty files included). CP layouts are exercised through their positions
(`context_parallel_positions`), which is all `microbatches` and RoPE see of a CP rank. The model
checks (a real GPTModel from `build_model`: the RoPE hook at the first stage, a pipeline middle
stage and under activation recompute) run in one subprocess, so the CPU platform mode and the
process group never leak into other tests.
"""

import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cp_ext.data.documents import document_ids
from cp_ext.token_partition import context_parallel_positions
from tests.launch import run_code

EOD = 9


@pytest.mark.quick
@pytest.mark.parametrize("row, expected", [
    ([9, 1, 2, 3], [0, 1, 1, 1]),  # EOD first: the token after it starts document 1
    ([1, 2, 3, 9], [0, 0, 0, 0]),  # EOD last: it belongs to the document it ends
    ([1, 9, 9, 2, 9, 9], [0, 0, 1, 2, 2, 3]),  # adjacent EODs: an empty document between them
    ([1, 2, 3, 4], [0, 0, 0, 0]),  # no EOD: one document
], ids=["eod-first", "eod-last", "adjacent", "none"])
def test_document_ids_by_hand(row, expected):
    ids = document_ids(torch.tensor([row]), EOD)
    assert ids.dtype == torch.int64 and ids.tolist() == [expected]
    batch = document_ids(torch.tensor([row, [1, 2, 9, 4, 5, 6][:len(row)]]), EOD)  # rows are independent
    assert batch[0].tolist() == expected


def test_document_ids_follow_megatrons_mask_and_positions():
    """Same documents as megatron's own [s, s] mask (reset_attention_mask) and position ids (reset_position_ids)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 4, size=64))
    masked, loss_mask, positions = _get_ltor_masks_and_position_ids(tokens, 3, True, True, True, True)
    docs = document_ids(tokens, 3)
    assert docs.max() > 3, "the test row needs several documents"
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    assert torch.equal(~masked[0] & causal, (docs[:, None] == docs[None, :]) & causal)
    first = {int(d): int((docs == d).nonzero()[0]) for d in docs.unique()}
    assert positions.tolist() == [j - first[int(d)] for j, d in enumerate(docs)]
    assert torch.equal(loss_mask, (tokens != 3).float())


# --- GPTDataset on the embedded corpus --------------------------------------------------------------------

SEQ = 1024
FLAGS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


@pytest.fixture(scope="module")
def datasets():
    from cp_ext.arguments import parse_args
    from cp_ext.data.datasets import build_train_dataset

    def build(*flags):
        return build_train_dataset(parse_args(["--seq-length", str(SEQ), *flags], world_size=1), 400)

    return {"off": build(), "on": build(*FLAGS), "positions": build("--reset-position-ids")}


def _with_eods(dataset):
    """Indices of samples that hold an EOD."""
    found = [i for i in range(len(dataset)) if (dataset[i]["tokens"] == dataset.eod).any()]
    assert len(found) >= 4, f"only {len(found)} samples of the embedded corpus hold an EOD"
    return found


def _early_eod(dataset):
    """The sample whose first EOD comes earliest: every later CP shard starts mid-count."""
    first_eod = {i: int((dataset[i]["tokens"] == dataset.eod).nonzero()[0]) for i in _with_eods(dataset)}
    sample = min(first_eod, key=first_eod.get)
    assert first_eod[sample] < SEQ // 2
    return sample


def test_flags_reach_gptdataset(datasets):
    off, on = datasets["off"], datasets["on"]
    assert on.eod == off.eod == 256  # ByteTokenizer's EOD
    samples = _with_eods(on)
    assert max(int((on[i]["tokens"] == on.eod).sum()) for i in samples) >= 2
    for i in samples:
        plain, packed = off[i], on[i]
        tokens = packed["tokens"]
        assert torch.equal(tokens, plain["tokens"])  # the flags change no sample
        assert torch.equal(plain["position_ids"], torch.arange(SEQ)) and bool(plain["loss_mask"].all())
        restart = torch.cat([torch.tensor([True]), tokens[:-1] == on.eod])
        expected = [0]
        for j in range(1, SEQ):
            expected.append(0 if restart[j] else expected[-1] + 1)
        assert packed["position_ids"].tolist() == expected, f"sample {i}: position ids do not restart after EODs"
        assert torch.equal(packed["loss_mask"], (tokens != on.eod).float()), f"sample {i}: --eod-mask-loss"
    assert torch.equal(datasets["positions"][samples[0]]["loss_mask"], torch.ones(SEQ))  # only --eod-mask-loss masks


# name: (ring size, Ulysses size, layout); C = ring x Ulysses
LAYOUTS = {
    "cp2_zigzag": (2, 1, "zigzag"),
    "cp2_contiguous": (2, 1, "contiguous"),
    "cp4_zigzag": (4, 1, "zigzag"),
    "cp4_u2_ring2": (2, 2, "zigzag"),
    "cp4_ulysses": (1, 4, "zigzag"),
}


def _cp_positions(ring, ulysses, layout):
    return [context_parallel_positions(SEQ, ring_rank=r, ring_size=ring, ulysses_rank=u, ulysses_size=ulysses,
                                       layout=layout) for r in range(ring) for u in range(ulysses)]


def _one_microbatch(dataset, first_sample, positions, **kwargs):
    from cp_ext.training.batches import microbatches

    kwargs = {"first_stage": True, "last_stage": True, **kwargs}
    (mb,) = microbatches(dataset, consumed_samples=first_sample, global_batch_size=2, micro_batch_size=2,
                         dp_rank=0, dp_size=1, device=torch.device("cpu"), positions=positions, **kwargs)
    return mb


@pytest.mark.parametrize("layout", LAYOUTS)
def test_document_ids_sharded_like_the_tokens(datasets, layout):
    dataset = datasets["on"]
    first = _early_eod(dataset)
    full = torch.stack([dataset[first]["tokens"], dataset[first + 1]["tokens"]])
    full_docs = document_ids(full, dataset.eod)
    full_positions = torch.stack([dataset[first]["position_ids"], dataset[first + 1]["position_ids"]])
    held, local_count_differs = [], False
    for pos in _cp_positions(*LAYOUTS[layout]):
        mb = _one_microbatch(dataset, first, pos, reset_position_ids=True, reset_attention_mask=True)
        assert mb.document_ids.dtype == torch.int64 and mb.document_ids.shape == (2, pos.numel())
        assert torch.equal(mb.document_ids, full_docs[:, pos]), f"{layout}: document ids at the shard's positions"
        assert torch.equal(mb.tokens, full[:, pos]) and torch.equal(mb.position_ids, full_positions[:, pos])
        local_count_differs |= not torch.equal(document_ids(mb.tokens, dataset.eod), mb.document_ids)
        held.extend(pos.tolist())
    assert sorted(held) == list(range(SEQ))
    assert local_count_differs, "document ids counted on a shard alone would pass this test"
    assert _one_microbatch(dataset, first, pos).document_ids is None  # only with --reset-attention-mask


def test_pipeline_middle_stage_gets_documents_and_positions(datasets):
    from cp_ext.data.datasets import TrainDataset

    dataset = datasets["on"]
    first = _early_eod(dataset)
    pos = _cp_positions(2, 1, "zigzag")[1]
    full = torch.stack([dataset[first]["tokens"], dataset[first + 1]["tokens"]])
    full_positions = torch.stack([dataset[first]["position_ids"], dataset[first + 1]["position_ids"]])
    middle = dict(first_stage=False, last_stage=False)
    mb = _one_microbatch(dataset, first, pos, reset_position_ids=True, reset_attention_mask=True, **middle)
    assert mb.tokens is None and mb.labels is None and mb.loss_mask is None
    assert torch.equal(mb.document_ids, document_ids(full, dataset.eod)[:, pos])
    assert torch.equal(mb.position_ids, full_positions[:, pos])
    assert not torch.equal(mb.position_ids, pos.expand(2, -1)), "the sample's per-document positions, not global"
    mb = _one_microbatch(dataset, first, pos, reset_position_ids=True, **middle)
    assert torch.equal(mb.position_ids, full_positions[:, pos]) and mb.document_ids is None
    # Without the flags a middle stage reads nothing (its dataset is not even built).
    unread = TrainDataset(None, dataset.vocab_size, len(dataset), SEQ, eod=dataset.eod)
    mb = _one_microbatch(unread, first, pos, **middle)
    assert torch.equal(mb.position_ids, pos.expand(2, -1)) and mb.document_ids is None and mb.tokens is None


def test_middle_pipeline_stages_build_the_dataset_with_the_flags(monkeypatch):
    from megatron.core import parallel_state

    from cp_ext.arguments import parse_args
    from cp_ext.data.datasets import reads_data

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", lambda *a, **k: False)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda *a, **k: False)
    assert not reads_data(parse_args([], world_size=1))
    assert not reads_data(parse_args(["--eod-mask-loss"], world_size=1))  # the loss mask is the last stage's
    assert reads_data(parse_args(["--reset-position-ids"], world_size=1))
    assert reads_data(parse_args(["--reset-attention-mask"], world_size=1))


def test_forward_step_passes_document_ids_as_the_attention_mask():
    from cp_ext.training.batches import Microbatch
    from cp_ext.training.steps import forward_step

    tokens = torch.tensor([[1, EOD, 2, 3]])
    batch = Microbatch(tokens, tokens, torch.ones(1, 4), torch.tensor([[0, 1, 0, 1]]), np.array([0]),
                       document_ids=document_ids(tokens, EOD))
    calls = []
    forward_step(iter([batch]), lambda *args, **kwargs: calls.append((args, kwargs)))
    (args, kwargs), = calls
    assert args[0] is batch.tokens and args[1] is batch.position_ids and args[2] is batch.document_ids
    assert kwargs.keys() == {"labels", "loss_mask"}  # the loss mask: MTP shifts it, as Megatron-LM's pretrain_gpt
    assert kwargs["labels"] is batch.labels and kwargs["loss_mask"] is batch.loss_mask


# --- RoPE ---------------------------------------------------------------------------------------------------

DIM = 16


@pytest.fixture
def rope(monkeypatch):
    """megatron's RotaryEmbedding wrapped as CP rank 1 of a zigzag ring of 2 sees it (megatron's table is
    built on "the CUDA device": the CPU here, for this test only)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from cp_ext import parallel_state as cp_state
    from cp_ext.transformer.rope import RotaryAtContextParallelPositions

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(cp_state, "get_context_parallel_positions",
                        lambda s, layout, device=None: context_parallel_positions(s, ring_rank=1, ring_size=2))
    inner = RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, use_cpu_initialization=True)
    return RotaryAtContextParallelPositions(inner, layout="zigzag")


def _table(rope, length=64):
    """megatron's own full table, [length, 1, 1, DIM]."""
    return rope.inner(length, packed_seq=True)


def test_rope_without_position_ids_is_the_layouts_rows(rope):
    out = rope(64)
    expected = _table(rope).index_select(0, context_parallel_positions(64, ring_rank=1, ring_size=2))
    assert out.shape == (32, 1, 1, DIM) and torch.equal(out, expected)
    assert not torch.equal(out, _table(rope)[:32]), "rank 1 got rank 0's (or megatron's contiguous) rows"


def test_rope_at_given_position_ids(rope):
    table = _table(rope)[:, 0, 0]
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 0, 1]])  # [b, s_local], restarted per document
    rope.position_ids = position_ids
    out = rope(64)
    assert out.shape == (6, 2, 1, DIM)
    for b in range(2):
        for j in range(6):
            assert torch.equal(out[j, b, 0], table[position_ids[b, j]])
    rope.position_ids = position_ids.flip(1)
    assert torch.equal(rope(64)[:, 0, 0], table[position_ids[0].flip(0)])  # per call, never cached
    rope.position_ids = None
    assert rope(64).shape == (32, 1, 1, DIM)


def test_rope_while_decoding_is_the_decoded_positions_row(rope):
    rope.decode_position = lambda: 41
    assert torch.equal(rope(1), _table(rope, 42)[41:42])


def test_megatron_applies_per_sample_rope_over_heads(rope):
    """megatron's apply_rotary_pos_emb on [s, b, heads, dim] with [s, b, 1, dim] rows is each sample's RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False,
                             mrope_section=None)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    rope.position_ids = position_ids
    freqs = rope(64)
    q = torch.randn(8, 2, 3, DIM, generator=torch.Generator().manual_seed(0))
    out = apply_rotary_pos_emb(q, freqs, config, cp_group=object())
    table = _table(rope)
    for b in range(2):
        alone = apply_rotary_pos_emb(q[:, b:b + 1], table[position_ids[b]], config, cp_group=object())
        assert torch.equal(out[:, b:b + 1], alone)
    other = apply_rotary_pos_emb(q[:, :1], table[position_ids[1]], config, cp_group=object())
    assert not torch.equal(out[:, :1], other), "sample 0 rotated at sample 1's positions"


def test_rope_hook_on_the_model(tmp_path):
    """build_model with --reset-position-ids: RoPE at the forward's position ids on the first stage, on a
    pipeline middle stage and under full recompute (cp-aware and megatron's plain one); without the flag
    the model is today's."""
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from cp_ext.platform import setup_platform
        setup_platform("cpu")
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from cp_ext.arguments import parse_args
        from cp_ext.config import transformer_config_from_args
        from cp_ext.models.gpt_moe import build_model
        from cp_ext import parallel_state as cp_state
        parallel_state.initialize_model_parallel()
        cp_state.initialize_context_parallel(1)
        model_parallel_cuda_manual_seed(1)

        SHAPE = ["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
        def model(*flags, **kwargs):
            args = parse_args(SHAPE + list(flags), world_size=1)
            return build_model(transformer_config_from_args(args), args, 384, **kwargs)

        def rope_rows(m):
            seen = []
            m.rotary_pos_emb.register_forward_hook(lambda mod, a, out: seen.append(out))
            return seen

        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 257, (2, 16), generator=g)
        labels = torch.randint(0, 257, (2, 16), generator=g)
        per_doc = torch.tensor([list(range(5)) + list(range(11)), list(range(9)) + list(range(7))])
        glob = torch.arange(16).expand(2, -1)

        plain, packed = model(), model("--reset-position-ids")
        seen = rope_rows(packed)
        table = packed.rotary_pos_emb.inner(16, packed_seq=True)[:, 0, 0]
        out = packed(tokens, per_doc, None)
        assert torch.equal(seen[-1], table[per_doc.t()].unsqueeze(2)), "first stage: rows at the position ids"
        assert packed.rotary_pos_emb.position_ids is None, "position ids kept after the forward"
        assert not torch.allclose(out, plain(tokens, per_doc, None)), "per-document RoPE changed nothing"
        assert torch.equal(packed(tokens, glob, None), plain(tokens, glob, None)), "global positions: today's model"
        assert plain.rotary_pos_emb(16).shape == (16, 1, 1, 8) and plain.rotary_pos_emb.position_ids is None

        middle = model("--reset-position-ids", pre_process=False, post_process=False)
        seen = rope_rows(middle)
        middle.set_input_tensor(torch.randn(16, 2, 32, generator=g))
        middle(None, per_doc, None)
        assert torch.equal(seen[-1], table[per_doc.t()].unsqueeze(2)), "middle stage: rows at the position ids"

        def loss_and_grads(m):
            m.zero_grad()
            loss = m(tokens, per_doc, None, labels=labels).sum()
            loss.backward()
            return loss.detach(), [p.grad.clone() for p in m.parameters()]

        reference = loss_and_grads(packed)
        for recompute in (["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"],
                          ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1", "--no-cp-aware-recompute"]):
            m = model("--reset-position-ids", *recompute)
            seen = rope_rows(m)
            loss, grads = loss_and_grads(m)
            assert len(seen) == 1 and torch.equal(seen[0], table[per_doc.t()].unsqueeze(2)), recompute
            assert torch.allclose(loss, reference[0], rtol=1e-6), (recompute, loss, reference[0])
            for a, b in zip(grads, reference[1]):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), recompute
        cp_state.destroy_grid()
        dist.destroy_process_group()
        print("ok")
    """)
    proc = run_code(code, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
