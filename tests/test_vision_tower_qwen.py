"""The vision tower's points of Qwen's vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen 3.5), whose
towers take flattened patches and their grid (``hidden_states``, ``grid_thw``) instead of ``pixel_values``: the
probe builds those from the tower's config (:mod:`lensadapters.wiring.vision_inputs`). The residual and sub-block
points are served; each read is what a plain PyTorch hook on the tower's blocks (and their children) reads, each
edit changes the logits exactly as the same edit by a plain hook does, reading changes nothing, no hook means HF's
logits bitwise, and the language model's points are those (and the values) it has with the tower refused. Their
attention's points (one fused ``qkv`` projection, a 2-D rotary, attention image by image) are
``tests/test_vision_tower_qwen_attention.py``'s."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import lensadapters.wiring.vision_tower as vision_tower_module
from lensadapters import HookedModel
from lensadapters.testing.vlm import (
    inputs,
    logits_of,
    logits_with,
    plain_reference,
    tower_block_points,
    tower_blocks_of,
    vlm,
)
from lensadapters.wiring.vision_inputs import probe_inputs
from lensadapters.wiring.vision_tower import VisionTowerWarning, vision_tower
from tests.test_vision_tower import _plain_residuals
from tests.vision_tower_helpers import (
    assert_reads_and_edits,
    block_references,
    per_block,
    plain_hook,
    plain_reads_and_edits,
    scale_shift,
)

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
#: Qwen's tower blocks' children: attention, MLP, the norm before each
CHILDREN = ("attn", "mlp", "norm1", "norm2")
#: a block's points, in the order they fire (the attention's: tests/test_vision_tower_qwen_attention.py)
BLOCK = tower_block_points(
    tuple(f"attn.hook_{x}" for x in ("q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern", "z"))
)


def _wrap(model: Any) -> tuple[HookedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    return hm, [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]


def test_the_probe_builds_two_images_of_flattened_patches_from_the_towers_config() -> None:
    model, _ = vlm("qwen2_5_vl")
    found = vision_tower(model)
    assert found is not None
    config = model.config.vision_config
    built, why = probe_inputs(found[1])
    assert why is None and built is not None and set(built) == {"hidden_states", "grid_thw"}
    merge = config.spatial_merge_size
    assert built["grid_thw"].tolist() == [[1, 2 * merge, 2 * merge], [1, 2 * merge, 4 * merge]]
    features = config.in_channels * config.temporal_patch_size * config.patch_size**2
    assert built["hidden_states"].shape == (12 * merge * merge, features)


@pytest.mark.parametrize("name", QWEN)
def test_qwen_tower_points_read_and_edit_as_plain_hooks_do(name: str) -> None:
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain = _plain_residuals(model, batch, blocks)
    plain.update(
        plain_reads_and_edits(model, batch, per_block(blocks, lambda i, block: block_references(block, CHILDREN)))
    )
    hf = logits_with(model, batch)
    hm, messages = _wrap(model)
    expected = ["vision.hook_embed", *(f"vision.blocks.{i}.{p}" for i in range(len(blocks)) for p in BLOCK)]
    assert [p for p in hm.hook_dict if p.startswith("vision.")] == expected
    assert not messages
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        logits, cache = hm.run_with_cache(**batch, names_filter=list(plain))
        assert torch.equal(logits_of(logits), hf)  # reading changes nothing
        # both images in one sequence (one call); every block reaches the language model
        assert_reads_and_edits(hm, batch, plain, cache, once=True, changed_from=hf)
        for i in range(len(blocks)):
            at = f"vision.blocks.{i}."
            assert torch.equal(cache[at + "hook_resid_mid"], cache[at + "hook_resid_pre"] + cache[at + "hook_attn_out"])
            assert torch.equal(cache[at + "hook_resid_post"], cache[at + "hook_resid_mid"] + cache[at + "hook_mlp_out"])
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_the_language_models_points_are_those_it_has_with_the_tower_refused(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The language model's points (names and order) are the same with the tower's points served or refused; their
    values are what plain hooks on the decoder's layers read, also under an edit of the tower's last block, which
    reaches them as the same edit by a plain hook does."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    hm, _ = _wrap(model)
    served = [p for p in hm.hook_names if not p.startswith("vision.")]
    post = f"vision.blocks.{len(tower_blocks_of(model)) - 1}.hook_resid_post"
    language = [p for p in served if p.startswith("blocks.") and p.endswith(("hook_resid_pre", "hook_resid_post"))]
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=language)
        with hm.hooks([(post, lambda x, hook: scale_shift(x))]):
            _, edited = hm.run_with_cache(**batch, names_filter=language)
    hm.unwrap()
    _, reference = plain_reference(model, batch)
    block = tower_blocks_of(model)[-1]
    handle = plain_hook(block, "post", [], scale_shift)
    try:
        _, edited_reference = plain_reference(model, batch)
    finally:
        handle.remove()
    assert language and all(torch.equal(cache[p], reference[p]) for p in language)
    assert all(torch.equal(edited[p], edited_reference[p]) for p in language)
    assert not torch.equal(edited[language[-1]], cache[language[-1]])

    monkeypatch.setattr(vision_tower_module, "probe_inputs", lambda tower: (None, "refused by the test"))
    refused, messages = _wrap(model)
    assert len(messages) == 1 and "refused by the test" in messages[0]
    assert not any(p.startswith("vision.") for p in refused.hook_dict)
    assert refused.hook_names == served
    refused.unwrap()


class _Tower(nn.Module):
    """A tower whose forward needs an argument the probe does not know (``patch_positions``)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"image_size": 4, "num_channels": 3})()
        self.proj = nn.Linear(3, 3)

    def forward(self, pixel_values: torch.Tensor, patch_positions: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


def test_a_tower_needing_an_input_the_probe_cannot_build_is_refused_by_name() -> None:
    built, why = probe_inputs(_Tower())
    assert built is None and why == "its forward needs patch_positions, which the probe cannot build"
