"""The vision tower's attention points (``vision.blocks.{i}.attn.hook_q/k/v/z``, ``hook_attn_scores``,
``hook_pattern``): ``hook_q/k/v`` read and edit as a plain forward hook on the tower's projection (its output as
``[batch, pos, head, d_head]``), ``hook_z`` as a pre-hook on its output projection; ``hook_pattern`` reads HF's eager
attention weights (also under sdpa), ``hook_attn_scores`` the scores softmaxed into them (``q k^T / sqrt(d_head)``
by hand where the tower has no rotary); an edit of either changes the logits as the same edit inside a hand-written
attention function does; no hook means HF's logits bitwise (eager and sdpa) and the tower's implementation back as
it was; the language model's points are those of a wrap without the tower's attention points."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from transformers import AttentionInterface

import lensadapters.wiring.vision_tower as vision_tower_module
from lensadapters import HookedModel, UnsupportedModelError
from lensadapters.testing.vlm import inputs, logits_of, logits_with, tower_blocks_of, vlm
from lensadapters.wiring.vision_tower import VisionTowerWarning
from tests.test_vision_tower_parts import CHILDREN, DEFAULT_CHILDREN, SERVED
from tests.vision_tower_helpers import (
    assert_reads_and_edits,
    caches_under_each_implementation,
    editing_inputs,
    logits_under_attention,
    per_block,
    plain_reads_and_edits,
    projection_hook,
    scale_shift,
    written_out_attention,
    z_hook,
)

#: the output projection of each family's tower attention, by its HF name
O_PROJ = {"mistral3": "o_proj"}
#: the families whose tower rotates its queries and keys (Pixtral's 2-D rotary) inside the attention module
ROTARY = ("mistral3",)
#: the largest differences measured here (the report's numbers), by family and check
MEASURED: dict[str, float] = {}


def _attention(name: str, block: Any) -> Any:
    return block.get_submodule(CHILDREN.get(name, DEFAULT_CHILDREN)[0])


def _heads(model: Any) -> int:
    return int(model.config.vision_config.num_attention_heads)


def _measure(key: str, a: torch.Tensor, b: torch.Tensor) -> float:
    error = float((a.double() - b.double()).abs().max())
    MEASURED[key] = max(MEASURED.get(key, 0.0), error)
    return error


def _references(name: str, block: Any, heads: int) -> dict[str, Any]:
    """The plain hooks reading and editing a block's ``attn.hook_q/k/v`` (on the projections' outputs) and
    ``attn.hook_z`` (on the output projection's input)."""
    attention = _attention(name, block)
    o_proj = getattr(attention, O_PROJ.get(name, "out_proj"))
    references: dict[str, Any] = {
        f"attn.hook_{x}": lambda seen, edit, x=x: [projection_hook(getattr(attention, f"{x}_proj"), heads, seen, edit)]
        for x in "qkv"
    }
    references["attn.hook_z"] = lambda seen, edit: [z_hook(o_proj, heads, seen, edit)]
    return references


@pytest.mark.parametrize("name", SERVED)
def test_qkv_and_z_read_and_edit_as_plain_hooks_on_the_projections_do(name: str) -> None:
    model, n_image = vlm(name)
    batch, heads = inputs(model, n_image), _heads(model)
    plain = plain_reads_and_edits(
        model, batch, per_block(tower_blocks_of(model), lambda i, block: _references(name, block, heads))
    )
    hf = logits_with(model, batch)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=list(plain))
        for point in plain:
            assert cache[point].shape[-2:] == (heads, model.config.vision_config.hidden_size // heads), point
        assert_reads_and_edits(hm, batch, plain, cache)
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()


def _eager_weights(model: Any, name: str, batch: dict) -> list[torch.Tensor]:
    """Each block's attention weights as HF's eager attention function returns them (the tower's model file's
    ``eager_attention_forward``, wrapped: transformers 4.x's modules drop the weights unless asked to output them)."""
    blocks, weights = tower_blocks_of(model), []
    modules = [_attention(name, block) for block in blocks]
    file = sys.modules[type(modules[0]).__module__]
    eager = file.eager_attention_forward

    def recording(module: Any, *args: Any, **kwargs: Any) -> Any:
        if "output_attentions" in kwargs:  # transformers 4.x's CLIP: the weights only when asked (the same output)
            kwargs["output_attentions"] = True
        out = eager(module, *args, **kwargs)
        if any(module is m for m in modules):
            weights.append(out[1].clone())
        return out

    file.eager_attention_forward = recording
    try:
        logits_with(model, batch)
    finally:
        file.eager_attention_forward = eager
    assert len(weights) == len(blocks)
    return weights


@pytest.mark.parametrize("name", SERVED)
def test_patterns_are_the_eager_attention_weights_and_scores_are_softmaxed_into_them(name: str) -> None:
    model, n_image = vlm(name)
    batch, n = inputs(model, n_image), len(tower_blocks_of(model))
    eager = _eager_weights(model, name, batch)
    hm = HookedModel.wrap(model)
    points = [
        f"vision.blocks.{i}.attn.{p}"
        for i in range(n)
        for p in ("hook_q", "hook_k", "hook_attn_scores", "hook_pattern")
    ]
    for implementation, cache in caches_under_each_implementation(model, hm, batch, points):
        for i in range(n):
            at = f"vision.blocks.{i}.attn."
            pattern, scores = cache[at + "hook_pattern"], cache[at + "hook_attn_scores"]
            assert pattern.shape == eager[i].shape == scores.shape  # [batch, head, query, key]
            assert _measure(f"{name} pattern vs eager ({implementation})", pattern, eager[i]) < 1e-6
            assert _measure(f"{name} softmax(scores) vs pattern", torch.softmax(scores, -1), pattern) < 1e-6
            if name in ROTARY:  # a query sees its own image's patches only: the others' are masked
                assert bool((scores == float("-inf")).any()) and torch.equal(pattern == 0, scores == float("-inf"))
                continue
            q, k = cache[at + "hook_q"], cache[at + "hook_k"]  # bidirectional: no mask at all
            by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
            assert _measure(f"{name} scores vs q k^T by hand", scores, by_hand) < 1e-5
    hm.unwrap()


def _roll(x: torch.Tensor) -> torch.Tensor:
    return x.roll(1, dims=-1)


def _add_to_head_0(x: torch.Tensor) -> torch.Tensor:
    return x + torch.nn.functional.pad(
        torch.linspace(-2, 2, x.shape[-1]).expand(1, 1, 1, -1), (0, 0, 0, 0, 0, x.shape[1] - 1)
    )


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("where", ["scores", "pattern"])
def test_an_edit_of_scores_or_pattern_is_the_edit_inside_a_hand_written_attention(name: str, where: str) -> None:
    model, n_image = vlm(name)
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    config = model.config.vision_config
    edit = _roll if where == "pattern" else _add_to_head_0
    point = "hook_pattern" if where == "pattern" else "hook_attn_scores"
    hm = HookedModel.wrap(model)
    for i in range(len(blocks)):
        function = written_out_attention(_attention(name, blocks[i]), {where: edit})
        reference = logits_under_attention(model, batch, f"lensadapters_test_{name}_{where}_{i}", function)
        hf = logits_with(model, batch)
        with torch.no_grad():
            got = logits_of(
                hm.run_with_hooks(**batch, fwd_hooks=[(f"vision.blocks.{i}.attn.{point}", lambda x, hook: edit(x))])
            )
        unused = name.startswith("llava") and i == 1  # LLaVA projects block 0's output: block 1 changes nothing
        assert torch.equal(got, hf) == unused
        scale = float(reference.abs().max())
        assert _measure(f"{name} {where} edit vs hand-written attention", got, reference) <= 1e-6 * scale
        assert config._attn_implementation == "eager"
    hm.unwrap()


@pytest.mark.parametrize("name", ["llava", "mistral3"])
def test_the_language_models_points_are_those_of_a_wrap_without_the_towers_attention(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The language model's points (names, order, values) are those of a wrap without the tower's attention points,
    also when every tower point is hooked in the same forward (Mistral 3: the tower's rotary and the language
    model's are apart)."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)

    def text_points() -> tuple[list[str], dict[str, torch.Tensor]]:
        hm = HookedModel.wrap(model)
        names = [p for p in hm.hook_dict if not p.startswith("vision.")]
        with torch.no_grad():
            _, cache = hm.run_with_cache(**batch)  # every point, the tower's too
        hm.unwrap()
        return names, {p: cache[p] for p in names if p in cache}

    names, cache = text_points()
    monkeypatch.setattr(vision_tower_module, "probe_attention", lambda *args: (None, None, []))
    names_before, cache_before = text_points()
    assert names == names_before and cache.keys() == cache_before.keys() and len(cache) > 10
    assert all(torch.equal(cache[p], cache_before[p]) for p in cache)


def _sdpa_by_another_name(*args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def test_the_towers_own_implementation_decides_whether_its_patterns_are_served() -> None:
    """The tower's patterns are refused by name under an implementation whose masks explicit attention does not read
    (the tower's, not the language model's), and served under eager while the language model runs another."""
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    AttentionInterface.register("lensadapters_test_other", _sdpa_by_another_name)
    hm = HookedModel.wrap(model)
    point = "vision.blocks.0.attn.hook_pattern"
    vision, text = model.config.vision_config, model.config.text_config
    vision._attn_implementation = "lensadapters_test_other"
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match=r"vision tower.*'lensadapters_test_other'"):
        hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: x)])
    assert vision._attn_implementation == "lensadapters_test_other"
    vision._attn_implementation, text._attn_implementation = "eager", "lensadapters_test_other"
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=[point])
        with pytest.raises(UnsupportedModelError, match=r"this model uses 'lensadapters_test_other'"):
            hm.run_with_cache(**batch, names_filter=["blocks.0.attn.hook_pattern"])
    assert cache[point].shape[-1] == cache[point].shape[-2] and (
        vision._attn_implementation,
        text._attn_implementation,
    ) == (
        "eager",
        "lensadapters_test_other",
    )
    hm.unwrap()


@pytest.mark.parametrize("name", [f for f in SERVED if f in ("idefics3", "smolvlm")])
def test_padding_patches_are_masked_keys_as_the_towers_own_mask_says(name: str) -> None:
    """Idefics3's tower masks the patches of an image's padding (``pixel_attention_mask``) as keys: their scores are
    ``-inf`` and their pattern 0 for every query (the padding patches' own queries included), as eager's weights."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    pixels = batch["pixel_values"]
    mask = torch.ones(*pixels.shape[:2], *pixels.shape[-2:], dtype=torch.bool)
    mask[0, 0, pixels.shape[-2] // 2 :] = False  # the first image's lower half is padding
    batch["pixel_attention_mask"] = mask
    eager = _eager_weights(model, name, batch)
    hm = HookedModel.wrap(model)
    points = [f"vision.blocks.{i}.attn.{p}" for i in range(len(eager)) for p in ("hook_attn_scores", "hook_pattern")]
    for implementation, cache in caches_under_each_implementation(model, hm, batch, points, checked=False):
        for i, weights in enumerate(eager):
            scores, pattern = (
                cache[f"vision.blocks.{i}.attn.hook_attn_scores"],
                cache[f"vision.blocks.{i}.attn.hook_pattern"],
            )
            padding = scores[0] == float("-inf")
            assert torch.equal(padding, padding[:1, :1].expand_as(padding))  # the same keys for every head and query
            assert padding.float().mean() == 0.5 and not bool((scores[1] == float("-inf")).any())
            assert torch.equal(pattern == 0, scores == float("-inf"))
            assert _measure(f"{name} padded pattern vs eager ({implementation})", pattern, weights) < 1e-6
    hm.unwrap()


def test_a_layer_explicit_attention_does_not_reproduce_has_no_patterns_and_the_warning_says_why() -> None:
    """Block 0's attention module says ``is_causal = True`` while eager attention, reading the mask only, attends both
    ways: explicit attention would mask the future, so that block's scores and patterns are refused by name; its
    ``hook_q/k/v/z`` and block 1's patterns are still served."""
    model, _ = vlm("llava")
    _attention("llava", tower_blocks_of(model)[0]).is_causal = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]
    assert len(messages) == 1 and "hook_attn_scores and hook_pattern are not served" in messages[0]
    assert "block 0: explicit attention does not give the attention's own output" in messages[0]
    assert "block 1" not in messages[0]
    served = {p for p in hm.hook_dict if p.startswith("vision.blocks.")}
    assert {"vision.blocks.0.attn.hook_q", "vision.blocks.0.attn.hook_z", "vision.blocks.1.attn.hook_pattern"} <= served
    assert not {"vision.blocks.0.attn.hook_attn_scores", "vision.blocks.0.attn.hook_pattern"} & served
    hm.unwrap()


@pytest.mark.parametrize("name", [f for f in SERVED if f in ROTARY])
def test_rotary_points_are_the_rotated_queries_and_keys_the_attention_function_gets(name: str) -> None:
    """Pixtral rotates its queries and keys (2-D RoPE) inside the attention module: ``hook_rot_q``/``hook_rot_k`` are
    what its attention function gets, and an edit there is that function getting the edited value (up to the
    rounding of rotating the edit back)."""
    model, n_image = vlm(name)
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    hm = HookedModel.wrap(model)
    hf = logits_with(model, batch)
    for i in range(len(blocks)):
        for x in "qk":
            seen: list = []
            for edit, key in ((lambda t: t, "read"), (scale_shift, "edit")):
                function = editing_inputs(_attention(name, blocks[i]), x, edit, seen)
                reference = logits_under_attention(model, batch, f"lensadapters_test_rot_{x}_{i}_{key}", function)
            point = f"vision.blocks.{i}.attn.hook_rot_{x}"
            with torch.no_grad():
                _, cache = hm.run_with_cache(**batch, names_filter=[point])
                got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda t, hook: scale_shift(t))]))
            assert torch.equal(cache[point], seen[0]), point
            assert not torch.equal(got, hf)
            scale = float(reference.abs().max())
            assert _measure(f"{name} rot_{x} edit vs the attention function given it", got, reference) <= 1e-5 * scale
    hm.unwrap()
