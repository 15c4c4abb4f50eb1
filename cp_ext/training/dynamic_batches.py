"""Dynamic context parallelism's microbatches (Megatron-LM's ``--dynamic-context-parallel``): every document of the global batch on a CP group of
its own size, the microbatches each DP x CP rank runs, and their tensors.

    global batch  = --global-batch-size documents after ``consumed_samples`` (`cp_ext.data.variable_length`)
    schedule      = --sequence-packing-scheduler over DP x CP ranks (`cp_ext.data.dynamic_schedule`):
                    per microbatch, aligned groups of ranks and the documents each runs
    this rank     = its group in each microbatch -> the group's documents, each padded to a multiple of
                    2 x size and zigzagged over the group on its own (`cp_ext.token_partition.DocumentZigzag`),
                    this rank's positions of them, with the group in megatron's PackedSeqParams seat
                    (`cp_ext.transformer.dynamic_cp.DynamicCPParams`)

Every rank computes the same schedule from the same lengths (read from the dataset's index, no collective),
so the plan depends only on the data and the step: a resumed run makes the same decisions. Every rank runs
every microbatch of the schedule; in one where it is in no group it runs a two-token padding sequence that
attends to nothing and counts no loss, so collectives outside the groups (the pipeline, expert parallelism's
all-to-all) stay in step. Document ids separate the documents (their padding tails are documents of their
own, the trailing padding has id -1) and position ids restart at 0 in each, as at CP 1 on one document.
The per-token loss sums over the tokens each rank holds: every token is on exactly one rank, so megatron's
``finalize_model_grads`` (the token count summed over DP x CP) gives the same mean as CP 1.
"""

from dataclasses import dataclass
from typing import List

import torch
from megatron.core import parallel_state

from cp_ext import parallel_state as cp_state
from cp_ext.data.dynamic_schedule import CostModel, Schedule, balanced_schedule, group_sizes, megatron_schedule
from cp_ext.token_partition import DocumentZigzag
from cp_ext.training.batches import Microbatch, global_batch_sample_ids
from cp_ext.training.metric_names import DYNAMIC_CP_PREFIX
from cp_ext.transformer.dynamic_cp import DynamicCPParams

SCHEDULERS = ("default_dynamic_cp", "balanced")
PADDING_ID = -1


@dataclass(frozen=True)
class DynamicCP:
    """A run's dynamic-CP settings (from the flags): ``world`` DP x CP ranks, the per-rank token budget
    (--max-seqlen-per-dp-cp-rank), the group sizes, the scheduler and its cost model."""

    world: int
    max_tokens_per_rank: int
    min_size: int = 1
    scheduler: str = "default_dynamic_cp"
    cost: CostModel = CostModel()

    @property
    def sizes(self) -> List[int]:
        return group_sizes(self.world, self.min_size, power_of_two=self.scheduler == "default_dynamic_cp")

    def schedule(self, lengths) -> Schedule:
        if self.scheduler == "default_dynamic_cp":
            return megatron_schedule(lengths, self.world, self.max_tokens_per_rank, self.min_size)
        return balanced_schedule(lengths, self.world, self.max_tokens_per_rank, self.sizes, self.cost)

    @classmethod
    def from_args(cls, args, world: int) -> "DynamicCP":
        return cls(world, args.max_seqlen_per_dp_cp_rank, args.min_dynamic_context_parallel_size,
                   args.sequence_packing_scheduler, cost_model(args))


def cost_model(args) -> CostModel:
    """The scheduler's cost per token besides attention, in query-key pairs' work: the layer's linear work
    (attention projections, the active experts' or the dense MLP) over one pair's (QK^T and PV per head)."""
    hidden, heads = args.hidden_size, args.num_attention_heads
    head_dim = args.kv_channels or hidden // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    projections = hidden * head_dim * (2 * heads + 2 * groups)
    ffn = args.moe_ffn_hidden_size if args.num_experts else args.ffn_hidden_size
    mlp = (3 if args.swiglu else 2) * hidden * ffn * (args.moe_router_topk if args.num_experts else 1)
    pair = 2 * heads * head_dim  # multiply-adds of one query-key pair: q.k and p.v over the heads
    per_token = (projections + mlp) / pair
    exchange = 2 * groups * head_dim / pair  # K/V values a token sends per hop, as one pair's work per value
    return CostModel(per_token=per_token, exchange_per_token=exchange)


@dataclass
class StepPlan:
    """One global batch's plan: the dataset indices, their lengths and the schedule."""

    sample_ids: List[int]
    lengths: List[int]
    schedule: Schedule

    def metrics(self, dynamic: "DynamicCP", static_cp: int) -> dict:
        """What the log shows of the plan: documents per group size, the modelled work of the most loaded rank
        over the mean (1.0: balanced), the K/V token-hops over static CP's (every document over
        --context-parallel-size ranks; a document on c ranks: each token c - 1 hops; above 1 where groups grew
        onto ranks that would idle), and the tokens trained on."""
        out = {f"{DYNAMIC_CP_PREFIX}documents at size {c}": n for c, n in self.schedule.sizes_used().items()}
        out[f"{DYNAMIC_CP_PREFIX}microbatches"] = len(self.schedule.microbatches)
        out[f"{DYNAMIC_CP_PREFIX}work max/mean"] = work_balance(self.schedule, dynamic.cost)
        hops = sum(self.lengths[d] * (g.size - 1) for mb in self.schedule.microbatches for g in mb.groups
                   for d in g.documents)
        static = sum(self.lengths) * (static_cp - 1)
        out[f"{DYNAMIC_CP_PREFIX}exchange vs static"] = hops / static if static else float(hops > 0)
        out[f"{DYNAMIC_CP_PREFIX}tokens"] = sum(self.lengths)
        return out


def plan_step(dataset, consumed_samples: int, global_batch_size: int, dynamic: DynamicCP) -> StepPlan:
    ids = global_batch_sample_ids(consumed_samples, global_batch_size, len(dataset)).tolist()
    lengths = [dataset.length(i) for i in ids]
    return StepPlan(ids, lengths, dynamic.schedule(lengths))


def _pad_to(n: int, multiple: int) -> int:
    return n + (-n) % multiple


def dynamic_microbatches(dataset, plan: StepPlan, *, rank: int, device, tp_multiple: int = 1,
                         first_stage: bool = True, last_stage: bool = True) -> List[Microbatch]:
    """The microbatches DP x CP rank ``rank`` runs in ``plan``'s global batch, in schedule order.
    ``tp_multiple``: what a rank's tokens must divide by (TP with sequence parallelism)."""
    out = []
    for mb in plan.schedule.microbatches:
        group = mb.group_of(rank)
        if group is None:
            out.append(_padding_microbatch(device, tp_multiple, first_stage, last_stage))
            continue
        samples = [dataset[plan.sample_ids[d]] for d in group.documents]
        out.append(_group_microbatch(samples, [plan.sample_ids[d] for d in group.documents], group.first, group.size,
                                     rank - group.first, device, tp_multiple, first_stage, last_stage))
    return out


def _group_microbatch(samples, sample_ids, first, size, rank_in_group, device, tp_multiple, first_stage, last_stage):
    """The group's documents, each padded to a multiple of 2 x size (the tail a document of its own), trailing
    padding so the rank's share divides by ``tp_multiple``; this rank's positions of them."""
    columns = {key: [] for key in ("tokens", "labels", "loss_mask", "position_ids", "document_ids", "padding")}
    lengths, doc_id = [], 0
    for sample in samples:
        n = sample["tokens"].numel()
        padded = _pad_to(n, 2 * size)
        _append(columns, sample, n, padded, doc_id)
        lengths.append(padded)
        doc_id += 2
    share = sum(lengths) // size
    extra = 0
    while (share + 2 * extra) % tp_multiple:
        extra += 1
    if extra:  # trailing padding: 2 x size x extra tokens, `extra` x 2 more per rank
        _append(columns, None, 0, 2 * size * extra, PADDING_ID)
        lengths.append(2 * size * extra)
    layout = DocumentZigzag(tuple(lengths), size)
    positions = layout.positions(rank_in_group)
    full = {key: torch.cat(parts) for key, parts in columns.items()}
    local = {key: value[positions].unsqueeze(0).contiguous().to(device) for key, value in full.items()}
    return Microbatch(
        tokens=local["tokens"] if first_stage else None,
        labels=local["labels"] if last_stage else None,
        loss_mask=local["loss_mask"].float() if last_stage else None,
        position_ids=local["position_ids"],
        sample_ids=sample_ids,
        document_ids=local["document_ids"],
        packed_seq_params=DynamicCPParams.for_group(
            cp_state.get_dynamic_group(first, size), layout, router_group=cp_state.get_dynamic_router_group(first, size),
            padding_mask=local["padding"], valid_tokens=sum(s["tokens"].numel() for s in samples),
            position_ids=local["position_ids"]),
    )


def _append(columns, sample, n, padded, doc_id):
    """One document (``n`` tokens of ``sample``, none for padding) and its padding up to ``padded`` tokens."""
    pad = padded - n
    zeros = torch.zeros(pad, dtype=torch.int64)
    if sample is not None:
        columns["tokens"] += [sample["tokens"], zeros]
        columns["labels"] += [sample["labels"], zeros]
        columns["loss_mask"] += [sample["loss_mask"].float(), torch.zeros(pad)]
        columns["position_ids"] += [torch.arange(n), zeros]
        columns["document_ids"] += [torch.full((n,), doc_id), torch.full((pad,), doc_id + 1)]
        columns["padding"] += [torch.zeros(n, dtype=torch.bool), torch.ones(pad, dtype=torch.bool)]
        return
    columns["tokens"].append(zeros)
    columns["labels"].append(zeros)
    columns["loss_mask"].append(torch.zeros(pad))
    columns["position_ids"].append(zeros)
    columns["document_ids"].append(torch.full((pad,), doc_id))
    columns["padding"].append(torch.ones(pad, dtype=torch.bool))


def _padding_microbatch(device, tp_multiple, first_stage, last_stage):
    """Two tokens per TP rank of padding at CP 1: nothing attends to them, no loss (an idle rank's turn)."""
    n = 2 * tp_multiple
    zeros = torch.zeros(1, n, dtype=torch.int64, device=device)
    return Microbatch(
        tokens=zeros if first_stage else None, labels=zeros if last_stage else None,
        loss_mask=torch.zeros(1, n, device=device) if last_stage else None, position_ids=zeros,
        sample_ids=[], document_ids=torch.full((1, n), PADDING_ID, dtype=torch.int64, device=device),
        packed_seq_params=DynamicCPParams.for_group(
            None, DocumentZigzag((n,), 1), router_group=parallel_state.get_tensor_model_parallel_group(),
            padding_mask=torch.ones(1, n, dtype=torch.bool, device=device), position_ids=zeros),
    )


def work_balance(schedule: Schedule, cost: CostModel) -> float:
    """The modelled step (sum over microbatches of the most loaded rank) over its mean: 1.0 is perfect."""
    rows = schedule.rank_work(cost)
    step = sum(max(r) for r in rows)
    mean = sum(sum(r) for r in rows) / schedule.world
    return step / mean if mean else 1.0
