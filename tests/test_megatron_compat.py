"""The supported megatron-core range and the compatibility layer's own entries (cp_ext.megatron_version,
cp_ext.megatron_compat).

What each row of megatron_compat's table protects is tested where it matters, on every leg CI runs
(Python 3.11 with megatron-core 0.16.1, Python 3.12 with 0.19.x): the model, loader, MTP, MLA,
router and checkpoint tests named in that table. Here: the range check, the entries' answers on the
installed release, the spec slots of both forms, the silenced deprecation notice, and the message for
a checkpoint this release cannot read.
"""

import functools
import json
import logging

import pytest

from tests.launch import one_rank_megatron, run_code


@pytest.mark.quick
@pytest.mark.parametrize("version, supported", [
    ("0.15.3", False), ("0.16.0", False), ("0.16.1", True), ("0.17.0", True), ("0.18.2", True), ("0.19.0rc1", True),
    ("0.19.2", True), ("0.19.9.dev3", True), ("0.20.0", False), ("0.20.0rc0", False), ("1.0.0", False),
])
def test_supported_range(version, supported):
    from cp_ext import megatron_version

    assert megatron_version.in_range(version) == supported
    problem = megatron_version.megatron_core_problem(version, "0.1.0")
    assert (problem is None) == supported
    if problem:
        assert f"supports megatron-core 0.16.1 through 0.19.x, but {version} is installed" in problem
        assert "pip install 'megatron-core>=0.16.1,<0.20'" in problem and "CP_EXT_ALLOW_MEGATRON_CORE" in problem


def test_range_matches_pyproject():
    """pip's requirement and the import-time check say the same range."""
    from cp_ext import megatron_version
    from tests.launch import REPO_ROOT

    assert f'"{megatron_version.REQUIREMENT}"' in (REPO_ROOT / "pyproject.toml").read_text()


@pytest.mark.quick
def test_entries_answer_for_the_installed_release():
    """Each feature entry agrees with the release installed (the two ends CI runs, and 0.17/0.18 between)."""
    import inspect

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import multi_token_prediction as mtp

    from cp_ext import MEGATRON_CORE_VERSION, megatron_compat
    from cp_ext.megatron_version import at_least

    new = at_least(MEGATRON_CORE_VERSION, "0.19")
    assert megatron_compat.COMMON_STATE_EMBEDDED_ON_SAVE == new
    assert megatron_compat.READS_EMBEDDED_COMMON_STATE == (new or not at_least(MEGATRON_CORE_VERSION, "0.17"))
    assert megatron_compat.ROUTER_SCALES_AUX_LOSS_BY_TP_CP == new
    assert megatron_compat.MLA_ROPE_KWARGS == ({"mla_rotary_interleaved": True} if new else {})
    assert (megatron_compat.MLA_ROPE_KWARGS == {}) == (
        "mla_rotary_interleaved" not in inspect.signature(rope_utils.apply_rotary_pos_emb).parameters)
    assert hasattr(mtp.MultiTokenPredictionLayerSubmodules(enorm=None, hnorm=None, layer_norm=None),
                   megatron_compat.MTP_INNER_LAYER_FIELD)
    assert megatron_compat.MTP_INNER_LAYER_FIELD == ("mtp_model_layer" if at_least(MEGATRON_CORE_VERSION, "0.17")
                                                     else "transformer_layer")


def test_spec_parts_reads_both_forms():
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from cp_ext.megatron_compat import spec_parts

    submodules = MLPSubmodules(linear_fc1=None, linear_fc2=None)
    for spec in (ModuleSpec(module=SequentialMLP, submodules=submodules), functools.partial(SequentialMLP, submodules=submodules)):
        module, parts = spec_parts(spec)
        assert module is SequentialMLP and parts is submodules  # the spec's own: setting a field fills the seat
    assert spec_parts(SequentialMLP) == (SequentialMLP, None) and spec_parts(None) == (None, None)


def test_moe_spec_seats_are_filled_on_this_release(tmp_path):
    """cp_ext's expert fc2 sits in megatron's MoE spec, whichever form the release's spec takes."""
    code = one_rank_megatron(tmp_path) + """
        from cp_ext.config import ContextParallelTransformerConfig
        from cp_ext.megatron_compat import spec_parts
        from cp_ext.models.gpt_moe import get_decoder_block_spec
        from cp_ext.transformer.experts import ExpertRowParallelLinear
        config = ContextParallelTransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                                                  moe_ffn_hidden_size=8, add_bias_linear=False)
        block = get_decoder_block_spec(config)
        _, mlp = spec_parts(block.layer_specs[0].submodules.mlp)
        _, experts = spec_parts(mlp.experts)
        assert experts.linear_fc2 is ExpertRowParallelLinear, experts
        print("SEATED")
    """.replace("\n        ", "\n")
    assert "SEATED" in run_code(code).stdout


def test_gpt_model_deprecation_notice_is_silenced_and_nothing_else():
    from cp_ext.megatron_compat import quiet_gpt_model_deprecation

    quiet_gpt_model_deprecation()
    quiet_gpt_model_deprecation()  # idempotent: one filter
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    assert len(logger.filters) == 1

    def passes(message):
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, (), None)
        return all(f.filter(record) for f in logger.filters)

    assert not passes("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
    assert passes("something else megatron says")


def test_a_checkpoint_this_release_cannot_read_is_one_message(tmp_path):
    """0.17 and 0.18 cannot read 0.19's embedded common state: parse time says so, naming both versions
    (simulated here by telling the compatibility layer this release cannot read it)."""
    ckpt = tmp_path / "ckpt"
    it = ckpt / "iter_0000004"
    it.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    (it / "metadata.json").write_text("{}")
    (it / "meta.json").write_text(json.dumps({"iteration": 4, "format": "torch_dist", "megatron_core": "0.19.2"}))
    code = f"""
        from cp_ext import megatron_compat, MEGATRON_CORE_VERSION
        megatron_compat.READS_EMBEDDED_COMMON_STATE = False   # as on 0.17 / 0.18
        from cp_ext.arguments import ConfigError, parse_args
        try:
            parse_args(["--load", "{ckpt}", "--train-iters", "8"], world_size=1)
        except ConfigError as e:
            print("REFUSED", e)
        try:
            megatron_compat.load_checkpoint({{}}, "{it}")
        except ConfigError as e:
            print("LOAD REFUSED", e)
    """
    out = run_code(code).stdout
    assert "REFUSED" in out and "written by megatron-core 0.19.2" in out and "cannot read that form" in out, out
    assert "LOAD REFUSED" in out and "no common.pt" in out, out


def test_a_flag_of_a_newer_release_is_refused_on_an_older_one():
    """--mtp-use-repeated-layer is megatron-core 0.17's: before it, one message naming the release; from it,
    megatron's own config field is set (tests/training/test_grid_equivalence.py trains with it)."""
    from cp_ext.arguments import ConfigError, parse_args
    from cp_ext.config import transformer_config_from_args
    from cp_ext.megatron_compat import MTP_REPEATED_LAYER

    argv = ["--mtp-num-layers", "2", "--mtp-use-repeated-layer"]
    if not MTP_REPEATED_LAYER:
        with pytest.raises(ConfigError, match=r"--mtp-use-repeated-layer needs megatron-core 0\.17 or later, and "
                                              r"0\.16\.1 is installed: pip install 'megatron-core>=0\.17,<0\.20'"):
            parse_args(argv, world_size=1)
        return
    assert transformer_config_from_args(parse_args(argv, world_size=1)).mtp_use_repeated_layer is True
    assert transformer_config_from_args(parse_args(argv[:2], world_size=1)).mtp_use_repeated_layer is False
    with pytest.raises(ConfigError, match="--mtp-use-repeated-layer is only read with --mtp-num-layers"):
        parse_args(argv[2:], world_size=1)


@pytest.mark.quick
def test_startup_names_the_versions_and_no_deprecation_notice(tmp_path):
    """The first line a run prints names cp_ext, megatron-core, torch and Python; megatron 0.19's "GPTModel
    IS DEPRECATED" is not printed (cp_ext builds GPTModel on purpose: megatron_compat, row 10)."""
    from cp_ext import MEGATRON_CORE_VERSION
    from tests.launch import REPO_ROOT, run_script

    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", "--num-layers", "1", "--hidden-size", "16",
                      "--num-attention-heads", "2", "--seq-length", "16", "--global-batch-size", "1",
                      "--train-iters", "1", "--log-dir", tmp_path, timeout=300)
    assert f"on megatron-core {MEGATRON_CORE_VERSION}, torch " in proc.stdout.splitlines()[0], proc.stdout[:500]
    assert "DEPRECATED" not in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_a_second_model_in_one_process_tracks_its_own_moe_losses():
    """megatron's MoE loss tracker is process-wide and sized by the first model's layers; a Trainer starts
    it afresh (on 0.18+ through the tracker object: the old getter returns a copy, whose clear() does
    nothing, and a deeper second model then fails with an IndexError in megatron's moe_logging)."""
    code = """
        from cp_ext.arguments import parse_args, single_process_without_torchrun
        single_process_without_torchrun()
        from cp_ext.training.trainer import Trainer
        flags = ["--hidden-size", "16", "--num-attention-heads", "2", "--num-experts", "2", "--seq-length", "16",
                 "--global-batch-size", "1", "--train-iters", "1"]
        for layers in ("1", "3"):
            trainer = Trainer(parse_args(flags + ["--num-layers", layers]))
            metrics = trainer.train_step()
            print("LAYERS", layers, "load balancing loss" in metrics)
            trainer.shutdown(keep_process_group=True)
    """
    out = run_code(code).stdout
    assert "LAYERS 1 True" in out and "LAYERS 3 True" in out, out
