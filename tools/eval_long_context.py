"""Does the model use its whole context? Passkey retrieval by length and key depth, and loss by
position, evaluated forward-only with the trainer's own CP sharding (ring, Ulysses, hybrid).

    torchrun --nproc-per-node 2 tools/eval_long_context.py --load CKPT --config configs/cpu_passkey.yaml \\
        --context-parallel-size 2 --lengths 128 256 512 --depths 0.1 0.3 0.5 0.7 0.9 --out-dir eval/

Any flag pretrain_moe.py takes sets the model and the grid (give the training run's model flags;
the checkpoint's shape is checked against them); the checkpoint's weights are loaded (Megatron's
--finetune path: weights only). For each length L:

* **passkey retrieval**: ``--samples`` passkey samples of L tokens per key depth (the key's start
  as a fraction of the room before the query, `cp_ext.data.passkey`); the greedy answer is read
  from the logits at the answer positions (argmax over the full vocabulary, gathered over TP),
  each CP rank judging the answer digits in its shard; a sample is right when every digit is.
* **loss by position**: the mean loss of the tokens the run trains on (its loss mask) in
  ``--position-buckets`` equal buckets of global position, over ``--samples`` samples of the run's
  own validation data (the valid split of --data-path or the embedded corpus: every token; with
  --synthetic-task passkey, held-out passkey samples: the answer digits only, so only the last
  bucket has a value and the others are null).
* **peak memory per rank** after the length (peak RSS on CPU, CUDA max allocated on GPU).

Writes ``results.json`` and ``long_context.png`` (accuracy heat map length x depth; loss vs
position) into ``--out-dir`` and prints a table. Results are the same at any CP layout (ties
aside): tests/training/test_eval_long_context.py compares CP=1 with CP=2.
"""

import argparse
import json
import math
import os
import sys
from functools import partial
from pathlib import Path


def _tool_args(argv):
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--samples", type=int, default=32, help="samples per (length, depth) and per length for the loss")
    p.add_argument("--position-buckets", type=int, default=8)
    p.add_argument("--out-dir", default="eval_long_context")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_known_args(argv)


def _problems(tool, args):
    p = []
    if not args.load:
        p.append("--load CKPT is required (the checkpoint to evaluate)")
    if any(not 0.0 <= d <= 1.0 for d in tool.depths):
        p.append(f"--depths {' '.join(map(str, tool.depths))}: fractions in [0, 1]")
    if tool.samples < 1 or tool.position_buckets < 1:
        p.append("--samples and --position-buckets must be >= 1")
    split = args.context_parallel_size * 2  # zigzag: 2 chunks per CP rank
    for length in tool.lengths:
        if length % split or length < 32:
            p.append(f"--lengths {length}: must be >= 32 and divisible by 2 x --context-parallel-size = {split}")
        elif length % tool.position_buckets:
            p.append(f"--lengths {length}: must be divisible by --position-buckets {tool.position_buckets}")
    dp = args.data_parallel_size or 1
    if tool.samples % (args.micro_batch_size * dp):
        p.append(f"--samples {tool.samples} must be a multiple of --micro-batch-size x DP = "
                 f"{args.micro_batch_size * dp}")
    return p


def _answer_step(collected, data_iterator, model):
    """Forward without labels; the loss function records (sample, wrong digits) for this CP shard."""
    from megatron.core import parallel_state, tensor_parallel

    batch = next(data_iterator)
    logits = model(batch.tokens, batch.position_ids, None)

    def judge(output):
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            output = tensor_parallel.gather_from_tensor_model_parallel_region(output)
        wrong = ((output.argmax(-1) != batch.labels) & (batch.loss_mask > 0)).sum(-1)
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            collected.extend(zip(batch.sample_ids.tolist(), wrong.tolist()))
        zero = output.sum() * 0.0
        return zero, 1, {}

    return logits, judge


def _loss_step(collected, buckets, length, data_iterator, model):
    """Forward with labels (per-token losses); records loss sums and counts per position bucket."""
    from megatron.core import parallel_state

    batch = next(data_iterator)
    losses = model(batch.tokens, batch.position_ids, None, labels=batch.labels)

    def bucketize(output):
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            index = (batch.position_ids * buckets // length).reshape(-1)
            mask = batch.loss_mask.reshape(-1)  # the tokens the run trains on
            collected[0].index_add_(0, index, (output.float().reshape(-1) * mask).double())
            collected[1].index_add_(0, index, mask.double())
        return output.sum() * 0.0, 1, {}

    return losses, bucketize


def _run_forward(args, stack, device, dataset, step):
    """Every sample of `dataset` once through megatron's forward-only schedule, each CP rank its shard."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from cp_ext import parallel_state as cp_state
    from cp_ext.training.batches import microbatches

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    per_batch = args.micro_batch_size * dp_size
    positions = cp_state.get_context_parallel_positions(args.seq_length, stack.config.cp_layout)
    with torch.no_grad():
        for chunk in stack.chunks:
            chunk.eval()
        for start in range(0, len(dataset), per_batch):
            data = microbatches(dataset, consumed_samples=start, global_batch_size=per_batch,
                                micro_batch_size=args.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                device=device, positions=positions,
                                first_stage=parallel_state.is_pipeline_first_stage(),
                                last_stage=parallel_state.is_pipeline_last_stage())
            get_forward_backward_func()(forward_step_func=step, data_iterator=data, model=stack.chunks,
                                        num_microbatches=1, seq_length=args.seq_length,
                                        micro_batch_size=args.micro_batch_size, forward_only=True)


def evaluate_length(args, stack, device, tool, length):
    """{'accuracy': {depth: fraction}, 'loss_by_position': [...], 'peak_memory_bytes': [...per rank]}."""
    import torch
    import torch.distributed as dist

    from cp_ext.data.datasets import build_split_dataset
    from cp_ext.data.passkey import PasskeyDataset
    from cp_ext.platform import memory_bytes

    accuracy = {}
    for depth in tool.depths:
        dataset = PasskeyDataset(length, tool.samples, seed=args.data_seed + 17, depth=depth)
        collected = []
        _run_forward(args, stack, device, dataset, partial(_answer_step, collected))
        wrong = torch.zeros(tool.samples, dtype=torch.float64, device=device)
        for sample, count in collected:
            wrong[sample] += count
        dist.all_reduce(wrong)
        accuracy[str(depth)] = (wrong == 0).double().mean().item()
    sums = [torch.zeros(tool.position_buckets, dtype=torch.float64, device=device) for _ in range(2)]
    text = build_split_dataset(args, "valid", tool.samples)
    _run_forward(args, stack, device, text, partial(_loss_step, sums, tool.position_buckets, length))
    for t in sums:
        dist.all_reduce(t)
    losses = [None if count == 0 else total / count for total, count in zip(sums[0].tolist(), sums[1].tolist())]
    peak = torch.tensor([float(memory_bytes())], dtype=torch.float64, device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    return {"accuracy": accuracy, "loss_by_position": losses, "peak_memory_bytes": [int(p.item()) for p in peaks]}


def _plot(results, tool, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [str(length) for length in tool.lengths]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    grid = [[results[length]["accuracy"][str(d)] for d in tool.depths] for length in lengths]
    image = left.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    left.set_xticks(range(len(tool.depths)), [f"{d:g}" for d in tool.depths])
    left.set_yticks(range(len(lengths)), lengths)
    left.set_xlabel("key depth (fraction of the context)")
    left.set_ylabel("context length (tokens)")
    left.set_title("passkey retrieval accuracy")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            left.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.5 else "k")
    fig.colorbar(image, ax=left)
    for length in lengths:
        losses = results[length]["loss_by_position"]
        width = int(length) / len(losses)
        points = [((b + 0.5) * width, x) for b, x in enumerate(losses) if x is not None]
        right.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"L = {length}")
    right.set_xlabel("position (tokens)")
    right.set_ylabel("mean loss")
    right.set_title("validation loss by position")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    import warnings

    warnings.simplefilter("ignore")
    argv = sys.argv[1:] if argv is None else argv
    tool, rest = _tool_args(argv)
    from cp_ext.arguments import ConfigError, exit_with_config_error, parse_args

    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        args = parse_args(rest + ["--finetune", "--seq-length", str(max(tool.lengths))])
        problems = _problems(tool, args)
        if problems:
            raise ConfigError("\n".join(f"  - {p}" for p in problems))
    except ConfigError as e:
        exit_with_config_error("eval_long_context.py", e)

    from cp_ext.training.model_from_flags import leave_distributed, model_from_flags

    results = {}
    for length in tool.lengths:  # the model at each length (RoPE and the CP layout depend on it), weights only
        args = parse_args(rest + ["--finetune", "--seq-length", str(length)])
        stack, device = model_from_flags(args)
        results[str(length)] = evaluate_length(args, stack, device, tool, length)
    world = args.world_size
    layout = (f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x CP "
              f"{args.context_parallel_size} (Ulysses {args.ulysses_size}) x DP {args.data_parallel_size}")
    leave_distributed()
    if not rank0:
        return
    out = Path(tool.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"layout": layout, "world_size": world, "lengths": tool.lengths, "depths": tool.depths,
              "samples": tool.samples, "results": results}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    print(f"long-context evaluation, {layout}, {tool.samples} samples per cell")
    header = "length " + " ".join(f"d={d:<5g}" for d in tool.depths) + "  loss first->last bucket  peak MiB/rank"
    print(header)
    for length in tool.lengths:
        r = results[str(length)]
        acc = " ".join(f"{r['accuracy'][str(d)]:<7.2f}" for d in tool.depths)
        loss = [x for x in r["loss_by_position"] if x is not None] or [math.nan]
        print(f"{length:<6} {acc}  {loss[0]:.3f} -> {loss[-1]:.3f}{'':12}{max(r['peak_memory_bytes']) / 2**20:.0f}")
    if not tool.no_plot:
        _plot(results, tool, out / "long_context.png")
    print(f"wrote {out / 'results.json'}" + ("" if tool.no_plot else f" and {out / 'long_context.png'}"))


if __name__ == "__main__":
    main()
