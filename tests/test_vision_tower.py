"""The vision tower's residual points (``vision.*``) of vision-language models: each read is what a plain PyTorch
hook on the tower's blocks reads, each edit changes the logits exactly as the same edit by a plain hook does (and
reaches the language model: LLaVA reads its selected tower layer from the tower's ``hidden_states`` record), no hook
means HF's logits bitwise, and a tower the probe cannot run is refused by name."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import transformers

from lensadapters import HookedModel, UnfiredHookWarning
from lensadapters.testing.vlm import inputs, logits_of, logits_with, tower_block_points, tower_blocks_of, vlm
from lensadapters.wiring.vision_tower import VisionTowerWarning
from tests.vision_tower_helpers import assert_reads_and_edits, plain_hook, plain_reads_and_edits, scale_shift

FAMILIES = ("llava", "llava_next", "gemma3", "idefics3", "smolvlm", "mistral3")
#: the families whose towers record ``hidden_states`` inside their blocks' forward on transformers 4.x (an edit of a
#: block's output by a forward hook is not what the record holds): refused there, by name
RECORDED_INSIDE_ON_4 = ("gemma3", "idefics3", "smolvlm")
TRANSFORMERS_4 = transformers.__version__.startswith("4.")


def _points(n: int) -> list[tuple[str, int, str]]:
    """Each point, its block and whether it is the block's input (``pre``) or output (``post``)."""
    points = [("vision.hook_embed", 0, "pre")]
    for i in range(n):
        points += [(f"vision.blocks.{i}.hook_resid_pre", i, "pre"), (f"vision.blocks.{i}.hook_resid_post", i, "post")]
    return points


#: the attention points of each block (tests/test_vision_tower_attention.py), in the order they fire
ATTENTION = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z")
#: where a tower rotating its queries and keys (Pixtral) adds its rotary points, right after each projection's
ROTARY_ORDER = {"attn.hook_q": ("attn.hook_q", "attn.hook_rot_q"), "attn.hook_k": ("attn.hook_k", "attn.hook_rot_k")}
#: the families whose towers rotate their queries and keys
ROTARY_TOWERS = ("mistral3",)
#: the sub-block points of each block (tests/test_vision_tower_parts.py), in the order they fire
SUB_BLOCK = tower_block_points(ATTENTION, output=False)[1:-1]


def _served(n: int, rotary: bool = False) -> list[str]:
    """Every point of a tower of ``n`` blocks, in the order they fire (``rotary``: its queries and keys rotated)."""
    sub_block = SUB_BLOCK if not rotary else tuple(ROTARY_ORDER.get(s, s) for s in SUB_BLOCK)
    names = ["vision.hook_embed"]
    for i in range(n):
        at = f"vision.blocks.{i}."
        names += [
            at + "hook_resid_pre",
            *(at + s for s in _flat(sub_block)),
            at + "hook_mlp_out",
            at + "hook_resid_post",
        ]
    return names


def _flat(names: tuple) -> list[str]:
    return [n for entry in names for n in (entry if isinstance(entry, tuple) else (entry,))]


def _plain_residuals(model: Any, batch: dict, blocks: Any) -> dict[str, tuple[list, torch.Tensor]]:
    """Each residual point's values as a plain hook on its block reads them (every call), and the logits with
    :func:`scale_shift` made there by a plain hook."""
    references = {
        point: lambda seen, edit, i=i, kind=kind: [plain_hook(blocks[i], kind, seen, edit)]
        for point, i, kind in _points(len(blocks))
    }
    return plain_reads_and_edits(model, batch, references)


@pytest.mark.parametrize("name", FAMILIES)
def test_tower_points_read_and_edit_as_plain_hooks_do(name: str) -> None:
    model, n_image = vlm(name)
    if TRANSFORMERS_4 and name in RECORDED_INSIDE_ON_4:
        with pytest.warns(VisionTowerWarning, match=r"output does not reach its hidden_states record"):
            hm = HookedModel.wrap(model)
        assert not any(p.startswith("vision.") for p in hm.hook_dict)
        return
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain = _plain_residuals(model, batch, blocks)
    hf = logits_with(model, batch)
    hm = HookedModel.wrap(model)
    assert [p for p in hm.hook_dict if p.startswith("vision.")] == _served(len(blocks), name in ROTARY_TOWERS)
    served = [p for p, _, _ in _points(len(blocks))]
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=served)
        for point in served:
            seen, edited = plain[point]
            assert len(seen) >= 1 and cache[point].shape[0] == sum(s.shape[0] for s in seen)
            assert torch.equal(cache[point], torch.cat(seen)), point  # every image's call, in order
            got = hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: scale_shift(x))])
            got = logits_of(got)
            assert torch.equal(got, edited), point
            # the edit reaches the language model; LLaVA's projector reads block 0's output as the tower recorded it
            # (``vision_feature_layer=-2``): block 1 and an edit of its input come after, and change nothing
            unused = name.startswith("llava") and point.startswith("vision.blocks.1.")
            assert torch.equal(got, hf) == unused, point
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()


def test_an_edit_of_the_selected_tower_layer_reaches_the_projector() -> None:
    """LLaVA projects the tower's second-to-last layer (``vision_feature_layer=-2``), read from the tower's
    ``hidden_states`` record (transformers 5.x: a forward hook on each block, installed at the first forward): an
    edit of block 0's output is what the projector reads, also after the model ran once before it was wrapped."""
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    logits_with(model, batch)  # HF's recording hooks are on the blocks now
    hm = HookedModel.wrap(model)
    post = "vision.blocks.0.hook_resid_post"
    with torch.no_grad():
        _, base = hm.run_with_cache(**batch, names_filter=[post])
        with hm.hooks([(post, lambda x, hook: scale_shift(x))]):
            _, cache = hm.run_with_cache(**batch, names_filter=["vision_projector.hook_in"])
    assert torch.equal(cache["vision_projector.hook_in"], scale_shift(base[post])[:, 1:])  # the CLS token dropped
    hm.unwrap()


def test_tower_points_without_an_image_warn_by_name() -> None:
    model, n_image = vlm("llava")
    hm = HookedModel.wrap(model)
    with pytest.warns(UnfiredHookWarning, match=r"vision\.blocks\.1\.hook_resid_post"):
        with torch.no_grad(), hm.hooks([("vision.blocks.1.hook_resid_post", lambda x, hook: x)]):
            hm(**inputs(model, n_image, image=False))
    hm.unwrap()


def test_a_tower_taking_patch_positions_gets_its_residual_points() -> None:
    """Gemma 4's tower takes its image as patches with their (x, y) positions (``pixel_position_ids``) and records
    its pooled image tokens last among its ``hidden_states``: the probe builds both inputs from the tower's config,
    the residual points read and edit as plain hooks on its blocks do (an edit reaching the language model); its
    sandwich-normed blocks' sub-block and attention points are served too, without a warning
    (tests/test_vision_tower_gemma4.py). (A tower needing an input the probe cannot build is refused by name:
    tests/test_vision_tower_qwen.py.)"""
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain = _plain_residuals(model, batch, blocks)
    hf = logits_with(model, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]
    assert messages == []
    served = [p for p, _, _ in _points(len(blocks))]
    assert [p for p in hm.hook_dict if p in served] == served
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)
        _, cache = hm.run_with_cache(**batch, names_filter=served)
        assert_reads_and_edits(hm, batch, {point: plain[point] for point in served}, cache, changed_from=hf)
    hm.unwrap()


@pytest.mark.parametrize("name", ["gemma3", "idefics3"])
def test_the_probe_leaves_nothing_on_the_tower(name: str) -> None:
    """The probe's forwards ask for ``hidden_states``; transformers then installs its recording hooks on the blocks
    (once, for good): the probe removes what it caused, so a model that never records keeps no hook of it."""
    model, _ = vlm(name)

    def state() -> list:
        return [(n, list(m._forward_hooks), sorted(vars(m))) for n, m in model.named_modules()]

    before = state()
    hm = HookedModel.wrap(model)
    assert state() == before
    hm.unwrap()
