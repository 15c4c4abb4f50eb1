"""Every difference between the megatron-core releases cp_ext supports (0.16.1 through 0.19.x), in one place.

The rest of cp_ext asks the names below and never compares versions itself. Each entry is keyed by
the feature where megatron-core's API shows it (a parameter, a field, a module), and by the release
only where nothing in the API does. When 0.16.1 is dropped, each ``# 0.16`` branch below is what goes.

====  ===========================================  =======  =====================================  ==========================================
row   what changed in megatron-core                since    cp_ext                                 test that fails without it (on 0.19)
====  ===========================================  =======  =====================================  ==========================================
1     ``datasets.megatron_tokenizer`` removed;     0.17     tokenizers subclass                    tests/data/test_loader.py
      datasets type against                                 ``tokenizers.MegatronTokenizerBase``,
      ``tokenizers.MegatronTokenizerBase``                  which 0.16.1 has too
2     ``TorchCommonLoadStrategy`` and              0.17 /   `load_checkpoint`,                     tests/checkpoint/test_resume.py;
      ``load(common_strategy=)`` removed; the      0.19     `read_common_state`,                   test_checkpoint_across_versions.py
      common state moves from ``common.pt`` into            `COMMON_STATE_EMBEDDED_ON_SAVE`,       (on 0.16.1: 0.19's form)
      the torch_dist files                                  `READS_EMBEDDED_COMMON_STATE`
3     the MoE spec's mlp and experts are           0.18     `spec_parts`                           tests/test_megatron_compat.py (seats),
      ``functools.partial``, not ``ModuleSpec``                                                    every MoE model test
4     ``MultiTokenPredictionLayerSubmodules.       0.17 /   `MTP_INNER_LAYER_FIELD`,               tests/models/test_mtp_roll.py,
      transformer_layer`` -> ``mtp_model_layer``;  0.18     `MTP_EMBEDDINGS_CARRY_PADDING_MASK`    the MTP grid cases
      ``_get_embeddings`` returns the padding mask
5     ``MLASelfAttention.__init__`` takes          0.18     the subclass passes keywords through   the MLA grid cases
      ``pp_layer_offset`` and ``name``                      (`cp_ext.transformer.mla`)
6     MLA's q/kv-norm resolver wants a fused       0.19     a plain ``linear_q_proj`` without      tests/test_families.py (DeepSeek-V2-Lite)
      norm on ``linear_q_proj`` without q-LoRA              q-LoRA, as 0.16.1 (`transformer.mla`)
7     ``apply_rotary_pos_emb`` no longer infers    0.19     `MLA_ROPE_KWARGS`                      the MLA grid cases (cp2_ring_mla,
      MLA's interleaving from the config                                                           tp2sp_mla: every gradient vs CP1)
8     the router scales the aux and z losses by    0.19     `ROUTER_SCALES_AUX_LOSS_BY_TP_CP`      tests/training/test_router_flags.py
      the TP x CP group size itself                         (cp_ext.config)                        (CP2 vs DP2, aux and z losses)
9     the MoE loss tracker is an object;           0.18     `reset_moe_loss_tracker`,              tests/test_megatron_compat.py
      ``get_moe_layer_wise_logging_tracker()``              `reduced_moe_losses`,                  (a second, deeper model)
      returns a copy                                        `zero_moe_loss_tracker`
10    "GPTModel IS DEPRECATED" on every start      0.19     `quiet_gpt_model_deprecation`          tests/test_megatron_compat.py (startup)
--    param groups matched on load by their        0.19     the checkpoint's values put back       tests/checkpoint/test_safety.py
      schedule values too (``max_lr``, ...)                 after the match (checkpoint.           (a resume with a new --lr)
                                                            state)
11    an MTP layer's inner transformer layer       0.19     `model_layer_number`                   tests/training/
      numbers itself from 1 (``is_mtp_layer``),                                                    test_deepseek_v4_training.py (its
      not after the decoder's layers                                                               MTP layer's kind, router, streams)
12    ``dist_checkpointing.save`` takes            0.19     `ASYNC_SAVE_KWARGS` (megatron-core's   tests/checkpoint/test_async_save.py
      ``async_strategy``, default "nvrx"                    own async machinery: "mcore")
--    a flag only newer releases have:             0.17     `MTP_REPEATED_LAYER`, `needs_release`  tests/test_megatron_compat.py
      ``--mtp-use-repeated-layer``                          (refused at parse time before 0.17)
====  ===========================================  =======  =====================================  ==========================================

And in `cp_ext.platform`, two CPU/no-TE fixes are redundant from 0.17 on and skip themselves there:
``moe_utils.te_general_gemm`` is defined (as None without TE), and MLA imports TE's own ``HAVE_TE``.

Why not megatron's ``HybridModel`` (row 10)? It exists only from 0.19, builds its layers from a
pattern string rather than the decoder block spec cp_ext fills, and names its checkpoint keys
differently: using it would mean two model paths and two checkpoint layouts. GPTModel is still
megatron's supported model on every release here, so the notice is silenced instead.
"""

import functools
import inspect
import io
import logging
import os

from megatron.core import dist_checkpointing
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from cp_ext import MEGATRON_CORE_VERSION
from cp_ext.errors import ConfigError
from cp_ext.megatron_version import at_least

# ---------------------------------------------------------------- row 2: checkpoints' common state

COMMON_STATE_FILE = "common.pt"

COMMON_STATE_EMBEDDED_ON_SAVE = at_least(MEGATRON_CORE_VERSION, "0.19")
"""0.19: ``dist_checkpointing.save`` writes the plain values (iteration, args, scheduler, Adam's step)
as one ShardedObject ``common_state`` inside the torch_dist files instead of ``common.pt``. (Only the
release shows it: the save's signature did not change.)"""

_LOAD_TAKES_COMMON_STRATEGY = "common_strategy" in inspect.signature(dist_checkpointing.load).parameters
# 0.16: load(common_strategy=...) reads common.pt through a strategy cp_ext can replace; 0.17-0.18 read
# common.pt only; 0.19 reads either form itself.
READS_EMBEDDED_COMMON_STATE = _LOAD_TAKES_COMMON_STRATEGY or COMMON_STATE_EMBEDDED_ON_SAVE
"""Whether this megatron-core (with cp_ext's reader on 0.16.1) reads a checkpoint whose common state is
inside the torch_dist files. 0.17 and 0.18 cannot."""


def common_state_is_embedded(directory):
    """Whether the checkpoint in ``directory`` keeps its common state inside the torch_dist files (0.19's form)."""
    return not os.path.exists(os.path.join(str(directory), COMMON_STATE_FILE))


def read_common_state(directory):
    """A checkpoint's plain values, from ``common.pt`` or from the torch_dist files' ``common_state``
    (either writer's form; torch.load with weights_only, so a crafted file cannot run code)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    directory = str(directory)
    if not common_state_is_embedded(directory):
        return torch.load(os.path.join(directory, COMMON_STATE_FILE), map_location="cpu", weights_only=True)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    holder = {key: io.BytesIO()}
    dcp_load(holder, storage_reader=FileSystemReader(directory), no_dist=True)
    loaded = holder[key]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, map_location="cpu", weights_only=True)
    return loaded[0]


def unreadable_reason(directory):
    """Why this megatron-core cannot read the torch_dist checkpoint in ``directory`` at all, or None."""
    if common_state_is_embedded(directory) and not READS_EMBEDDED_COMMON_STATE:
        return (f"{directory} keeps its plain values inside its torch_dist files (no {COMMON_STATE_FILE}), as "
                f"megatron-core 0.19 and later write them, and megatron-core {MEGATRON_CORE_VERSION} cannot read "
                f"that form: load it with megatron-core 0.19 or later (pip install 'megatron-core>=0.19,<0.20', "
                f"Python 3.12), or with 0.16.1")
    return None


def load_checkpoint(sharded_state_dict, directory, **kwargs):
    """``dist_checkpointing.load`` that reads both forms of the common state on every supported release
    that can (`READS_EMBEDDED_COMMON_STATE`); on one that cannot, a `ConfigError` saying so."""
    reason = unreadable_reason(directory)
    if reason:
        raise ConfigError(reason)
    if _LOAD_TAKES_COMMON_STRATEGY:  # 0.16
        kwargs["common_strategy"] = _common_state_reader()
    return dist_checkpointing.load(sharded_state_dict, str(directory), **kwargs)


# ---------------------------------------------------------------- row 12: async save strategy

# From 0.19 an asynchronous save goes through nvidia-resiliency-ext's writer unless told otherwise;
# cp_ext uses megatron-core's own (the one 0.16.1 has), which needs no extra package.
ASYNC_SAVE_KWARGS = ({"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
                     else {})


@functools.cache
def _common_state_reader():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonStateReader(TorchCommonLoadStrategy):
        """0.16.1's common-state strategy, reading 0.19's embedded form too."""

        def load_common(self, checkpoint_dir):
            return read_common_state(checkpoint_dir)

    return CommonStateReader()


# ---------------------------------------------------------------- row 3: spec slots

def spec_parts(spec):
    """(module class, submodules) of one slot of a layer spec: a ``ModuleSpec`` (0.16, 0.17) or, for
    the MoE layer and its experts from 0.18 on, a ``functools.partial(Class, submodules=...)``. The
    submodules object is the spec's own, so setting its fields fills the seat."""
    if isinstance(spec, ModuleSpec):
        return spec.module, spec.submodules
    if isinstance(spec, functools.partial):
        return spec.func, spec.keywords.get("submodules")
    return spec, None


# ---------------------------------------------------------------- row 4: multi-token prediction

MTP_INNER_LAYER_FIELD = next(name for name in ("mtp_model_layer", "transformer_layer")
                             if name in multi_token_prediction.MultiTokenPredictionLayerSubmodules.__dataclass_fields__)
"""The MTP layer spec's field holding its transformer layer: ``transformer_layer`` (0.16), ``mtp_model_layer`` (0.17)."""


def model_layer_number(layer) -> int:
    """A transformer layer's number in the whole model, MTP layers after the decoder's (0.16: its ``layer_number``;
    0.19 numbers an MTP layer's inner layer from 1 and marks it ``is_mtp_layer``)."""
    if getattr(layer, "is_mtp_layer", False):  # 0.19
        return layer.config.num_layers + layer.layer_number
    return layer.layer_number


MTP_EMBEDDINGS_CARRY_PADDING_MASK = "padding_mask" in inspect.signature(
    multi_token_prediction.MultiTokenPredictionLayer._get_embeddings).parameters
"""0.18: ``MultiTokenPredictionLayer._get_embeddings`` takes and rolls a padding mask and returns
(input_ids, position_ids, padding_mask, decoder_input, hidden_states) instead of four values."""


MTP_REPEATED_LAYER = "mtp_use_repeated_layer" in TransformerConfig.__dataclass_fields__
"""0.17: ``--mtp-use-repeated-layer`` (megatron's ``mtp_use_repeated_layer``): one MTP layer's weights for
every depth. Older releases have no such field: the flag is refused there (`needs_release`)."""


def needs_release(flag, release):
    """The message for a flag this megatron-core does not have: the release that has it, and the fix."""
    return (f"{flag} needs megatron-core {release} or later, and {MEGATRON_CORE_VERSION} is installed: pip install "
            f"'megatron-core>={release},<0.20' (megatron-core 0.17 and later need Python >= 3.12), or drop {flag}")


# ---------------------------------------------------------------- row 7: MLA's RoPE

MLA_ROPE_KWARGS = ({"mla_rotary_interleaved": True}
                   if "mla_rotary_interleaved" in inspect.signature(rope_utils.apply_rotary_pos_emb).parameters else {})
"""What a caller of ``apply_rotary_pos_emb`` passes for MLA's rotation. 0.16-0.18 read it from
``config.multi_latent_attention``; 0.19 takes ``mla_rotary_interleaved=True`` from the caller (as its
own MLA does) and rotates non-interleaved pairs without it: no error, other numbers."""


# ---------------------------------------------------------------- row 8: the router's aux-loss scale

ROUTER_SCALES_AUX_LOSS_BY_TP_CP = at_least(MEGATRON_CORE_VERSION, "0.19")
"""0.19: under ``calculate_per_token_loss`` the router multiplies the aux and z losses by the TP x CP
group size as well as the local token count (moe/router.py), so their gradients no longer depend on
the layout, and cp_ext's own compensation (`cp_ext.config.aux_loss_layout_factor`) must be 1. Only the
release shows it: the router's signatures did not change."""


# ---------------------------------------------------------------- row 9: the MoE loss tracker

def _tracker_object():
    """0.18+: megatron's `MoEMetricsTracker`; None on 0.16-0.17 (a module-level dict)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16, 0.17
        return None
    return get_moe_metrics_tracker()


def reset_moe_loss_tracker():
    """Empty megatron's process-wide MoE loss tracker: it is sized by the first model's layer count, so a
    process that builds another model (tools, tests) starts it afresh."""
    tracker = _tracker_object()
    if tracker is None:  # 0.16: the dict itself
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:  # 0.18: the getter returns a copy; the object's entries are the tracker
        tracker.metrics.clear()


def reduced_moe_losses(average_over=None):
    """Each tracked MoE loss's per-layer sums, reduced over the ranks as megatron reduces them for its log.

    ``average_over``: {loss name: group} whose values are averaged over that group as well (megatron's
    ``avg_group``, which its router resets at every record). Returns {name: values tensor}."""
    tracker = _tracker_object()
    if tracker is None:  # 0.16
        from megatron.core.transformer.moe.moe_utils import (
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        entries = get_moe_layer_wise_logging_tracker()
        for name, group in (average_over or {}).items():
            if name in entries:
                entries[name]["avg_group"] = group
        reduce_aux_losses_tracker_across_ranks()
        return {name: entry["values"] for name, entry in entries.items()}
    for name, group in (average_over or {}).items():
        if name in tracker.metrics:
            tracker.metrics[name].avg_group = group
    # megatron's own reduction, the one its `report` runs (and the replacement its deprecated
    # `reduce_aux_losses_tracker_across_ranks` names)
    tracker._sync_metrics(list(tracker.metrics))
    return {name: entry.values for name, entry in tracker.metrics.items()}


def local_moe_losses():
    """Each tracked MoE loss's per-layer sums on this rank alone, unreduced: {name: values tensor}."""
    tracker = _tracker_object()
    if tracker is None:  # 0.16
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return {name: entry.values for name, entry in tracker.metrics.items()}


def zero_moe_loss_tracker():
    """Zero the tracked values after they were read (the entries stay)."""
    tracker = _tracker_object()
    if tracker is None:  # 0.16
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
    else:
        tracker.clear()


# ---------------------------------------------------------------- row 10: GPTModel's deprecation notice

class _WithoutGPTModelDeprecation(logging.Filter):
    def filter(self, record):
        return not str(record.msg).startswith("GPTModel IS DEPRECATED")


def quiet_gpt_model_deprecation():
    """0.19 logs "GPTModel IS DEPRECATED" (use HybridModel) at every GPTModel; cp_ext builds GPTModel on
    purpose (see the module doc), so the notice is dropped, and only it."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, _WithoutGPTModelDeprecation) for f in logger.filters):
        logger.addFilter(_WithoutGPTModelDeprecation())
