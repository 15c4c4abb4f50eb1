"""Generation at CP = 1, 2, 4 side by side in one run: KV-cache bytes per rank, prefill tokens/s,
decode ms/token, and the bytes a rank receives per decoded token and layer against the formula.

Launches the model (`cp_ext.training.model_from_flags.model_from_flags`) and `cp_ext.inference.Generator` under
torchrun once on ``--nproc`` ranks (4 on CPU); for every CP size dividing it (CP1 runs as DP4, CP2 as DP2: every rank
generates, as tools/generate.py does), it prefills one random ``--prompt-length``-token prompt
and decodes ``--new-tokens`` greedily, ``--repeats`` times, alternating the sizes (this machine
is shared and noisy: the ratios are measured in the same run). Default model: the passkey
config's shape (2 layers, hidden 64, 4 heads, MoE 4 experts), fp32.

    python tools/bench_generate.py --nproc 4 --prompt-length 8192 --new-tokens 16 --repeats 3

The communication is counted (`cp_ext.perf.counter`) while decoding and compared with
`cp_ext.inference.kv_cache.decode_bytes_per_token_layer`.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

# name: (CP, Ulysses size); the ring is C / U
LAYOUTS = {"1": (1, 1), "2 ring": (2, 1), "2 ulysses": (2, 2), "4 ring": (4, 1), "4 hybrid": (4, 2)}
DEFAULT_MODEL = ["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
                 "--num-experts", "4", "--moe-ffn-hidden-size", "64", "--seq-length", "128", "--train-iters", "1"]


def _worker(argv):
    import warnings

    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    for flag in ("--out", "--prompt-length", "--new-tokens", "--repeats"):
        p.add_argument(flag, required=True, type=str if flag == "--out" else int)
    known, flags = p.parse_known_args(argv)
    import torch
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.inference import Generator, decode_bytes_per_token_layer
    from cp_ext.perf.counter import count_comm
    from cp_ext.training.model_from_flags import model_from_flags

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])  # the process group starts with the first model
    layouts = {name: cu for name, cu in LAYOUTS.items() if world % cu[0] == 0}
    prompt = torch.randint(0, 256, (known.prompt_length,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {name: {"prefill_s": [], "decode_s": []} for name in layouts}
    for repeat in range(known.repeats):
        for name in (list(layouts) if repeat % 2 == 0 else list(reversed(layouts))):
            cp, u = layouts[name]
            stack, _ = model_from_flags(parse_args([f for f in flags if f != "--"] + [
                "--context-parallel-size", str(cp), "--ulysses-size", str(u)]))
            gen = Generator(stack.chunks[0])
            gen.generate(prompt, 2)  # warm-up: first calls allocate and pick kernels
            dist.barrier()
            with count_comm() as counted:
                out = gen.generate(prompt, known.new_tokens + 1)
            r = results[name]
            r["prefill_s"].append(out.prefill_seconds)
            r["decode_s"].append(out.decode_seconds / out.decode_steps)
            r["cache_bytes"] = out.cache_bytes
            config = stack.config
            tokens_decoded = out.decode_steps
            sent = sum(v for k, v in counted.bytes.items() if k.startswith("decode_"))
            r["counted_bytes_per_token_layer"] = sent / (tokens_decoded * config.num_layers)
            r["formula_bytes_per_token_layer"] = decode_bytes_per_token_layer(
                1, config.num_attention_heads, config.kv_channels, u, cp // u)
    Path(known.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    known, flags = p.parse_known_args()
    flags = flags or DEFAULT_MODEL
    from cp_ext.bench.workers import WorkerError, run_workers

    try:
        ranks = run_workers(__file__, known.nproc, ["--prompt-length", known.prompt_length, "--new-tokens",
                                                    known.new_tokens, "--repeats", known.repeats, *flags], timeout=None)
    except WorkerError as e:
        sys.exit(f"bench_generate: the run failed: {e}")

    def median(name, key):  # the slowest rank of each repeat, then the median over repeats
        return statistics.median(max(x[name][key][i] for x in ranks) for i in range(known.repeats))

    base_cache, base_prefill, base_decode = ranks[0]["1"]["cache_bytes"], median("1", "prefill_s"), median("1", "decode_s")
    print(f"{known.prompt_length}-token prompt, {known.new_tokens} decoded tokens, {' '.join(flags)}, "
          f"{known.nproc} ranks, median of {known.repeats} (slowest rank):")
    print(f"{'CP':<10} {'cache MiB/rank':>14} {'vs CP1':>7} {'prefill tok/s':>14} {'vs CP1':>7} {'decode ms/tok':>14} "
          f"{'vs CP1':>7} {'sent B/token/layer':>19} {'formula':>8}")
    for name in ranks[0]:
        r = ranks[0][name]
        cache = max(x[name]["cache_bytes"] for x in ranks)
        prefill, decode = median(name, "prefill_s"), median(name, "decode_s")
        print(f"{name:<10} {cache / 2**20:>14.2f} {cache / base_cache:>7.3f} {known.prompt_length / prefill:>14.0f} "
              f"{base_prefill / prefill:>7.2f} {decode * 1e3:>14.2f} {decode / base_decode:>7.2f} "
              f"{r['counted_bytes_per_token_layer']:>19.0f} {r['formula_bytes_per_token_layer']:>8}")

if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        _worker(sys.argv[1:])
    else:
        main()
