"""The one entry point of linear attention (the gated delta rule) under CP: picks the method.

    method="state_passing"   segment summaries exchanged (`state_passing`), ``exchange`` "all_gather" or "ring";
                             with ``ulysses_group``: the Ulysses x state-passing hybrid (`head_parallel`)
    method="all_to_all"      head parallelism, megatron-core's (`head_parallel`): heads divisible by C

Every method takes this rank's tokens in the same layout and returns what `gated_delta_rule` gives on the
whole sequence at this rank's positions, so a model can switch methods without touching its data path.
Which to pick: state passing moves O(K (K + V)) per head and segment and runs at any CP size; the
all-to-all moves O(s d) per rank but no sequential chain; `cp_ext.perf.comm` has the bytes of each.
"""

from typing import Optional

from cp_ext.linear_attention.head_parallel import head_parallel_gated_delta, ulysses_state_passing
from cp_ext.linear_attention.state_passing import context_parallel_gated_delta

METHODS = ("state_passing", "all_to_all")


def context_parallel_linear_attention(q, k, v, g, beta, *, group, layout: str = "zigzag", document_ids=None,
                                      method: str = "state_passing", exchange: str = "all_gather",
                                      ulysses_group=None, chunk_size: int = 64, scale: Optional[float] = None,
                                      qk_l2norm: bool = False, kernel: str = "auto"):
    """o [b, s_local, h_v, V] of this rank's shard (arguments as `context_parallel_gated_delta`).

    ``group``: the ranks the sequence is sharded over by ``layout`` (with ``ulysses_group``: the ring
    group of the hybrid, whose tokens are laid out as `cp_ext.token_partition.context_parallel_positions`
    lays out the Ulysses x ring grid). ``exchange``: state passing's; ``method="all_to_all"`` takes none.
    ``kernel``: the rule's ("auto", "torch", "fla"; `cp_ext.linear_attention.gated_delta`).
    """
    if method not in METHODS:
        raise ValueError(f"linear attention's CP method is one of {METHODS}, not {method!r}")
    kw = dict(layout=layout, document_ids=document_ids, chunk_size=chunk_size, scale=scale, qk_l2norm=qk_l2norm,
              kernel=kernel)
    if method == "all_to_all":
        if ulysses_group is not None:
            raise ValueError("method='all_to_all' splits the heads over the whole group: ulysses_group is for the "
                             "state-passing hybrid (method='state_passing')")
        return head_parallel_gated_delta(q, k, v, g, beta, group=group, **kw)
    if ulysses_group is not None:
        return ulysses_state_passing(q, k, v, g, beta, ulysses_group=ulysses_group, ring_group=group,
                                     exchange=exchange, **kw)
    return context_parallel_gated_delta(q, k, v, g, beta, group=group, exchange=exchange, **kw)
