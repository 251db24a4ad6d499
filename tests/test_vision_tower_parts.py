"""The vision tower's sub-block points (``vision.blocks.{i}.hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_in``,
``hook_mlp_out``, ``ln1``/``ln2.hook_normalized``): each read is what a plain PyTorch hook on the block's children
reads, each edit changes the logits exactly as the same edit by plain hooks does, no hook means HF's logits
bitwise, and a block whose MLP does not read ``resid_pre + attn_out`` gets its residual points only, by name."""

from __future__ import annotations

import warnings

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.vlm import inputs, logits_of, logits_with, tower_blocks_of, vlm
from lensadapters.wiring.vision_tower import VisionTowerWarning
from tests.test_vision_tower import FAMILIES, RECORDED_INSIDE_ON_4, TRANSFORMERS_4
from tests.vision_tower_helpers import (
    assert_reads_and_edits,
    block_references,
    per_block,
    plain_reads_and_edits,
    resid_mid_and_attn_out_edits,
)

#: the children (attention, MLP, norm before each) of each family's tower blocks, by their HF names
CHILDREN: dict[str, tuple[str, str, str, str]] = {
    "mistral3": ("attention", "feed_forward", "attention_norm", "ffn_norm"),
}
DEFAULT_CHILDREN = ("self_attn", "mlp", "layer_norm1", "layer_norm2")
SERVED = [f for f in FAMILIES if not (TRANSFORMERS_4 and f in RECORDED_INSIDE_ON_4)]


@pytest.mark.parametrize("name", SERVED)
def test_sub_block_points_read_and_edit_as_plain_hooks_do(name: str) -> None:
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    children = CHILDREN.get(name, DEFAULT_CHILDREN)
    plain = plain_reads_and_edits(model, batch, per_block(blocks, lambda i, block: block_references(block, children)))
    hf = logits_with(model, batch)
    hm = HookedModel.wrap(model)
    assert set(plain) <= set(hm.hook_dict)
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: p.startswith("vision.blocks."))
        assert_reads_and_edits(hm, batch, plain, cache)  # every image's call
        for i in range(len(blocks)):
            at = f"vision.blocks.{i}."
            mid = cache[at + "hook_resid_pre"] + cache[at + "hook_attn_out"]
            assert torch.equal(cache[at + "hook_resid_mid"], mid)
            assert torch.equal(cache[at + "hook_resid_post"], cache[at + "hook_resid_mid"] + cache[at + "hook_mlp_out"])
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()


@pytest.mark.parametrize("name", SERVED)
def test_an_edit_of_resid_mid_is_an_edit_of_attn_out_by_the_same_difference(name: str) -> None:
    """Adding ``d`` to ``hook_resid_mid`` or to ``hook_attn_out`` is the same edit of the residual stream (up to the
    rounding of the sum's order): block 0's, which every family's language model reads."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    hm = HookedModel.wrap(model)
    resid_mid_and_attn_out_edits(hm, batch)
    hm.unwrap()


def test_a_block_whose_mlp_reads_more_than_the_residual_gets_its_residual_points_only() -> None:
    """A hook of the user's adds 1 to block 0's ``ln2`` input: its MLP no longer reads ``resid_pre + attn_out``; the
    blocks' sub-block points are refused by name, their residual points still served."""
    model, n_image = vlm("llava")
    ln2 = tower_blocks_of(model)[0].layer_norm2
    handle = ln2.register_forward_pre_hook(lambda module, args: (args[0] + 1, *args[1:]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]
    assert len(messages) == 1 and "attention and MLP points are not served" in messages[0]
    assert "block 0 has no attention and MLP children" in messages[0]
    served = [p for p in hm.hook_dict if p.startswith("vision.")]
    assert "vision.blocks.0.hook_resid_post" in served and not any("mlp" in p or "attn" in p for p in served)
    hm.unwrap()
    handle.remove()
