"""The checkpoint checks as plain functions: what a save must hold, and the one-line load mismatch."""

from pathlib import Path

from lightning_sppo import GPT
from lightning_sppo.strategy.checkpoint_checks import Written, load_mismatch, plain_shapes, save_shortfall
from tests.conftest import parity_config

CONFIG = parity_config(n_layer=4)
PATH = Path("ckpt")


def test_plain_shapes_are_the_plain_models_state_dict():
    assert plain_shapes(CONFIG) == {k: tuple(v.shape) for k, v in GPT(CONFIG).state_dict().items()}


def test_a_save_holding_every_stage_passes_and_one_without_a_stage_names_its_keys():
    expected = plain_shapes(CONFIG)
    keys = list(expected)
    stage1 = frozenset(k for k in keys if k.startswith(("blocks.2.", "blocks.3.", "norm_f.", "lm_head.")))
    stage0 = frozenset(keys) - stage1
    full = [Written(True, stage, {"opt": (stage, stage)}) for stage in (stage0, stage1)]
    assert save_shortfall(PATH, expected, full, distributed=True) is None
    reason = save_shortfall(PATH, expected, [full[0]], distributed=True)
    assert "model state lacks 16 (blocks.2.norm_1.weight" in reason and "save_distributed_checkpoint=False" in reason
    # Stage 1's optimizer state is not written although its parameters have state (a non-leader reports them).
    lacking = [full[0], Written(True, stage1, {"opt": (frozenset(), frozenset())}), Written(False, frozenset(),
               {"opt": (frozenset(), stage1)})]  # fmt: skip
    assert "optimizer 'opt' state lacks 16 (blocks.2.norm_1.weight" in save_shortfall(PATH, expected, lacking, False)


def test_a_checkpoint_of_another_size_names_the_first_mismatch_in_one_line():
    expected = plain_shapes(CONFIG)
    smaller = parity_config(n_layer=2)
    saved = plain_shapes(smaller)
    reason = load_mismatch(PATH, saved, expected, True, "model", smaller.to_dict(), CONFIG)
    assert "\n" not in reason
    assert "it has no 'blocks.2.norm_1.weight' (shape [32])" in reason
    assert "saved from a model with n_layer=2 (this one has n_layer=4)" in reason
    # Without strict, missing keys pass; a wrong shape never does. Without model_config, no hint.
    assert load_mismatch(PATH, saved, expected, False, "model", None, CONFIG) is None
    wider = plain_shapes(parity_config(n_layer=4, vocab_size=96))
    reason = load_mismatch(PATH, wider, expected, False, "model", None, CONFIG)
    assert reason.endswith("'wte.weight' has shape [96, 32] there but [64, 32] in this model. Build the model with"
                           " the checkpoint's architecture, or load a checkpoint of this model.")  # fmt: skip
    assert "no 'model' entry" in load_mismatch(PATH, None, expected, True, "model", None, CONFIG)
    assert load_mismatch(PATH, expected, expected, True, "model", CONFIG.to_dict(), CONFIG) is None
