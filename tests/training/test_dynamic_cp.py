"""Dynamic context parallelism = one process, on the same global batches of documents.

A corpus of documents of lognormal lengths (2 to 150 tokens, cut at --seq-length 64) trains 2 iterations
with --dynamic-context-parallel on 4 ranks: each document on a group of 1, 2 or 4 of the DP x CP ranks
(--max-seqlen-per-dp-cp-rank 16), laid out per document in zigzag (`cp_ext.token_partition.DocumentZigzag`), with the
MoE aux and z losses on. The reference is one process that runs the same packs of documents, one pack per
microbatch (the schedule's groups: the aux loss balances experts over a pack, so packing is part of the
model's loss): lm loss, load-balancing loss and grad norm of every iteration (relative 1e-5) and every
parameter's gradient after iteration 1 (`test_grid_equivalence._assert_same`). Layouts: Megatron-LM's
scheduler and cp_ext's, the all-gather exchange, TP2 + sequence parallelism, EP2, full CP-aware recompute,
GPT-OSS's windows and sinks, MLA (latent ring and per-head K/V), MTP, Gated DeltaNet (CP2 and CP4) and Kimi
Delta Attention, DeepSeek-V4's attention at CP4 with and without its hyper-connections, PP2, and static CP's sizes
(every document on 2 ranks). A checkpoint mid-epoch resumes into the uninterrupted run.

Static CP itself, on the same documents: megatron's GPTDataset cuts the corpus into samples of --seq-length
tokens and static CP 2 trains a global batch of them as packed documents (--reset-attention-mask); the documents
of those samples, as the model saw them, become a corpus of their own that dynamic CP trains in one global batch.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cp_ext.megatron_version import at_least, installed  # noqa: E402
from tests.launch import launch, worker_args, write_results  # noqa: E402
from tests.training.test_grid_equivalence import (  # noqa: E402
    MLA_FLAGS, WINDOW_FLAGS, _assert_same, _gather, _grad_slices,
)

SEQ = 64
MTP_PADDING_MASK = at_least(installed(), "0.18")
MODEL = [
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "48", "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "11", "--data-seed", "3",
    "--clip-grad", "1.0", "--dynamic-context-parallel", "--calculate-per-token-loss", "--split", "100,0,0",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
]
GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2", "--linear-num-key-heads",
       "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
       "--attention-output-gate"]
# dt_bias and A_log sum cancelling terms over every token (tests/training/test_linear_attention_training.py)
GDN_TOLERANCES = {".dt_bias": 5e-5, ".A_log": 5e-5}
KDA = ["--experimental-attention-variant", "kda", "--linear-attention-freq", "2", "--linear-num-key-heads", "2",
       "--linear-num-value-heads", "2", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8"]
# DeepSeek-V4's attention (a CSA and an HCA layer, window 8, blocks of 4 and 8): each document's halo, straddling
# blocks and entries over its group, its RoPE from its own start
V4 = ["--multi-latent-attention", "--qk-layernorm", "--num-query-groups", "4", "--q-lora-rank", "12", "--v-head-dim",
      "16", "--qk-pos-emb-head-dim", "4", "--experimental-attention-variant", "dsv4_hybrid", "--csa-compress-ratios",
      "[4,8]", "--csa-compress-ratio-for-h", "8", "--csa-window-size", "8", "--dsa-indexer-n-heads", "4",
      "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "2", "--o-groups", "2", "--o-lora-rank", "8"]
MTP = ["--mtp-num-layers", "2"] + ([] if MTP_PADDING_MASK else ["--moe-aux-loss-coeff", "0"])
M16 = ["--max-seqlen-per-dp-cp-rank", "16"]  # 4 DP x CP ranks: groups of 1 (<= 16 tokens), 2 (<= 32) and 4
RUNS = {  # 4 ranks each
    "dp2cp2": ["--context-parallel-size", "2"] + M16,
    "dp2cp2_balanced": ["--context-parallel-size", "2", "--sequence-packing-scheduler", "balanced"] + M16,
    "cp4_all_gather": ["--context-parallel-size", "4", "--cp-comm-type", "all_gather"] + M16,
    "tp2sp_cp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                  "--max-seqlen-per-dp-cp-rank", "32"],
    "dp2cp2_ep2": ["--context-parallel-size", "2", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                   "alltoall"] + M16,
    "cp4_recompute": ["--context-parallel-size", "4", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1"] + M16,
    "pp2_cp2": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank",
                "32", "--moe-token-dispatcher-type", "alltoall"],
    # static CP's sizes through the same path: every document on (at least) 2 ranks
    "dp2cp2_static_sizes": ["--context-parallel-size", "2", "--min-dynamic-context-parallel-size", "2",
                            "--max-seqlen-per-dp-cp-rank", "32"],
    "dp2cp2_windows": ["--context-parallel-size", "2"] + M16 + WINDOW_FLAGS,
    # MLA (q-LoRA, qk-layernorm, YaRN) with its RoPE at per-document positions: the latent ring and per-head K/V
    "dp2cp2_mla_latent": ["--context-parallel-size", "2", "--cp-mla-exchange", "latent"] + M16 + MLA_FLAGS,
    "dp2cp2_mla_kv": ["--context-parallel-size", "2", "--cp-mla-exchange", "kv"] + M16 + MLA_FLAGS,
    # MTP: each depth's shift of ids, labels and loss mask crosses the group's ranks (its pack's sequence); before
    # megatron-core 0.18 its layers' routers take no padding mask, so there without the router losses
    "dp2cp2_mtp": ["--context-parallel-size", "2"] + M16 + MTP,
    # Qwen3-Next's Gated DeltaNet on layer 1: each document's conv and state passed over its group in its zigzag
    "dp2cp2_gdn": ["--context-parallel-size", "2"] + M16 + GDN,
    "cp4_gdn": ["--context-parallel-size", "4"] + M16 + GDN,
    "dp2cp2_kda": ["--context-parallel-size", "2"] + M16 + KDA,  # Kimi Delta Attention: the same path
    "cp4_v4": ["--context-parallel-size", "4"] + M16 + V4,
    # and with its hyper-connections: the streams travel token-major through dynamic CP's packs
    "cp4_v4_hc": ["--context-parallel-size", "4"] + M16 + V4 + ["--enable-hyper-connections"],
}
# 6 ranks: cp_ext's scheduler makes groups of 3 (and 6), sizes that are not powers of two
RUNS_6 = {"dp3cp2_balanced": ["--context-parallel-size", "2", "--sequence-packing-scheduler", "balanced",
                              "--global-batch-size", "12", "--max-seqlen-per-dp-cp-rank", "11"]}
WORLD = {**{name: 4 for name in RUNS}, **{name: 6 for name in RUNS_6}}
# Megatron's static data path and static CP against dynamic CP on the documents it trained (one iteration; the
# router losses off: they balance experts over a microbatch, which the two paths pack differently)
_Z = MODEL.index("--moe-z-loss-coeff")
NO_ROUTER_LOSSES = MODEL[:_Z] + MODEL[_Z + 2:] + ["--moe-aux-loss-coeff", "0"]
STATIC_MODEL = [f for f in NO_ROUTER_LOSSES if f != "--dynamic-context-parallel"]
SAME_DOCUMENTS = {
    "static_dp2cp2": STATIC_MODEL + ["--context-parallel-size", "2", "--reset-attention-mask",
                                     "--reset-position-ids", "--eod-mask-loss"],
    # + --global-batch-size (the documents' count) and --data-path (their corpus), from the static run
    "dynamic_same_documents": NO_ROUTER_LOSSES + ["--context-parallel-size", "4", "--eod-mask-loss"] + M16,
}
RUNS.update(RUNS_6)
VARIANTS = {"--enable-hyper-connections": V4 + ["--enable-hyper-connections"],  # V4 with its streams
            "dsv4_hybrid": V4,  # before MLA: V4's flags hold --multi-latent-attention too
            "--window-size": WINDOW_FLAGS, "--multi-latent-attention": MLA_FLAGS, "--mtp-num-layers": MTP,
            "gated_delta_net": GDN, "kda": KDA}  # the linear variants by --experimental-attention-variant's value
PACKING_FLAGS = ("--max-seqlen-per-dp-cp-rank", "--min-dynamic-context-parallel-size", "--sequence-packing-scheduler",
                 "--global-batch-size")


def _packing(flags, world):
    """What decides a run's packs: its DP x CP ranks and its scheduler flags; and its model variant."""
    picked = tuple((f, flags[flags.index(f) + 1]) for f in PACKING_FLAGS if f in flags)
    model_parallel = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        model_parallel *= int(flags[flags.index(flag) + 1]) if flag in flags else 1
    return picked + (("world", str(world // model_parallel)),), next((v for v in VARIANTS if v in flags), None)  # flags or a flag's value


# One process, MLA with the aux loss off (the one term that depends on the packing): the packs of dp2cp2, and
# every document of them alone. Equal only if attention stays inside each document. (Each document's RoPE
# restarts at 0 too, but RoPE scores depend on relative positions only: a shift shows in rounding alone.)
ALONE = {"mla_packed": False, "mla_alone": True}
ALONE_FLAGS = ["--max-seqlen-per-dp-cp-rank", str(SEQ), "--moe-aux-loss-coeff", "0"] + MLA_FLAGS

REFERENCES = {}  # the single-process runs: "ref<i>" -> (packing, flags)
for _name, _flags in RUNS.items():
    key = _packing(_flags, WORLD[_name])
    if key not in [v[0] for v in REFERENCES.values()]:
        picked, variant = key
        scheduler = [x for f, v in picked if f in ("--sequence-packing-scheduler", "--global-batch-size")
                     for x in (f, v)]
        REFERENCES[f"ref{len(REFERENCES)}"] = (key, ["--max-seqlen-per-dp-cp-rank", str(SEQ)] + scheduler
                                               + VARIANTS.get(variant, []))


def reference_of(name):
    return next(ref for ref, (key, _) in REFERENCES.items() if key == _packing(RUNS[name], WORLD[name]))


def write_documents(prefix, num_documents=200, seed=3):
    """ByteTokenizer documents of lognormal lengths (median 20 tokens, 2 to 150), each ending with EOD."""
    import numpy as np

    from cp_ext.data.indexed import IndexedDatasetWriter
    from cp_ext.data.tokenizers import build_tokenizer

    eod = build_tokenizer("ByteTokenizer", None).eod
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for n in np.clip(rng.lognormal(np.log(20), 1.0, num_documents), 2, 150).astype(int):
        writer.add(np.append(rng.integers(32, 127, n - 1), eod))
    writer.finalize()
    writer.commit()
    return str(prefix)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("dcp_docs") / "docs")


@pytest.fixture(scope="module")
def runs(documents):
    done = {}

    def get(name):
        # a single-process run, a run of 4 or 6 ranks, or what the 4-rank launch adds (dp2cp2_resumed, ...)
        world = 1 if name in REFERENCES or name in ALONE else WORLD.get(name, 4)
        if world not in done:
            names = list(REFERENCES) + list(ALONE) if world == 1 else [n for n in RUNS if WORLD[n] == world]
            names += list(SAME_DOCUMENTS) if world == 4 else []
            results = launch(__file__, world, "--runs", ",".join(names), "--docs", documents, timeout=900)
            done[world] = {n: _gather_run(results, n, world) for n in names}
            done[world].update({k: v for k, v in results[0].items() if k.startswith("dp2cp2_")
                                and k not in RUNS})
            if world == 4:
                done[world]["dp2cp2_all ranks"] = [results[r]["dp2cp2"] for r in sorted(results)]
        return done[world][name]

    return get


def _gather_run(results, name, world):
    flags = REFERENCES[name][1] if name in REFERENCES else ALONE_FLAGS if name in ALONE else \
        SAME_DOCUMENTS[name] if name in SAME_DOCUMENTS else RUNS[name]
    return _gather(results, name, world, flags=flags)


@pytest.mark.parametrize("name", list(RUNS))
def test_dynamic_cp_matches_single_process(name, runs):
    _assert_same(runs(name), runs(reference_of(name)), GDN_TOLERANCES if "--experimental-attention-variant" in RUNS[name]
                 else None, no_main_loss_grad=(".indexer.",))  # V4's indexer selects; the loss does not reach it


def test_dynamic_cp_matches_static_cp_on_the_same_documents(runs):
    """Static CP 2 over megatron's GPTDataset samples (packed documents), and dynamic CP over those samples'
    documents on groups of 1, 2 and 4: the same lm loss, grad norm and parameter gradients."""
    static, dynamic = runs("static_dp2cp2"), runs("dynamic_same_documents")
    assert len(dynamic[0]["lm loss"]) == len(static[0]["lm loss"]) == 1
    assert dynamic[0]["documents"] == static[0]["documents"] > 8, "every document of the 8 samples, once"
    assert {1, 2, 4} <= set(dynamic[0]["sizes"]), dynamic[0]["sizes"]
    _assert_same(dynamic, static)


def test_documents_run_on_every_group_size(runs):
    """The corpus and budget exercise CP 1, 2 and 4 in the same step (1, 2, 3 and 6 at 6 ranks with cp_ext's
    scheduler); static sizes never use 1."""
    assert 3 in runs("dp3cp2_balanced")[0]["sizes"], runs("dp3cp2_balanced")[0]["sizes"]
    assert {1, 2, 4} <= set(runs("dp2cp2")[0]["sizes"]), runs("dp2cp2")[0]["sizes"]
    assert {1, 2, 4} <= set(runs("dp2cp2_balanced")[0]["sizes"]), runs("dp2cp2_balanced")[0]["sizes"]
    assert 1 not in runs("dp2cp2_static_sizes")[0]["sizes"]
    assert all(set(runs(ref)[0]["sizes"]) == {1} for ref in REFERENCES)


def test_aux_losses_are_logged(runs):
    """Both MoE losses are on (the reference's router applies them, so matching gradients include them)."""
    for name in ("dp2cp2", "dp2cp2_ep2", "tp2sp_cp2"):
        assert runs(name)[0]["load balancing loss"][0] > 0.5 and runs(name)[0]["z loss"][0] > 0, name


def test_the_plan_is_logged(runs):
    """The log's plan fields (`StepPlan.metrics`) and their line (`cp_ext.training.logging.IterationLog`)."""
    import io
    from types import SimpleNamespace

    from cp_ext.training.logging import IterationLog

    plan = dict(runs("dp2cp2")[0]["plan"])
    assert plan.pop("lengths") and plan["dynamic cp tokens"] == sum(runs("dp2cp2")[0]["plan"]["lengths"])
    assert 1.0 <= plan["dynamic cp work max/mean"] < 2.0 and plan["dynamic cp exchange vs static"] > 0
    assert runs("dp2cp2_static_sizes")[0]["plan"]["dynamic cp exchange vs static"] >= 1.0  # never fewer hops
    stream = io.StringIO()
    log = IterationLog(SimpleNamespace(train_iters=2, log_interval=1, global_batch_size=8), 512, stream=stream)
    log.record(2, 16, 1.0, {"lm loss": 5.0, "grad norm": 0.5, "learning rate": 1e-3, **plan})
    line = stream.getvalue()
    assert "dynamic cp documents per size: " in line and "dynamic cp work max/mean: " in line, line
    assert f"tokens per second: {plan['dynamic cp tokens']:.1f}" in line, line


def test_resume_mid_epoch_reproduces_the_uninterrupted_run(runs):
    """The plan depends only on the data and the step: iteration 2 after a checkpoint at iteration 1 trains on
    the same documents in the same groups, with the same losses and grad norm (bit for bit on one machine)."""
    resumed, uninterrupted = runs("dp2cp2_resumed"), runs("dp2cp2")[0]
    assert resumed["start"] == 1 and resumed["lengths"] == runs("dp2cp2_lengths")
    for key in ("lm loss", "load balancing loss", "z loss", "grad norm"):
        assert resumed[key] == uninterrupted[key][1], (key, resumed[key], uninterrupted[key][1])


def test_counted_pairs_equal_the_ring_s_work_counter(runs):
    """`cp_ext.bench.dynamic_cp`'s count (the benchmark's) against what the ring counted computing on every rank:
    each layer's forward over the documents of the rank's groups of 2 and 4 (a group of 1 runs locally)."""
    from cp_ext.bench.dynamic_cp import zigzag_pairs

    _, results = runs("dp2cp2"), runs("dp2cp2_all ranks")
    for rank, result in enumerate(results):
        expected = 0
        for groups in result["plan 1"]:
            for first, size, lengths in groups:
                if size > 1 and first <= rank < first + size:
                    expected += sum(zigzag_pairs(n, size, padding=True)[rank - first] for n in lengths)
        assert expected > 0 and result["ring pairs"] == 2 * expected, (rank, result["ring pairs"], expected)


def test_windows_change_training(runs):
    assert abs(runs("dp2cp2_windows")[0]["lm loss"][1] - runs("dp2cp2")[0]["lm loss"][1]) > 1e-4


def test_documents_are_independent_of_their_pack(runs):
    """A pack of documents trains as its documents alone (aux loss off): nothing crosses a document, MLA included."""
    _assert_same(runs("mla_packed"), runs("mla_alone"))


def test_mla_exchanges_the_latent_where_asked(runs):
    assert runs("dp2cp2_mla_latent")[0]["latent exchange"] == [True]
    assert runs("dp2cp2_mla_kv")[0]["latent exchange"] == [False]


def test_cp_aware_recompute_replays(runs):
    assert runs("cp4_recompute")[0]["replayed"] > 0


# ----------------------------------------------------------------------------- worker
def _same_packs(dynamic_of_run, alone=False):
    """plan_step for one process that runs another run's packs (its DP x CP groups), one pack per microbatch;
    ``alone``: every document of them in a microbatch of its own instead."""
    from cp_ext.data.dynamic_schedule import Group, Microbatch, Schedule
    from cp_ext.training import dynamic_batches

    original = dynamic_batches.plan_step

    def plan_step(dataset, consumed_samples, global_batch_size, dynamic):
        run = original(dataset, consumed_samples, global_batch_size, dynamic_of_run(dynamic))
        packs = [Microbatch([Group(0, 1, list(docs))]) for mb in run.schedule.microbatches for g in mb.groups
                 for docs in ([[d] for d in g.documents] if alone else [g.documents])]
        return dynamic_batches.StepPlan(run.sample_ids, run.lengths, Schedule(1, run.lengths, packs))

    return original, plan_step


def _model(flags):
    """MODEL for a run's flags: before megatron-core 0.18 an MTP run trains without the router losses."""
    if "--mtp-num-layers" in flags and not MTP_PADDING_MASK:
        at = MODEL.index("--moe-z-loss-coeff")
        return MODEL[:at] + MODEL[at + 2:]
    return MODEL


def _train(args, steps=2, inspect=None):
    """``steps`` iterations; ``inspect(trainer)`` after them, before the trainer shuts down."""
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer
    from cp_ext.transformer.attention import CoreAttention
    from cp_ext.transformer.mla import ContextParallelMLASelfAttention

    trainer = Trainer(parse_args(args))
    history, grads, sizes = {"lm loss": [], "load balancing loss": [], "z loss": [], "grad norm": []}, None, set()
    from cp_ext.perf.counter import count_work

    plan = None
    for step in range(steps):
        with count_work() as counted:
            metrics = trainer.train_step()
        plan = trainer.dynamic_plan if trainer.args.dynamic_context_parallel else None
        if step == 0 and plan:  # what the ring computed (forward), beside the plan it ran (test_counted_pairs_...)
            first = {"ring pairs": counted.bytes["pairs"],
                     "plan 1": [[(g.first, g.size, [plan.lengths[d] for d in g.documents])
                                 for g in mb.groups] for mb in plan.schedule.microbatches]}
        for key in [k for k in metrics if k.startswith("mtp_")]:
            history.setdefault(key, [])
        for key in history:
            history[key].append(metrics.get(key, 0.0))
        sizes |= {int(k.rsplit(" ", 1)[1]) for k in metrics if k.startswith("dynamic cp documents at size")}
        if grads is None:
            grads = _grad_slices(trainer.model[0].module)
    history["sizes"] = sorted(sizes)
    if plan:
        history.update(first)
        history["plan"] = {k: v for k, v in metrics.items() if k.startswith("dynamic cp ")}
        history["plan"]["lengths"] = plan.lengths
    modules = list(trainer.model[0].module.modules())
    history["replayed"] = sum(m.kept.replayed for m in modules if isinstance(m, CoreAttention))
    history["latent exchange"] = sorted({m.latent_exchange() for m in modules
                                         if isinstance(m, ContextParallelMLASelfAttention)})
    if inspect is not None:
        history.update(inspect(trainer))
    trainer.shutdown(keep_process_group=True)
    return history, grads


def _resume(args, directory):
    """One iteration, a checkpoint, a new trainer from it (mid-epoch: 8 of 200 documents seen), one more."""
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    trainer = Trainer(parse_args(args))
    trainer.train_step()
    trainer.checkpointer.save(directory)
    trainer.shutdown(keep_process_group=True)
    dist.barrier()
    trainer = Trainer(parse_args(args + ["--load", str(directory)]))
    start = trainer.iteration
    metrics = trainer.train_step()
    out = {"start": start, "lengths": trainer.dynamic_plan.lengths,
           **{key: metrics[key] for key in ("lm loss", "load balancing loss", "z loss", "grad norm")}}
    trainer.shutdown(keep_process_group=True)
    return out


def _documents_of_static_batch(prefix):
    """``inspect`` for the static run: the documents of its first global batch as the model saw them (cut at
    the sample's edges, split after each EOD; `cp_ext.data.documents`), written by rank 0 as a corpus at
    ``prefix``, one indexed document each: the document's inputs and its last label."""
    import numpy as np
    import torch.distributed as dist

    from cp_ext.data.documents import document_ids
    from cp_ext.data.indexed import IndexedDatasetWriter

    def inspect(trainer):
        documents = []
        if dist.get_rank() == 0:
            for i in range(trainer.args.global_batch_size):
                sample = trainer.dataset[i]
                tokens, labels = sample["tokens"], sample["labels"]
                ids = document_ids(tokens, trainer.dataset.eod)
                for d in torch.unique(ids):
                    at = torch.nonzero(ids == d).flatten()
                    documents.append(torch.cat([tokens[at], labels[at[-1:]]]).numpy())
            writer = IndexedDatasetWriter(str(prefix), np.uint16)
            for doc in documents:
                writer.add(doc)
            writer.finalize()
            writer.commit()
        count = [len(documents)]
        dist.broadcast_object_list(count, src=0)
        return {"documents": count[0]}

    return inspect


def worker():
    import os
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:], required=["--runs", "--docs"])
    results = {"results_dir": opts.results_dir}
    from cp_ext.training import dynamic_batches

    for name in opts.runs.split(","):
        if name in REFERENCES:
            picked = dict(REFERENCES[name][0][0])
            budget = int(picked["--max-seqlen-per-dp-cp-rank"])
            smallest = int(picked.get("--min-dynamic-context-parallel-size", 1))
            original, dynamic_batches.plan_step = _same_packs(lambda d: dataclasses.replace(
                d, world=int(picked["world"]), max_tokens_per_rank=budget, min_size=smallest))
            try:
                results[name], grads = _train(_model(REFERENCES[name][1]) + REFERENCES[name][1]
                                              + ["--data-path", opts.docs])
            finally:
                dynamic_batches.plan_step = original
        elif name in ALONE:
            original, dynamic_batches.plan_step = _same_packs(
                lambda d: dataclasses.replace(d, world=4, max_tokens_per_rank=16), alone=ALONE[name])
            try:
                results[name], grads = _train(MODEL + ALONE_FLAGS + ["--data-path", opts.docs])
            finally:
                dynamic_batches.plan_step = original
        elif name == "static_dp2cp2":
            same_documents = Path(opts.results_dir) / "same_documents"
            results[name], grads = _train(SAME_DOCUMENTS[name] + ["--data-path", opts.docs], steps=1,
                                          inspect=_documents_of_static_batch(same_documents))
        elif name == "dynamic_same_documents":  # one global batch: every document of the static run's, once
            count = results["static_dp2cp2"]["documents"]
            results[name], grads = _train(SAME_DOCUMENTS[name] + ["--global-batch-size", str(count), "--data-path",
                                                                  str(same_documents)], steps=1)
            results[name]["documents"] = len(results[name]["plan"]["lengths"])
        else:
            results[name], grads = _train(_model(RUNS[name]) + RUNS[name] + ["--data-path", opts.docs])
        torch.save(grads, Path(opts.results_dir, f"grads_{name}_rank{os.environ['RANK']}.pt"))
    if "dp2cp2" in results:
        results["dp2cp2_resumed"] = _resume(MODEL + RUNS["dp2cp2"] + ["--data-path", opts.docs],
                                            Path(opts.results_dir) / "checkpoint")
        results["dp2cp2_lengths"] = results["dp2cp2"]["plan"]["lengths"]
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
