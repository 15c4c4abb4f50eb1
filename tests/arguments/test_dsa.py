"""DeepSeek sparse attention's flags (`cp_ext.arguments.dsa`): Megatron-LM's spelling and meaning, and the
early, clear errors for what DSA does not run."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import _error

MLA = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
SIZES = ["--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "8"]
DSA = MLA + ["--experimental-attention-variant", "dsa"] + SIZES


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (["--dsa-indexer-topk", "8", "--dsa-indexer-use-sparse-loss", "--dsa-dense-warmup"], 1,
         ["--dsa-indexer-topk applies to DeepSeek sparse attention", "--dsa-indexer-use-sparse-loss applies",
          "--dsa-dense-warmup applies", "--experimental-attention-variant dsa"]),
        (MLA[:1] + MLA[3:] + ["--experimental-attention-variant", "dsa"] + SIZES, 1,
         ["dsa needs --q-lora-rank", "--q-lora-rank 1536"]),
        (DSA[:-1] + ["0"], 1, ["--dsa-indexer-topk"]),
        (["--experimental-attention-variant", "dsa"] + SIZES, 1,
         ["is DeepSeek-V3.2's sparse MLA; add --multi-latent-attention"]),
        (MLA + ["--experimental-attention-variant", "dsa"], 1,
         ["needs --dsa-indexer-n-heads, --dsa-indexer-head-dim, --dsa-indexer-topk", "--dsa-indexer-topk 2048"]),
        (["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2", "--num-layers", "2",
          "--dsa-indexer-topk", "8"], 1, ["--dsa-indexer-topk applies to DeepSeek sparse attention"]),
        (DSA[:-3] + ["2", "--dsa-indexer-topk", "8"], 1,
         ["--dsa-indexer-head-dim 2 is smaller than the RoPE part", "--qk-pos-emb-head-dim 4"]),
        (DSA + ["--dsa-indexer-loss-coeff", "-1"], 1, ["--dsa-indexer-loss-coeff -1.0 must be >= 0"]),
        (DSA + ["--dsa-indexer-use-sparse-loss"], 1, ["--dsa-indexer-use-sparse-loss shapes the indexer loss"]),
        (DSA + ["--context-parallel-size", "2", "--ulysses-size", "2"], 2,
         ["runs under context parallelism on the ring (--cp-comm-type p2p) and all_gather", "Ulysses size 2"]),
        (DSA + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                "2", "2"], 4, ["not Ulysses or hybrid", "--cp-comm-type p2p or all_gather"]),
        (DSA + ["--context-parallel-size", "2", "--cp-mla-exchange", "kv"], 2, ["--cp-mla-exchange kv: DSA attends"]),
        (DSA + ["--window-size", "4,0"], 1, ["--window-size is not supported with --experimental-attention-variant"]),
        (DSA + ["--softmax-type", "learnable"], 1, ["--softmax-type learnable is not supported"]),
        (DSA + ["--reset-attention-mask"], 1, ["--reset-attention-mask (packed documents) is not supported"]),
        (DSA + ["--recompute-granularity", "selective"], 1, ["--recompute-modules core_attn is not supported"]),
        (DSA + ["--dsa-dense-warmup"], 1, ["--dsa-dense-warmup trains the indexer from its loss only, which is off"]),
        (DSA + ["--dsa-dense-warmup", "--dsa-indexer-loss-coeff", "1", "--dsa-indexer-use-sparse-loss"], 1,
         ["drop --dsa-indexer-use-sparse-loss, which belongs to the sparse stage"]),
    ],
    ids=["dsa-flags-without-dsa", "dsa-without-q-lora", "topk-zero", "dsa-without-mla", "sizes-missing", "dsa-flag-with-gated-delta-net", "head-dim-below-rope",
         "negative-coeff", "sparse-loss-without-loss", "ulysses", "hybrid", "kv-exchange", "window",
         "sink", "packed-documents", "core-attn-recompute", "warmup-without-loss", "warmup-sparse-loss"],
)
def test_bad_dsa_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_dsa_runs_where_every_layer_all_gathers():
    """Ulysses-sized CP groups are fine where every layer all-gathers (the indexer keys are gathered too)."""
    args = parse_args(DSA + ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"], world_size=2)
    assert args.experimental_attention_variant == "dsa"


def test_dsa_flags_reach_the_config():
    """Megatron-LM's DSA fields on megatron's TransformerConfig; the variant itself as cp_ext's ``dsa``
    (megatron's field stays None: `cp_ext.transformer.dsa` says why); None coefficient: no loss."""
    from cp_ext.config import transformer_config_from_args

    cfg = transformer_config_from_args(parse_args(DSA + ["--dsa-indexer-loss-coeff", "0.01",
                                                         "--dsa-indexer-use-sparse-loss"], world_size=1))
    assert cfg.dsa and cfg.experimental_attention_variant is None
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk) == (4, 8, 8)
    assert (cfg.dsa_indexer_loss_coeff, cfg.dsa_indexer_use_sparse_loss) == (0.01, True)
    plain = transformer_config_from_args(parse_args(DSA, world_size=1))
    assert plain.dsa_indexer_loss_coeff is None and not plain.dsa_indexer_use_sparse_loss
    assert not transformer_config_from_args(parse_args(MLA, world_size=1)).dsa


@pytest.mark.parametrize("saved_warmup, run_flags, must_name", [
    (True, [], "was written by DSA's dense warm-up (--dsa-dense-warmup)"),
    (False, ["--dsa-dense-warmup"], "--dsa-dense-warmup trains the indexer only: add --no-load-optim"),
], ids=["warmup-into-sparse", "sparse-into-warmup"])
def test_stage_change_needs_a_fresh_optimizer(tmp_path, crafted_checkpoint, saved_warmup, run_flags, must_name):
    """A warm-up checkpoint's optimizer covers the indexer only: resuming it in the other stage names
    --no-load-optim, which (or --finetune) loads it."""
    import json

    ckpt = crafted_checkpoint(tmp_path / "ckpt", 2)
    meta = ckpt / "iter_0000002" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "dsa_dense_warmup": saved_warmup}))
    argv = DSA + ["--dsa-indexer-loss-coeff", "0.1", "--load", str(ckpt), "--train-iters", "4"] + run_flags
    assert must_name in _error(argv, 1)
    for fix in (["--no-load-optim"], ["--finetune"]):
        parse_args(argv + fix, world_size=1)
