"""What the linear-attention tests share: seeded inputs, packed documents, and transformers' rule in float64.

`inputs` draws the same full-sequence tensors on every rank (float64 leaves: q and k L2-normalized as
Qwen3-Next feeds them, g = -softplus(.) <= 0 per head or, for KDA, per key channel, beta in (0, 1));
`documents` the packed-document ids the CP cases need (a start exactly at a segment boundary, a 1-token
document, documents over several segments); `hf_float64` transformers' torch fallbacks (Qwen3-Next's and
Kimi-Linear's) with their fp32 casts turned into fp64 (their algorithm, untouched otherwise), so they can
be compared at 1e-10.
"""

import ast
import inspect
import zlib

TENSORS = ("out", "dq", "dk", "dv", "dg", "dbeta")


def inputs(b, s, hk, hv, kd, vd, seed, per_channel=False):
    """{q, k, v, g, beta, dout} of the full sequence, float64, seeded by ``seed``; g [b, s, hv] or, with
    ``per_channel`` (KDA), [b, s, hv, kd] with a spread of decay rates across channels."""
    import torch
    import torch.nn.functional as F

    from cp_ext.linear_attention import l2norm

    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=l2norm(randn(b, s, hk, kd)), k=l2norm(randn(b, s, hk, kd)), v=randn(b, s, hv, vd),
                g=-F.softplus(randn(b, s, hv, kd) * 1.5 - 1.0) if per_channel else -F.softplus(randn(b, s, hv) - 1.0),
                beta=torch.sigmoid(randn(b, s, hv)), dout=randn(b, s, hv, vd))


def documents(b, s, segment):
    """[b, s] ids: sample 0 starts documents at 0, ``segment`` (a segment boundary), segment + 3 and + 4
    (a 1-token document), 3 x segment and 3 x segment + 1 (another 1-token one); sample 1 has two
    documents, each over several segments; any further sample is one document."""
    import torch

    starts = [[0, segment, segment + 3, segment + 4, 3 * segment, 3 * segment + 1], [0, 2 * segment + 2]]
    ids = torch.zeros(b, s, dtype=torch.int64)
    for i in range(min(b, 2)):
        for p in starts[i]:
            if 0 < p < s:
                ids[i, p:] += 1
    return ids


def seed_of(name):
    return zlib.crc32(name.encode()) % 10_000


def hf_float64(name, model="qwen3_next"):
    """transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (``model``
    qwen3_next) or ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` (kimi_linear) computing
    in float64: its source with ``torch.float32`` -> ``torch.float64`` and ``.float()`` -> ``.double()``, run
    in its own module's namespace."""
    import importlib

    hf = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    module_source = inspect.getsource(hf)  # the name is a kernel-hub wrapper (an nn.Module): read the def itself
    node = next(n for n in ast.parse(module_source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    source = ast.get_source_segment(module_source, node)  # without its decorator, which would swap kernels in
    changed = "transformers' fallback changed: re-check this rewrite"
    assert source.count("torch.float32") == 1 and source.count(".float()") <= 1, changed
    source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    assert "float32" not in source and ".float(" not in source and ".half(" not in source, changed
    namespace = dict(vars(hf))
    exec(compile(source, f"<{name} in float64>", "exec"), namespace)
    return namespace[name]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()
