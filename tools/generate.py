"""Generate text from a checkpoint with the sharding it trained with: CP prefill, CP-sharded KV cache.

    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --config configs/cpu_passkey.yaml \\
        --context-parallel-size 2 --prompt "..." --max-new-tokens 32 [--output out.jsonl]

Any flag pretrain_moe.py takes sets the model and the grid (give the training run's model flags;
the checkpoint's shape is checked against them, and a checkpoint loads at any grid). Generation
runs at any TP (+SP), PP, CP (ring, Ulysses, hybrid: --ulysses-size), EP and DP; every rank
generates the same tokens and rank 0 writes them. Prompts: ``--prompt TEXT`` (repeatable),
``--prompt-file FILE`` (the whole file is one prompt) or ``--prompt-jsonl FILE`` (one JSON object
per line with a "prompt" or "text" string). Greedy by default; ``--temperature T`` samples, cut by
``--top-k`` / ``--top-p``, seeded by ``--seed``. Generation stops at ``--max-new-tokens`` or the
tokenizer's end-of-document token. Each prompt prints its text and token ids; ``--output`` writes
one JSON line per prompt. Without ``--load`` the model keeps its random initialization (--seed):
for benchmarks and tests. How it works: `cp_ext.inference`.
"""

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

from cp_ext.data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from cp_ext.arguments import (  # noqa: E402
    NON_NEGATIVE, POSITIVE, ArgumentParser, ConfigError, exit_with_config_error, number, parse_args,
    single_process_without_torchrun,
)


def tool_parser():
    p = ArgumentParser(prog="generate.py", add_help=False, allow_abbrev=False)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a text file: the whole file is one prompt")
    p.add_argument("--prompt-jsonl", default=None, help='one {"prompt": ...} (or "text") object per line')
    p.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    p.add_argument("--temperature", type=number(float, 0), default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-k", type=NON_NEGATIVE, default=0, help="sample among the k most likely (0: all)")
    p.add_argument("--top-p", type=number(float, 0, 1, above=True), default=1.0,
                   help="sample among the most likely tokens holding this much probability")
    p.add_argument("--max-position-embeddings", type=POSITIVE, default=None,
                   help="refuse prompt + new tokens longer than this (Megatron's flag: the positions the "
                        "model may use); past --seq-length only a warning")
    p.add_argument("--output", default=None, help="write one JSON line per prompt")
    p.add_argument("--logprobs", action="store_true",
                   help="score: each prompt token's log-probability given the ones before it (vLLM's prompt_logprobs, "
                        "null for the first) and each generated token's, in --output's JSON")
    # The prompts' tokenizer (Megatron-LM's flags). Taken here, not by the run's parser: generation reads no
    # training corpus, so an HF tokenizer needs no --data-path (a run's --data-path gets them passed on).
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteTokenizer")
    p.add_argument("--tokenizer-model", default=None,
                   help="for HuggingFaceTokenizer: a tokenizer.json, or a Hugging Face model directory (an import's CKPT/hf)")
    p.add_argument("--passkey-samples", type=POSITIVE, default=None,
                   help="with --synthetic-task passkey: instead of text prompts, N held-out passkey samples up to "
                        "their query token; generates the key's digits and reports how many keys came out right")
    return p


def read_prompts(tool):
    """The prompts as text, from --prompt, --prompt-file and --prompt-jsonl; ConfigError naming the file/line."""
    prompts = list(tool.prompt)
    if tool.prompt_file:
        try:
            prompts.append(Path(tool.prompt_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"  - --prompt-file {tool.prompt_file}: cannot read it as UTF-8 text ({e})")
    if tool.prompt_jsonl:
        try:
            lines = Path(tool.prompt_jsonl).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"  - --prompt-jsonl {tool.prompt_jsonl}: cannot read it as UTF-8 text ({e})")
        for number_, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"  - --prompt-jsonl {tool.prompt_jsonl} line {number_}: not JSON ({e.msg})")
            text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"  - --prompt-jsonl {tool.prompt_jsonl} line {number_}: expected an object with "
                                  f"a \"prompt\" (or \"text\") string")
            prompts.append(text)
    if not prompts:
        raise ConfigError("  - no prompt: give --prompt TEXT, --prompt-file FILE or --prompt-jsonl FILE")
    if any(not p for p in prompts):
        raise ConfigError("  - an empty prompt: every prompt needs at least one token")
    return prompts


def passkey_prompts(count, args):
    """`count` held-out passkey samples (the test split's seed): (prompts cut after their query token,
    the keys that follow)."""
    from cp_ext.data.passkey import PasskeyDataset

    data = PasskeyDataset(args.seq_length, count, args.data_seed + 2)
    samples = [data[i]["tokens"].tolist() + [int(data[i]["labels"][-1])] for i in range(len(data))]
    return [s[:-data.key_length] for s in samples], [s[-data.key_length:] for s in samples]


def length_problems(tool, lengths, args):
    """A prompt the model cannot take: refused past --max-position-embeddings (this tool's, else a learned
    position table's rows), warned past --seq-length."""
    longest = max(lengths) + tool.max_new_tokens
    limit = tool.max_position_embeddings or (
        args.max_position_embeddings if args.position_embedding_type == "learned_absolute" else None)
    if limit and longest > limit:
        return [f"a prompt of {max(lengths)} tokens + --max-new-tokens {tool.max_new_tokens} = {longest} positions "
                f"exceeds --max-position-embeddings {limit}; shorten the prompt or generate fewer tokens"]
    return []


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    single_process_without_torchrun()
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        tool, rest = tool_parser().parse_known_args(argv)
        tokenizer_flags = ["--tokenizer-type", tool.tokenizer_type] + (
            ["--tokenizer-model", tool.tokenizer_model] if tool.tokenizer_model else [])
        args = parse_args(rest + (["--finetune"] if "--load" in rest else [])
                          + (tokenizer_flags if "--data-path" in rest else []))
        if tool.temperature == 0 and (tool.top_k or tool.top_p < 1.0):
            raise ConfigError("  - --top-k and --top-p cut the distribution a sample is drawn from; greedy decoding "
                              "(--temperature 0, the default) draws none: add --temperature, e.g. 0.7")
        if tool.logprobs and (not tool.output or tool.passkey_samples):
            raise ConfigError("  - --logprobs writes each prompt's log-probabilities into --output's JSON: add "
                              "--output FILE" + (" and drop --passkey-samples (it reports keys, not prompts)"
                                                  if tool.passkey_samples else ""))
        if tool.passkey_samples and args.synthetic_task != "passkey":
            raise ConfigError("  - --passkey-samples needs --synthetic-task passkey (the task the model was trained on)")
        prompts = read_prompts(tool) if not tool.passkey_samples else []
        from cp_ext.data.tokenizers import build_tokenizer

        try:
            tokenizer = build_tokenizer(tool.tokenizer_type, tool.tokenizer_model)
        except ValueError as e:
            raise ConfigError(f"  - {e}") from None
        if tool.passkey_samples:
            encoded, answers = passkey_prompts(tool.passkey_samples, args)
            tool.max_new_tokens = len(answers[0])  # the key's digits
        else:
            encoded = [tokenizer.tokenize(p).tolist() for p in prompts]
        problems = length_problems(tool, [len(ids) for ids in encoded], args)
        vocab = args.padded_vocab_size or args.vocab_size
        if vocab and encoded and max(max(ids, default=0) for ids in encoded) >= vocab:
            problems.append(f"the prompts hold token ids up to {max(max(ids, default=0) for ids in encoded)}, past the "
                            f"model's vocabulary of {vocab}: --tokenizer-type {tool.tokenizer_type} is not the model's "
                            f"tokenizer (an import's is CKPT/hf: --tokenizer-type HuggingFaceTokenizer "
                            f"--tokenizer-model CKPT/hf)")
        if problems:
            raise ConfigError("\n".join(f"  - {p}" for p in problems))
    except ConfigError as e:
        exit_with_config_error("generate.py", e)

    from cp_ext.inference import Generator, Sampling
    from cp_ext.training.model_from_flags import leave_distributed, model_from_flags

    def say(text):
        if rank0:
            print(text, flush=True)

    longest = max(len(ids) for ids in encoded) + tool.max_new_tokens
    if longest > args.seq_length:
        say(f"warning: up to {longest} positions, beyond --seq-length {args.seq_length}: RoPE positions the model "
            f"never trained on; quality may fall")
    if not args.load:
        say(f"note: no --load: generating from the random initialization of --seed {args.seed}")
    try:
        stack, _ = model_from_flags(args)  # the model and --load's weights; no data, optimizer or DDP
    except ConfigError as e:  # known once the checkpoint is open: a model that is not the checkpoint's
        exit_with_config_error("generate.py", e)
    generator = Generator(stack.chunks[0])
    sampling = Sampling(temperature=tool.temperature, top_k=tool.top_k, top_p=tool.top_p, seed=args.seed)
    records = []
    if tool.passkey_samples:
        right = 0
        for ids, answer in zip(encoded, answers):
            out = generator.generate(ids, tool.max_new_tokens, sampling)
            right += out.new_ids == answer
            records.append({"prompt_tokens": len(ids), "ids": out.new_ids, "key": answer})
        say(f"passkey: {right} of {len(encoded)} keys generated right ({len(encoded[0])}-token prompts, "
            f"TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}, "
            f"CP {args.context_parallel_size}, Ulysses {args.ulysses_size})")
        prompts = []
    for text, ids in zip(prompts, encoded):
        out = generator.generate(ids, tool.max_new_tokens, sampling, stop_ids=(tokenizer.eod,), logprobs=tool.logprobs)
        generated = tokenizer.detokenize([t for t in out.new_ids if t != tokenizer.eod])
        if out.prefilled < len(ids):
            say(f"note: the CP layout splits {out.prefilled} of the prompt's {len(ids)} tokens; the last "
                f"{len(ids) - out.prefilled} were decoded one by one (exact, no padding)")
        say(f"prompt ({len(ids)} tokens): {text[-200:]!r}\ngenerated ({len(out.new_ids)} tokens): {generated!r}\n"
            f"ids: {out.new_ids}")
        record = {"prompt": text, "prompt_tokens": len(ids), "ids": out.new_ids, "text": generated}
        if tool.logprobs:
            record.update(prompt_ids=ids, prompt_logprobs=out.prompt_logprobs, logprobs=out.new_logprobs)
        records.append(record)
    if rank0 and tool.output:
        Path(tool.output).parent.mkdir(parents=True, exist_ok=True)
        Path(tool.output).write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {tool.output}", flush=True)
    leave_distributed()


if __name__ == "__main__":
    main()
