"""The data flags: datasets and splits, evaluation, tokenizers, packed documents, and their checks
(the files named are opened cheaply, by `cp_ext.data.datasets.data_file_problems`)."""

import math

from cp_ext.flag_types import NON_NEGATIVE, POSITIVE


def add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron indexed dataset prefixes, optionally weighted: [W1] P1 [W2 P2 ...] "
                        "(default: the embedded stdlib corpus)")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights of --data-path's documents (valid/test are used by --eval-interval)")
    g.add_argument("--valid-data-path", nargs="+", default=None,
                   help="the validation split's own dataset prefixes ([W1] P1 ...), instead of --split's share")
    g.add_argument("--test-data-path", nargs="+", default=None,
                   help="the test split's own dataset prefixes ([W1] P1 ...), instead of --split's share")
    g.add_argument("--eval-interval", type=POSITIVE, default=None,
                   help="validation loss every N iterations (and on the test split at the end of training); "
                        "off when not given")
    g.add_argument("--eval-iters", type=NON_NEGATIVE, default=100,
                   help="global batches per evaluation, the same samples each time (0: no evaluation)")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the valid and test splits once (with --load, the checkpoint) and exit")
    g.add_argument("--tokenizer-type", choices=["ByteTokenizer", "HuggingFaceTokenizer"], default="ByteTokenizer")
    g.add_argument("--tokenizer-model", default=None,
                   help="for HuggingFaceTokenizer: a tokenizer.json, or a Hugging Face model directory holding one")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset indices (and the embedded corpus) are cached (default ~/.cache/cp_ext "
                        "for the embedded corpus, next to the data otherwise)")
    g.add_argument("--synthetic-task", choices=["passkey"], default=None,
                   help="train on a synthetic task instead: passkey = recall a key seen early (long range)")
    # Megatron-LM's packed-document flags: a sample of --seq-length tokens spans several documents, each
    # ended by the tokenizer's EOD token (the token after an EOD starts the next document).
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids (and RoPE) restart at 0 after every EOD token, as in Megatron-LM")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="a token attends only to its own document (the tokens since the last EOD), as in Megatron-LM")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is an EOD (its target is the next document's first token), "
                        "as in Megatron-LM")


def split_weights(split):
    """--split "969,30,1" -> [969.0, 30.0, 1.0] (Megatron pads a short list with zeros); ValueError if malformed."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split}: expected up to three comma-separated weights, e.g. 969,30,1") from None
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        raise ValueError(f"--split {split}: expected up to three weights >= 0 with train's > 0, e.g. 969,30,1")
    return weights + [0.0] * (3 - len(weights))


def evaluation_splits(args):
    """The splits evaluation uses ("valid", "test"): those with data of their own or a --split share."""
    if not (args.eval_interval or args.skip_train) or args.eval_iters == 0:
        return []
    if args.synthetic_task:
        return ["valid", "test"]
    weights = split_weights(args.split)
    return [name for i, name in ((1, "valid"), (2, "test"))
            if getattr(args, f"{name}_data_path") or weights[i] > 0]


def _eval_problems(args):
    p = []
    try:
        splits = evaluation_splits(args)
    except ValueError as e:
        return [str(e)]
    if (args.eval_interval or args.skip_train) and args.eval_iters > 0 and "valid" not in splits:
        p.append(f"--eval-interval needs validation data: --split {args.split} gives the valid split no documents; "
                 f"give it a share (e.g. --split 969,30,1) or --valid-data-path")
    return p


_DOCUMENT_FLAGS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


def document_flags_given(args):
    """Megatron-LM's packed-document flags this run sets; each acts on the EOD tokens of the samples."""
    return [flag for flag in _DOCUMENT_FLAGS if getattr(args, flag[2:].replace("-", "_"), False)]


def data_problems(args):
    """Data flags; the files they name are opened (cheaply) only when given."""
    if getattr(args, "split", None) is None:  # an args namespace built without the data group
        return []
    eval_problems = _eval_problems(args)
    if eval_problems:
        return eval_problems
    if args.synthetic_task and args.data_path:
        return [f"--synthetic-task {args.synthetic_task} and --data-path are exclusive; give one"]
    if args.synthetic_task:
        flags = document_flags_given(args)
        if flags:
            return [f"{' '.join(flags)}: packed documents need EOD tokens, but --synthetic-task "
                    f"{args.synthetic_task} samples are one sequence each and hold no EOD token; drop "
                    f"{'them' if len(flags) > 1 else 'it'}, or train on --data-path (or the embedded corpus)"]
        return []
    try:
        split_weights(args.split)  # read whenever data comes from --data-path or the embedded corpus
    except ValueError as e:
        return [str(e)]
    if args.tokenizer_type != "ByteTokenizer" and not args.data_path:
        return [f"--tokenizer-type {args.tokenizer_type} needs --data-path (the embedded default corpus is "
                f"byte-tokenized); preprocess your text with tools/preprocess_data.py"]
    if (args.data_path or args.valid_data_path or args.test_data_path or args.tokenizer_model
            or args.vocab_size is not None):
        from cp_ext.data.datasets import data_file_problems

        return data_file_problems(args, document_flags_given(args))
    return []

