"""Peak memory of tools/convert_hf.py import and export against the model's size, on a Qwen3-MoE release
written here (random bf16 weights, sharded safetensors with an index, at least 2 GB by default).

    python tools/bench_hf_streaming.py [--layers 12 --experts 64 --shard-size 500MB --workdir DIR]

The release is written one tensor at a time (this script never holds it either). Each conversion runs in
its own process, and its peak resident set (getrusage's ru_maxrss of that child) is printed beside the
model's size, its largest shard and its largest layer, and beside the same process's floor: an import of a
one-layer model of the same widths (Python, torch, megatron-core and cp_ext loaded, the model's map built).
The import writes the checkpoint in bf16 (--bf16), so import and export move the same bytes.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVERT = ROOT / "tools" / "convert_hf.py"


def qwen3_moe_config(layers, experts, hidden, ffn, vocab):
    heads, groups, head_dim = 16, 4, hidden // 16
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 4 * ffn, "moe_intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": groups,
            "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "mlp_only_layers": [], "decoder_sparse_step": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16"}


def layer_tensors(c, layer):
    h, d, ffn = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"]
    at = f"model.layers.{layer}."
    shapes = {at + "input_layernorm.weight": (h,), at + "post_attention_layernorm.weight": (h,),
              at + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, h),
              at + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, h),
              at + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, h),
              at + "self_attn.o_proj.weight": (h, c["num_attention_heads"] * d),
              at + "self_attn.q_norm.weight": (d,), at + "self_attn.k_norm.weight": (d,),
              at + "mlp.gate.weight": (c["num_experts"], h)}
    for e in range(c["num_experts"]):
        e_at = at + f"mlp.experts.{e}."
        shapes.update({e_at + "gate_proj.weight": (ffn, h), e_at + "up_proj.weight": (ffn, h),
                       e_at + "down_proj.weight": (h, ffn)})
    return shapes


def write_release(directory, c, shard_bytes):
    """The release, one tensor at a time into shards of at most ``shard_bytes``: (total, largest shard,
    largest layer) in bytes."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(c, indent=1))
    groups = [{"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"])}]
    groups += [layer_tensors(c, layer) for layer in range(c["num_hidden_layers"])]
    groups += [{"model.norm.weight": (c["hidden_size"],), "lm_head.weight": (c["vocab_size"], c["hidden_size"])}]
    generator = torch.Generator().manual_seed(0)
    shards, pending, pending_bytes, total = [], {}, 0, 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            shards.append((sorted(pending), pending_bytes))
            save_file(pending, directory / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            pending, pending_bytes = {}, 0

    largest_layer = 0
    for group in groups:
        group_bytes = 0
        for name, shape in group.items():
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            size = tensor.numel() * 2
            if pending_bytes + size > shard_bytes:
                flush()
            pending[name], pending_bytes, total, group_bytes = tensor, pending_bytes + size, total + size, group_bytes + size
        largest_layer = max(largest_layer, group_bytes)
    flush()
    weight_map = {}
    for i, (names, _) in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (directory / f"part-{i}.safetensors").rename(directory / name)
        weight_map.update(dict.fromkeys(names, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                        "weight_map": weight_map}))
    return total, max(size for _, size in shards), largest_layer


def peak_rss(*args):
    """(peak resident set in bytes, seconds) of one child running tools/convert_hf.py ``args``."""
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe, sys.executable, str(CONVERT), *map(str, args)],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_hf_streaming: convert_hf.py {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return int(proc.stdout.split()[-1]) * 1024, time.perf_counter() - start  # ru_maxrss: KiB on Linux


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--shard-size", default="500MB", help="the release's and the export's shard size")
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    a = p.parse_args()
    from cp_ext.hf.convert import size_in_bytes

    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_hf_streaming_"))
    try:
        gib = 2 ** 30
        c = qwen3_moe_config(a.layers, a.experts, a.hidden_size, a.moe_ffn_hidden_size, a.vocab_size)
        total, shard, layer = write_release(work / "release", c, size_in_bytes(a.shard_size))
        floor_config = {**c, "num_hidden_layers": 1, "num_experts": 4, "vocab_size": 512}
        write_release(work / "floor", floor_config, size_in_bytes(a.shard_size))
        floor, _ = peak_rss("import", "--hf-dir", work / "floor", "--save", work / "floor_ckpt", "--bf16")
        imported, t_import = peak_rss("import", "--hf-dir", work / "release", "--save", work / "ckpt", "--bf16")
        exported, t_export = peak_rss("export", "--load", work / "ckpt", "--hf-dir", work / "exported",
                                      "--max-shard-size", a.shard_size)
        print(f"model: Qwen3-MoE {a.layers} layers x {a.experts} experts, {total / gib:.2f} GiB bf16; largest shard "
              f"{shard / gib:.2f} GiB, largest layer {layer / gib:.2f} GiB")
        print(f"floor (an import of 1 layer of 4 experts: Python, torch, megatron-core, cp_ext): {floor / gib:.2f} GiB")
        for what, rss, seconds in (("import", imported, t_import), ("export", exported, t_export)):
            print(f"{what}: peak RSS {rss / gib:.2f} GiB = {rss / total:.2f} x the model; above the floor "
                  f"{(rss - floor) / gib:.2f} GiB = {(rss - floor) / (shard + layer):.2f} x (largest shard + largest "
                  f"layer); {seconds:.0f} s")
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
