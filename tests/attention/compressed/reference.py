"""An independent whole-sequence reference of DeepSeek-V4's attention, and the test inputs.

`reference` follows transformers' ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` /
``DeepseekV4Indexer`` / ``eager_attention_forward`` line by line, one document at a time (each
document is a sequence of its own, as a packed sample means), with dense masks: nothing of
cp_ext's plan, tables or tiles. The one choice transformers leaves open, ties in the indexer's
top-k, is made as cp_ext makes it: the earlier entry wins. ``test_reference_is_transformers``
pins it to transformers' module.

`inputs` draws a case's tensors: the indexer's queries are non-negative on their non-RoPE channels
and zero on the RoPE ones, and each block's indexer rows share one sign, so two entries in three
score exactly 0 for every query (V4's ReLU), which puts the top-k boundary inside runs of ties.
"""

import math

import torch

D, ROPE, HEADS = 16, 4, 4  # head dim, its RoPE channels, query heads
DI, IDX_HEADS = 8, 16  # indexer head dim, heads (many heads: most scores a sum of ReLUs)
EPS = 1e-6
RATES = {"hca": 8, "csa": 4}


def inv_freq(dim=ROPE, theta=160000.0):
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rope(x, positions, freq, sign=1.0):
    """transformers' V4 ``apply_rotary_pos_emb`` on [n, ..., d] at ``positions`` [n]."""
    f = positions.to(torch.float64).unsqueeze(-1) * freq
    shape = (f.shape[0],) + (1,) * (x.dim() - 2) + (f.shape[1],)
    cos, sin = f.cos().view(shape).repeat_interleave(2, -1), (sign * f.sin()).view(shape).repeat_interleave(2, -1)
    rd = cos.shape[-1]
    r = x[..., -rd:]
    rot = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], (r.to(cos.dtype) * cos + rot.to(cos.dtype) * sin).to(x.dtype)], dim=-1)


def norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def compress(rows, bias, weight, rate, width, overlap, freq):
    """One document's entries: transformers' compressor without a cache. rows [n, 2F] = [kv | gate]."""
    n = rows.shape[0]
    windows = n // rate
    if windows == 0:
        return rows.new_zeros((0, width))
    half = rows.shape[1] // 2
    kv = rows[:windows * rate, :half].view(windows, rate, half)
    gate = rows[:windows * rate, half:].view(windows, rate, half) + bias
    if overlap:
        new_kv = kv.new_zeros((windows, 2 * rate, width))
        new_gate = gate.new_full((windows, 2 * rate, width), float("-inf"))
        new_kv[:, rate:], new_gate[:, rate:] = kv[..., width:], gate[..., width:]
        new_kv[1:, :rate], new_gate[1:, :rate] = kv[:-1, :, :width], gate[:-1, :, :width]
        kv, gate = new_kv, new_gate
    entries = norm((kv * gate.softmax(dim=1)).sum(dim=1), weight)
    return rope(entries, torch.arange(windows) * rate, freq)


def topk_earliest_first(scores, k):
    """Indices of the k best of each row, ties to the lower index: a stable descending sort."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def document(t, kind, window, topk, comp=None, idx=None):
    """One document's attention output [n, H, D]; t: dict of this document's tensors (rows first). No "sinks" in
    ``t``: no sink logit; ``topk`` None: CSA reads every complete entry (``--csa-dense-mode``)."""
    q, kv, sinks = t["q"], t["kv"], t.get("sinks")
    n = q.shape[0]
    i = torch.arange(n)
    logits = torch.einsum("thd,jd->htj", q, kv) * D ** -0.5
    logits = logits.masked_fill(~((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)), float("-inf"))
    values = kv
    if kind != "sliding":
        rate = RATES[kind]
        entries = compress(t["comp_rows"], t["comp_bias"], t["comp_norm"], rate, D, kind == "csa", inv_freq())
        count = entries.shape[0]
        readable = torch.arange(count)[None, :] < ((i + 1) // rate)[:, None]  # [n, E]
        if kind == "csa" and count and topk is not None:
            keys = compress(t["idx_rows"], t["idx_bias"], t["idx_norm"], rate, DI, True, inv_freq())
            scores = torch.einsum("thd,ed->the", t["idx_q"], keys).relu()
            scores = (scores * t["idx_w"].unsqueeze(-1)).sum(1).masked_fill(~readable, float("-inf"))
            chosen = topk_earliest_first(scores, min(topk, count))
            picked = torch.zeros_like(readable).scatter_(1, chosen, True)
            readable = readable & picked
        entry_logits = torch.einsum("thd,ed->hte", q, entries) * D ** -0.5
        logits = torch.cat([logits, entry_logits.masked_fill(~readable, float("-inf"))], dim=-1)
        values = torch.cat([kv, entries])
    if sinks is None:
        probs = logits.softmax(-1)
    else:
        probs = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, n, 1)], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("htj,jd->thd", probs, values)


def reference(t, kind, window, topk, lengths):
    """The whole sequence (documents of ``lengths``, in order), one document at a time: out [S, H, D]."""
    outs, start = [], 0
    per_token = ("q", "kv", "comp_rows", "idx_rows", "idx_q", "idx_w")
    for n in lengths:
        part = {k: (v[start:start + n] if k in per_token else v) for k, v in t.items()}
        outs.append(document(part, kind, window, topk))
        start += n
    return torch.cat(outs)


def document_lengths(s, docs):
    """Packed documents of uneven lengths: some shorter than a block, one starting mid-shard."""
    if not docs:
        return [s]
    cuts = sorted({3, s // 3 + 1, s // 2 + 2, s - 5})
    return [b - a for a, b in zip([0] + cuts, cuts + [s])]


def inputs(kind, s, seed, dtype=torch.float64, sinks=True):
    """The case's leaves (float64, requires_grad where the loss reaches them) and the output gradient; ``sinks``
    False: none (``--csa-no-attention-sink``)."""
    g = torch.Generator().manual_seed(seed)
    rate = RATES.get(kind, 4)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale)

    t = {"q": randn(s, HEADS, D), "kv": randn(s, D), "sinks": randn(HEADS, scale=0.5)}
    if kind != "sliding":
        width = 2 * D if kind == "csa" else D
        t["comp_rows"] = randn(s, 2 * width)
        t["comp_bias"] = randn(rate, width, scale=0.5)
        t["comp_norm"] = 1 + randn(D, scale=0.1)
    if kind == "csa":
        # every third entry scores > 0, the rest exactly 0: early queries tie at the k-th place, late ones do not
        block_sign = torch.where(torch.arange(s // rate + 2) % 3 == 0, 1.0, -1.0).to(torch.float64)
        sign = block_sign[torch.arange(s) // rate]
        next_sign = block_sign[torch.arange(s) // rate + 1]
        kv_rows = randn(s, 2 * DI).abs()
        kv_rows[:, :DI] *= next_sign[:, None]  # Ca feeds the next block's entry: its sign
        kv_rows[:, DI:] *= sign[:, None]
        t["idx_rows"] = torch.cat([kv_rows, randn(s, 2 * DI)], dim=1)
        t["idx_bias"] = randn(rate, 2 * DI, scale=0.5)
        t["idx_norm"] = 1 + randn(DI, scale=0.1).abs()
        q_idx = randn(s, IDX_HEADS, DI).abs()
        q_idx[..., -DI // 2:] = 0  # the RoPE channels: the entries' rotation must not mix signs in
        t["idx_q"] = q_idx
        t["idx_w"] = randn(s, IDX_HEADS).abs() * (IDX_HEADS * DI) ** -0.5
    grad = randn(s, HEADS, D)
    if not sinks:
        del t["sinks"]
    t = {k: v.to(dtype) for k, v in t.items()}
    for k in ("q", "kv", "sinks", "comp_rows", "comp_bias", "comp_norm"):
        if k in t:
            t[k].requires_grad_(True)
    return t, grad.to(dtype)


GRAD_TENSORS = ("q", "kv", "sinks", "comp_rows", "comp_bias", "comp_norm")


def forward_backward(fn, t, grad):
    """fn(t) -> out; returns {"out": out, name: grad} for every leaf with a gradient (detached)."""
    for v in t.values():
        v.grad = None
    out = fn(t)
    out.backward(grad)
    res = {"out": out.detach()}
    for k in GRAD_TENSORS:
        if k in t:
            res[k] = t[k].grad.detach().clone() if t[k].grad is not None else torch.zeros_like(t[k])
    return res


def selection_gaps(t, kind, topk, lengths):
    """(queries whose k-th and (k+1)-th indexer scores tie exactly, smallest nonzero relative gap there)."""
    ties, gap, start = 0, math.inf, 0
    for n in lengths:
        keys = compress(t["idx_rows"][start:start + n], t["idx_bias"], t["idx_norm"], RATES[kind], DI, True,
                        inv_freq())
        i = torch.arange(n)
        readable = torch.arange(keys.shape[0])[None, :] < ((i + 1) // RATES[kind])[:, None]
        scores = (torch.einsum("thd,ed->the", t["idx_q"][start:start + n], keys).relu()
                  * t["idx_w"][start:start + n].unsqueeze(-1)).sum(1)
        for row in range(n):
            s = scores[row][readable[row]].sort(descending=True).values
            if s.numel() > topk:
                a, b = s[topk - 1].item(), s[topk].item()
                if a == b:
                    ties += 1
                else:
                    gap = min(gap, (a - b) / max(abs(a), 1e-30))
        start += n
    return ties, gap
