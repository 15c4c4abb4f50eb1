"""The one model factory: parsed flags and a grid in, this rank's model out.

    stack = build_model_stack(args, grid, vocab_size=tokens, device=device)
    stack.config, stack.chunks, stack.padded_vocab_size

What megatron-core's ``get_model`` does before it wraps DDP: the TransformerConfig from the flags,
this rank's pipeline stage of the GPT (initialized from ``--seed`` independently of the grid), moved to
the device and, with ``--bf16``, under ``Float16Module``. The trainer wraps the chunks in megatron's DDP
and builds the optimizer; generation, HF conversion and the tools use them as they are. The padded
vocabulary follows one rule everywhere (`padded_vocab`), so a checkpoint written by one of them has
the embedding shape every other one builds.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from cp_ext.arguments import ConfigError
from cp_ext.config import padded_vocab_size, transformer_config_from_args
from cp_ext.grid import Grid
from cp_ext.megatron_compat import reset_moe_loss_tracker
from cp_ext.models.gpt_moe import build_model
from cp_ext.transformer.dsa import freeze_all_but_indexer


@dataclass
class ModelStack:
    """This rank's model: the config it was built from, its chunks (one per pipeline stage this rank
    holds; cp_ext builds one) and the embedding's rows."""

    config: TransformerConfig
    chunks: List[torch.nn.Module]
    padded_vocab_size: int


def padded_vocab(args, vocab_size: int, tp_size: int) -> int:
    """The embedding's rows for a ``vocab_size``-token vocabulary: ``--padded-vocab-size`` as given
    (Megatron-LM's; GPT-OSS's 201088), else padded to ``--make-vocab-size-divisible-by`` independently
    of TP (`cp_ext.config.padded_vocab_size`), so a TP2 run is the TP1 model."""
    if args.padded_vocab_size is not None:
        if args.padded_vocab_size < vocab_size:
            raise ConfigError(f"  - --padded-vocab-size {args.padded_vocab_size} is below the vocabulary's "
                              f"{vocab_size} tokens; raise it to at least {vocab_size} or drop it")
        return args.padded_vocab_size
    return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp_size)


def build_model_stack(args, grid: Grid, *, vocab_size: int, device=None, meta: bool = False,
                      config: Optional[TransformerConfig] = None) -> ModelStack:
    """This rank's model at ``grid`` (its process groups in place: `Grid.initialize`).

    ``vocab_size``: the tokenizer's or the dataset's (``--vocab-size`` when given); ``device``: where the
    weights live; ``meta``: build on the meta device without initializing, for the checkpoint map only
    (`cp_ext.hf.streaming`), which allocates nothing; ``config``: the one made from ``args`` already
    (the trainer's startup lines read it first), else made here. A vocabulary padded already is kept."""
    vocab = padded_vocab(args, vocab_size, grid.tp)
    config = config if config is not None else transformer_config_from_args(args)
    # megatron's MoE loss tracker is process-wide, sized by the first model's layers (with MTP:
    # --num-layers + --mtp-num-layers) and keyed by its loss names: another model in the process (tools,
    # tests) starts from an empty one, before and after it is built.
    reset_moe_loss_tracker()
    if meta:
        # megatron's layers allocate on the current (CUDA, here CPU) device unless told to initialize on
        # the "CPU", which allocates on the default device: the meta one below. Nothing is initialized.
        config.use_cpu_initialization, config.perform_initialization = True, False
        with torch.device("meta"):
            return ModelStack(config, [build_model(config, args, vocab, initialize=False)], vocab)
    model = build_model(config, args, vocab)
    if getattr(config, "dsa_dense_warmup", False):
        freeze_all_but_indexer(model)
    if device is not None:
        model = model.to(device)
    reset_moe_loss_tracker()
    if args.bf16:
        model = Float16Module(config, model)
    return ModelStack(config, [model], vocab)
