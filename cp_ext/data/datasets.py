"""Which dataset a run trains on, from its arguments, and the checks of the files it names.

    --data-path [W1] P1 [W2 P2 ...]   Megatron indexed datasets (blend weights as Megatron
                                      spells them), through megatron.core's
                                      BlendedMegatronDatasetBuilder + GPTDataset, --split,
                                      seeded by --data-seed, index cached in --data-cache-path
    --synthetic-task passkey          `cp_ext.data.passkey` (a long-range recall task)
    (neither)                         the embedded default: stdlib text (`cp_ext.data.embedded`)
                                      as an indexed dataset, through the same GPTDataset path

A dataset here is ``len(ds)``, ``ds[i]`` -> {tokens, labels, loss_mask, position_ids}
(GPTDataset's dict, each [seq_length]), ``ds.vocab_size`` and ``ds.eod`` (the EOD token id, None
for the passkey task). Which sample a rank reads, and which tokens of it, is
`cp_ext.training.batches`' job.

Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) go to
GPTDatasetConfig as Megatron-LM passes them: GPTDataset restarts the position ids after each
EOD and zeroes the loss mask on EODs. The [s, s] attention mask it could build is never built
(impossible at 128K tokens); `cp_ext.data.documents` gives the document ids instead.
"""

import math

from cp_ext.data.indexed import indexed_dataset_problems
from cp_ext.data.tokenizers import build_tokenizer


class TrainDataset:
    """The train split plus the vocab size the model needs; `samples` is None on ranks that read no data."""

    def __init__(self, samples, vocab_size: int, num_samples: int, seq_length: int, eod: int = None):
        self.samples, self.vocab_size, self._len, self.seq_length = samples, vocab_size, num_samples, seq_length
        self.eod = eod

    def __len__(self):
        return self._len

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def parse_blend(data_path):
    """Megatron's --data-path spelling -> ([prefix...], [weight...] or None); ValueError if malformed."""
    if len(data_path) % 2 == 1 or not _is_number(data_path[0]):
        if any(_is_number(p) for p in data_path):
            raise ValueError(f"--data-path {' '.join(data_path)}: give either prefixes only, or weight-prefix pairs "
                             f"(e.g. --data-path 0.7 a_text_document 0.3 b_text_document)")
        return list(data_path), None
    weights, prefixes = data_path[0::2], data_path[1::2]
    if not all(_is_number(w) for w in weights) or any(_is_number(p) for p in prefixes):
        raise ValueError(f"--data-path {' '.join(data_path)}: weights and prefixes must alternate (W1 P1 W2 P2 ...)")
    if not all(math.isfinite(float(w)) and float(w) >= 0 for w in weights) or not sum(map(float, weights)) > 0:
        raise ValueError(f"--data-path {' '.join(data_path)}: blend weights must be finite, >= 0 and not all zero")
    return list(prefixes), [float(w) for w in weights]


def _is_number(text):
    try:
        float(text)  # "inf" and "nan" are numbers here, so they are refused as weights, not read as prefixes
        return True
    except ValueError:
        return False


def data_file_problems(args, document_flags=()) -> list:
    """Tokenizer and --data-path file problems (missing, corrupt, ids >= vocab), each naming the fix.
    ``document_flags``: the packed-document flags the run gives (they need an EOD token)."""
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except ValueError as e:
        return [str(e)]
    problems = _document_problems(args, tokenizer, document_flags)
    if args.vocab_size is not None and args.vocab_size < tokenizer.vocab_size:
        return problems + [f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocab "
                           f"{tokenizer.vocab_size} (--tokenizer-type {args.tokenizer_type}); drop --vocab-size or "
                           f"use >= {tokenizer.vocab_size}"]
    vocab = args.vocab_size or tokenizer.vocab_size
    for flag in ("data_path", "valid_data_path", "test_data_path"):
        paths = getattr(args, flag, None)
        if not paths:
            continue
        try:
            prefixes, _ = parse_blend(paths)
        except ValueError as e:
            problems.append(str(e).replace("--data-path", "--" + flag.replace("_", "-")))
            continue
        vocab_from = f"--vocab-size {args.vocab_size}" if args.vocab_size else f"--tokenizer-type {args.tokenizer_type}"
        problems.extend(msg for prefix in prefixes
                        for msg in indexed_dataset_problems(prefix, vocab, "--" + flag.replace("_", "-"), vocab_from))
    return problems


def _document_problems(args, tokenizer, flags) -> list:
    """The packed-document flags need a tokenizer with an EOD token: without one (a HuggingFace
    vocabulary naming none gets an id past the vocabulary), no sample holds an EOD and the flags
    would silently do nothing."""
    if not flags or tokenizer.eod in tokenizer.inv_vocab:
        return []
    model = f" --tokenizer-model {args.tokenizer_model}" if args.tokenizer_model else ""
    return [f"{' '.join(flags)}: packed documents need an EOD token, but --tokenizer-type "
            f"{args.tokenizer_type}{model} has none (no <|endoftext|>, </s>, <eos> ... in its vocabulary); use a "
            f"tokenizer whose vocabulary has one (--tokenizer-model) and preprocess with it, or drop "
            f"{'the flags' if len(flags) > 1 else 'the flag'}"]


SPLITS = ("train", "valid", "test")


def build_train_dataset(args, num_samples=None) -> TrainDataset:
    """The train split for `args`, ``num_samples`` long (default: --train-iters x --global-batch-size;
    a resumed run passes what it still needs, see `cp_ext.training.trainer`). Collective when
    torch.distributed is initialized."""
    num_samples = num_samples or args.train_iters * args.global_batch_size
    if getattr(args, "dynamic_context_parallel", False):
        return build_document_samples(args, num_samples)
    return build_split_dataset(args, "train", num_samples)


def build_eval_dataset(args, split) -> TrainDataset:
    """The valid or test split: ``--eval-iters`` global batches, the same samples at every evaluation.

    From ``--valid-data-path`` / ``--test-data-path`` when given (Megatron's per-split blends),
    else from --split's share of --data-path (or of the embedded corpus); the passkey task
    draws another seed per split. Raises ValueError, naming the flags, when the split holds
    fewer distinct samples than ``--eval-iters`` asks for (they would repeat)."""
    num_samples = args.eval_iters * args.global_batch_size
    dataset = build_split_dataset(args, split, num_samples)
    distinct = getattr(dataset, "distinct_samples", None)
    if distinct is not None and distinct < num_samples:
        raise ValueError(
            f"--eval-iters {args.eval_iters} x --global-batch-size {args.global_batch_size} = {num_samples} {split} "
            f"samples, but the {split} split holds {distinct} of --seq-length {args.seq_length}; lower --eval-iters "
            f"or give the split more data (--split {args.split}{', --' + split + '-data-path' if split != 'train' else ''})")
    return dataset


def data_vocab_size(args) -> int:
    """The vocabulary the run's model is built for, as the trainer takes it: ``--vocab-size`` when given,
    else the datasets' (`TrainDataset.vocab_size`: the passkey task's own, else the tokenizer's)."""
    if args.vocab_size:
        return args.vocab_size
    if args.synthetic_task == "passkey":
        from cp_ext.data.passkey import PasskeyDataset

        return PasskeyDataset(args.seq_length, 1, args.data_seed).vocab_size
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size


def build_document_samples(args, num_samples):
    """Dynamic CP's train samples: one whole document each (`cp_ext.data.variable_length`), from --data-path's
    prefixes (or the embedded corpus), --split's train share."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split,
    )

    from cp_ext.data.embedded import default_cache_dir, embedded_prefix
    from cp_ext.data.variable_length import DocumentSamples

    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    prefixes = parse_blend(args.data_path)[0] if args.data_path else [embedded_prefix(args.data_cache_path or default_cache_dir())]
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))[0]
    return DocumentSamples(prefixes, bounds, args.seq_length, args.data_seed, num_samples, eod=tokenizer.eod,
                           eod_mask_loss=args.eod_mask_loss, vocab_size=args.vocab_size or tokenizer.vocab_size)


def build_split_dataset(args, split, num_samples) -> TrainDataset:
    if args.synthetic_task == "passkey":
        from cp_ext.data.passkey import PasskeyDataset

        data = PasskeyDataset(args.seq_length, num_samples, args.data_seed + SPLITS.index(split))
        return TrainDataset(data, data.vocab_size, num_samples, args.seq_length)  # no EOD: one sequence each
    return _build_gpt_dataset(args, split, num_samples)


def _documents_in_split(config, index, dataset_class):
    """Fewest documents split `index` takes from any of its prefixes (megatron's own rounding)."""
    if config.blend_per_split:
        prefixes, bounds = config.blend_per_split[index][0], (0.0, 1.0)
    else:
        prefixes, bounds = config.blend[0], config.split_matrix[index]
    if bounds is None:
        return 0
    counts = []
    for prefix in prefixes:
        n = dataset_class.numel_low_level_dataset(dataset_class.build_low_level_dataset(prefix, config))
        counts.append(int(round(bounds[1] * n)) - int(round(bounds[0] * n)))
    return min(counts)


def reads_data(args) -> bool:
    """Whether this rank builds the dataset. Megatron's rule: only the stages that embed tokens or take
    the loss; with packed documents every stage, for the per-document position ids (RoPE) and the
    document ids (attention) that each stage's layers need."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or args.reset_position_ids or args.reset_attention_mask:
        return True
    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()


def _build_gpt_dataset(args, split, num_samples):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from cp_ext.data.embedded import default_cache_dir, embedded_prefix

    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    cache = args.data_cache_path
    if args.data_path:
        blend = parse_blend(args.data_path)
    else:
        cache = cache or default_cache_dir()
        blend = ([embedded_prefix(cache)], None)
    index = SPLITS.index(split)
    own_path = getattr(args, f"{split}_data_path", None) if split != "train" else None
    blend_per_split, split_weights = None, args.split
    if own_path:  # Megatron's --valid-data-path / --test-data-path: this split's own blend
        blend_per_split, blend, split_weights = [None, None, None], None, None
        blend_per_split[index] = parse_blend(own_path)
    config = GPTDatasetConfig(
        random_seed=args.data_seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split_weights,
        path_to_cache=cache,  # None: Megatron's default, next to the data
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # no [s, s] mask: causal by construction, documents by their ids
    )

    # Only the asked split is built: its documents are the ones --split assigns it, and the
    # others are not (an empty split would loop forever in GPTDataset).
    if own_path is None:
        config.split_matrix = [m if i == index else None for i, m in enumerate(config.split_matrix)]
    if _documents_in_split(config, index, GPTDataset) == 0:  # GPTDataset would loop forever on it
        raise ValueError(f"the {split} split holds no documents (--split {args.split} of "
                         f"{' '.join(args.data_path or ['the embedded corpus'])}); give it a larger share or "
                         f"--{split}-data-path")
    sizes = [num_samples if i == index else 0 for i in range(3)]
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: reads_data(args), config).build()[index]
    dataset = TrainDataset(built, args.vocab_size or tokenizer.vocab_size, num_samples, args.seq_length,
                           eod=tokenizer.eod)
    if isinstance(built, GPTDataset):  # one prefix: how many distinct samples the split holds
        dataset.distinct_samples = (built._get_num_tokens_per_epoch() - 1) // args.seq_length
    return dataset
