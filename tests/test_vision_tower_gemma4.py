"""Gemma 4's vision tower (transformers 5.x): its sandwich-normed blocks (a norm before and after the attention and
the MLP) get their sub-block points, ``hook_attn_out``/``hook_mlp_out`` after the post norms (what the block adds to
the residual, TransformerLens' Gemma 2 semantics), each read what a plain PyTorch hook on the Hugging Face module
reads (and, for the post norms, an RMSNorm written out here of what the attention and MLP gave), each edit changing
the logits exactly as the same edit by plain hooks does, and no hook giving HF's logits bitwise.

Its attention gets ``attn.hook_q/k/v`` (the projections' outputs), ``attn.q_norm/k_norm/v_norm.hook_scale`` and
``hook_normalized`` (the per-head norms after them: their scale and input over it, before the weight, as the language
models' ``q_norm``), ``attn.hook_rot_q/rot_k`` (the normed queries and keys after its 2-D rotary: what
the attention function gets), ``attn.hook_attn_scores``/``hook_pattern`` (HF's eager weights; edits as inside a
hand-written attention function) and ``attn.hook_z``, in the order they fire."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

from lensadapters import HookedModel, UnsupportedModelError
from lensadapters.testing.vlm import inputs, logits_of, logits_with, tower_block_points, tower_blocks_of, vlm
from lensadapters.wiring.core_sites import CoreSites
from lensadapters.wiring.vision_tower import VisionTowerWarning
from tests.test_vision_tower_attention import _add_to_head_0, _eager_weights, _measure, _roll
from tests.vision_tower_helpers import (
    GEMMA4_POST_NORMS,
    assert_reads_and_edits,
    block_references,
    caches_under_each_implementation,
    editing_inputs,
    logits_under_attention,
    norm_eps,
    per_block,
    plain_hook,
    plain_reads_and_edits,
    post_norm_hook,
    projection_hook,
    resid_mid_and_attn_out_edits,
    scale_shift,
    written_out_attention,
    z_hook,
)

pytestmark = pytest.mark.transformers5_only

#: the attention points of a Gemma 4 tower block (relative to ``vision.blocks.{i}.``), in the order they fire
ATTENTION = (
    "attn.hook_q",
    "attn.q_norm.hook_scale",
    "attn.q_norm.hook_normalized",
    "attn.hook_rot_q",
    "attn.hook_k",
    "attn.k_norm.hook_scale",
    "attn.k_norm.hook_normalized",
    "attn.hook_rot_k",
    "attn.hook_v",
    "attn.v_norm.hook_scale",
    "attn.v_norm.hook_normalized",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
)
#: every point of a sandwich-normed tower block (relative to ``vision.blocks.{i}.``), in the order they fire
SUB_BLOCK = tower_block_points(ATTENTION, post_norms=True)
#: the sandwich norms' points (relative to the block) and their HF modules
POST_NORMS = tuple(GEMMA4_POST_NORMS.items())


def _references(block: Any) -> dict[str, Callable[[list, Any], list]]:
    """For each sub-block point: the plain hooks on Gemma 4's block children reading it (and editing it by ``edit``):
    the other towers' references, with the norms after the attention and the MLP as the children whose outputs the
    block adds to its residual."""
    norms = ("post_attention_layernorm", "post_feedforward_layernorm", "input_layernorm", "pre_feedforward_layernorm")
    return block_references(block, norms)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm written out: ``x / sqrt(mean(x^2) + eps) * w``."""
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def test_sandwich_block_points_read_and_edit_as_plain_hooks_do() -> None:
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain = plain_reads_and_edits(model, batch, per_block(blocks, lambda i, block: _references(block)))
    raw: dict[str, list] = {}  # the attention's and MLP's own outputs, before the post norms
    handles = [
        plain_hook(getattr(block, child), "post", raw.setdefault(f"{i}.{child}", []))
        for i, block in enumerate(blocks)
        for child in ("self_attn", "mlp")
    ]
    hf = logits_with(model, batch, *handles)
    hm = HookedModel.wrap(model)
    names = [p for p in hm.hook_dict if p.startswith("vision.blocks.")]
    assert names == [f"vision.blocks.{i}.{s}" for i in range(len(blocks)) for s in SUB_BLOCK]
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: p.startswith("vision.blocks."))
        assert_reads_and_edits(hm, batch, plain, cache, once=True, changed_from=hf)
        for i, block in enumerate(blocks):
            at = f"vision.blocks.{i}."
            assert torch.equal(cache[at + "hook_resid_mid"], cache[at + "hook_resid_pre"] + cache[at + "hook_attn_out"])
            assert torch.equal(cache[at + "hook_resid_post"], cache[at + "hook_resid_mid"] + cache[at + "hook_mlp_out"])
            # hook_attn_out / hook_mlp_out are the post norms of the attention's / MLP's outputs, not those outputs
            for point, child, norm in (
                ("hook_attn_out", "self_attn", block.post_attention_layernorm),
                ("hook_mlp_out", "mlp", block.post_feedforward_layernorm),
            ):
                (inner,) = raw[f"{i}.{child}"]
                assert not torch.allclose(cache[at + point], inner, atol=1e-2)
                torch.testing.assert_close(cache[at + point], _rms(inner, norm.weight, norm.eps), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()
    assert torch.equal(logits_with(model, batch), hf)


def _post_norm_references(block: Any, recompute: bool = False) -> dict[str, Callable[[list, Any], list]]:
    """The plain hooks of :func:`~tests.vision_tower_helpers.post_norm_hook` for the block's ``ln1_post``/``ln2_post``
    points."""
    return {
        f"{point}.{which}": lambda seen, edit, norm=getattr(block, child), which=which: [
            post_norm_hook(norm, which, seen, edit, recompute)
        ]
        for point, child in POST_NORMS
        for which in ("hook_scale", "hook_normalized")
    }


def test_post_norm_scale_and_normalized_read_and_edit_as_plain_hooks_on_the_norms_do() -> None:
    """``ln1_post``/``ln2_post.hook_scale`` (``[batch, pos, 1]``) and ``hook_normalized`` are the scale and the
    normalized value of the norm's input, computed from the input a plain hook on the HF norm reads (not from the
    module's output); the norm's output (``hook_attn_out``/``hook_mlp_out``) is ``weight * hook_normalized``; an edit
    of either gives the logits a plain hook making it gives, bitwise, and those of the norm recomputed from the edited
    value, to rounding; no hook means HF's logits bitwise."""
    model, n_image = vlm("gemma4")
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    plain = plain_reads_and_edits(model, batch, per_block(blocks, lambda i, block: _post_norm_references(block)))
    recomputed = plain_reads_and_edits(
        model, batch, per_block(blocks, lambda i, block: _post_norm_references(block, recompute=True))
    )
    hf = logits_with(model, batch)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: p.startswith("vision.blocks."))
        assert_reads_and_edits(hm, batch, plain, cache, once=True, changed_from=hf)
        for point, (_, edited) in recomputed.items():
            got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: scale_shift(x))]))
            scale = float(edited.abs().max())
            assert _measure("gemma4 post-norm edit vs the norm recomputed", got, edited) <= 1e-5 * scale, point
    for i, block in enumerate(blocks):
        at = f"vision.blocks.{i}."
        for (point, child), out in zip(POST_NORMS, ("hook_attn_out", "hook_mlp_out")):
            scale, normalized = cache[f"{at}{point}.hook_scale"], cache[f"{at}{point}.hook_normalized"]
            assert scale.shape == (*normalized.shape[:-1], 1) and normalized.shape == cache[at + out].shape
            weight = getattr(block, child).weight
            assert not torch.allclose(cache[at + out], normalized, atol=1e-2)  # the weight is not 1
            torch.testing.assert_close(cache[at + out], normalized * weight, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits_with(model, batch), hf)
    hm.unwrap()
    assert torch.equal(logits_with(model, batch), hf)


def _wrapped_not_knowing(monkeypatch: pytest.MonkeyPatch, model: Any, norm: Any) -> tuple[HookedModel, list[str]]:
    """``model`` wrapped while the wiring's look-up of how ``norm`` normalizes (its ``NormSpec``) refuses it, for the
    test's reason; with the messages of the vision-tower warnings the wrap gave."""
    looked_up = CoreSites._norm_spec

    def refused() -> Any:
        raise UnsupportedModelError("no plugin knows how this norm normalizes (the test's)")

    def norm_spec(self: Any, module: Any) -> Any:
        return refused if module is norm else looked_up(self, module)

    monkeypatch.setattr(CoreSites, "_norm_spec", norm_spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    return hm, [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]


def test_a_post_norm_whose_normalization_is_unknown_gets_no_scale_points_and_the_warning_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where how block 1's post-MLP norm normalizes is not known (no ``NormSpec``: here the wiring's look-up refuses
    it), no block's ``ln1_post``/``ln2_post`` points are served and the warning names the block and why; the
    sub-block points (the norm's output ``hook_mlp_out``) still are."""
    model, _ = vlm("gemma4")
    hm, messages = _wrapped_not_knowing(monkeypatch, model, tower_blocks_of(model)[1].post_feedforward_layernorm)
    assert messages == [
        "the vision tower's ln1_post/ln2_post points are not served: block 1: no plugin knows how this norm "
        "normalizes (the test's)"
    ]
    served = [p for p in hm.hook_dict if p.startswith("vision.blocks.")]
    assert served == [f"vision.blocks.{i}.{p}" for i in range(2) for p in tower_block_points(ATTENTION)]
    hm.unwrap()


def test_an_edit_of_resid_mid_is_an_edit_of_attn_out_by_the_same_difference() -> None:
    """Adding ``d`` to ``hook_resid_mid`` or to ``hook_attn_out`` (after the post-attention norm) is the same edit of
    the residual stream, up to the rounding of the sum's order; adding it to the attention's own output is not (the
    post norm rescales it)."""
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    d = torch.linspace(-1, 1, 32)
    attn = tower_blocks_of(model)[0].self_attn
    inside = logits_with(model, batch, attn.register_forward_hook(lambda m, a, out: (out[0] + d, *out[1:])))
    hm = HookedModel.wrap(model)
    logits = resid_mid_and_attn_out_edits(hm, batch)
    assert not torch.allclose(inside, logits["hook_attn_out"], atol=1e-4)
    hm.unwrap()


def test_every_tower_point_fires_once_in_the_order_of_hook_dict() -> None:
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    hf = logits_with(model, batch)
    hm = HookedModel.wrap(model)
    names = [p for p in hm.hook_dict if p.startswith("vision.")]
    fired: list[str] = []
    with torch.no_grad():
        got = logits_of(
            hm.run_with_hooks(**batch, fwd_hooks=[(p, lambda x, hook: fired.append(hook.name)) for p in names])
        )
    assert fired == names
    torch.testing.assert_close(got, hf, atol=1e-5, rtol=1e-5)  # the patterns computed explicitly: to rounding
    hm.unwrap()


def _attention_references(block: Any, heads: int) -> dict[str, Callable[[list, Any], list]]:
    """The plain hooks reading and editing a block's ``attn.hook_q/k/v`` (the projections' outputs), the per-head
    norms' ``hook_normalized`` (their outputs) and ``attn.hook_z`` (the output projection's input)."""
    attn = block.self_attn
    hooks: dict[str, Callable[[list, Any], list]] = {
        "attn.hook_z": lambda seen, edit: [z_hook(attn.o_proj, heads, seen, edit)],
    }
    for x in "qkv":
        proj, norm = getattr(attn, f"{x}_proj"), getattr(attn, f"{x}_norm")
        hooks[f"attn.hook_{x}"] = lambda seen, edit, proj=proj: [projection_hook(proj, heads, seen, edit)]
        for which in ("hook_scale", "hook_normalized"):
            hooks[f"attn.{x}_norm.{which}"] = lambda seen, edit, norm=norm, which=which: [
                post_norm_hook(norm, which, seen, edit)
            ]
    return hooks


def test_attention_points_read_and_edit_as_plain_hooks_on_the_projections_and_norms_do() -> None:
    """``hook_q/k/v`` as a forward hook on ``q_proj``/``k_proj``/``v_proj`` (their outputs per head), the norms'
    ``hook_scale``/``hook_normalized`` as one on ``q_norm``/``k_norm``/``v_norm`` writing the norm out (x / scale,
    before the weight: :func:`~tests.vision_tower_helpers.post_norm_hook`), ``hook_z`` as a pre-hook on ``o_proj``;
    edits bitwise on the logits, and no hook HF's logits bitwise."""
    model, n_image = vlm("gemma4")
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    heads = int(model.config.vision_config.num_attention_heads)
    plain = plain_reads_and_edits(model, batch, per_block(blocks, lambda i, block: _attention_references(block, heads)))
    hf = logits_with(model, batch)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        assert torch.equal(logits_of(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=list(plain))
        for point in plain:  # [batch, pos, head, d_head]; a norm's scale [batch, pos, head, 1]
            assert cache[point].shape[-2:] == (heads, 1 if point.endswith("hook_scale") else 8), point
        assert_reads_and_edits(hm, batch, plain, cache, once=True, changed_from=hf)
    hm.unwrap()
    assert torch.equal(logits_with(model, batch), hf)


def test_projection_norm_points_are_the_input_over_its_scale_before_the_weight() -> None:
    """``attn.q_norm``/``k_norm``/``v_norm.hook_scale`` is ``sqrt(mean(x^2) + eps)`` of the norm's input ``x`` (per
    head) and ``hook_normalized`` ``x / scale`` (float64 references from the input a plain hook reads), before the
    weight, as the language models' ``q_norm`` (TransformerLens' RMSNorm): with ``q_norm``/``k_norm``'s weights not
    all ones it is not the norm's output (``weight * hook_normalized`` is); ``v_norm`` has no weight and outputs it."""
    model, n_image = vlm("gemma4")
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def reader(key: str) -> Callable[[Any, tuple, torch.Tensor], None]:
        def read(module: Any, args: tuple, out: torch.Tensor) -> None:
            seen[key] = (args[0].clone(), out.clone())

        return read

    handles = [
        getattr(block.self_attn, f"{x}_norm").register_forward_hook(reader(f"vision.blocks.{i}.attn.{x}_norm."))
        for i, block in enumerate(blocks)
        for x in "qkv"
    ]
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: "_norm.hook_" in p)
    for h in handles:
        h.remove()
    hm.unwrap()
    assert len(seen) == 3 * len(blocks)
    for at, (x, out) in seen.items():
        norm = blocks[int(at.split(".")[2])].self_attn.get_submodule(at.split(".")[-2])
        scale = (x.double().pow(2).mean(-1, keepdim=True) + norm_eps(norm)).sqrt()
        got_scale, normalized = cache[at + "hook_scale"], cache[at + "hook_normalized"]
        torch.testing.assert_close(got_scale.double(), scale, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(normalized.double(), x.double() / scale, atol=1e-6, rtol=1e-6)
        if norm.with_scale:
            assert not torch.all(norm.weight == 1), at  # a weight that tells x / scale from the output
            assert not torch.allclose(normalized, out, atol=1e-2), at
            torch.testing.assert_close(out, normalized * norm.weight, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(out, normalized, atol=1e-6, rtol=1e-6)


def test_a_projection_norm_whose_normalization_is_unknown_gets_no_points_and_the_warning_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where how block 1's ``k_norm`` normalizes is not known (the wiring's look-up refuses it), no block's per-head
    norm points are served, the warning names the block and the norm, and the other attention points still are."""
    model, n_image = vlm("gemma4")
    hm, messages = _wrapped_not_knowing(monkeypatch, model, tower_blocks_of(model)[1].self_attn.k_norm)
    assert len(messages) == 1 and "attn.q_norm/k_norm/v_norm" in messages[0], messages
    assert messages[0].endswith("block 1 k_norm: no plugin knows how this norm normalizes (the test's)")
    served = [p for p in hm.hook_dict if p.startswith("vision.blocks.") and ".attn." in p]
    no_norms = [p for p in ATTENTION if "_norm." not in p]
    assert served == [f"vision.blocks.{i}.{p}" for i in range(2) for p in no_norms]
    batch = inputs(model, n_image)
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=served)
    assert set(cache) == set(served)
    hm.unwrap()


def test_rotary_points_are_the_normed_rotated_queries_and_keys_the_attention_function_gets() -> None:
    """``hook_rot_q``/``hook_rot_k`` are what the attention function gets (bitwise), not the norm's output (the 2-D
    rotary turned them); an edit there is the function getting the edited value, to the rounding of rotating the
    edit back."""
    model, n_image = vlm("gemma4")
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    hm = HookedModel.wrap(model)
    hf = logits_with(model, batch)
    for i, block in enumerate(blocks):
        for x in "qk":
            seen: list = []
            references = [
                logits_under_attention(
                    model,
                    batch,
                    f"lensadapters_test_gemma4_rot_{x}_{i}_{key}",
                    editing_inputs(block.self_attn, x, edit, seen),
                )
                for edit, key in ((lambda t: t, "read"), (scale_shift, "edit"))
            ]
            at = f"vision.blocks.{i}.attn."
            point = f"{at}hook_rot_{x}"
            with torch.no_grad():
                _, cache = hm.run_with_cache(**batch, names_filter=[point, f"{at}{x}_norm.hook_normalized"])
                got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda t, hook: scale_shift(t))]))
            assert torch.equal(references[0], hf)
            assert torch.equal(cache[point], seen[0]), point
            assert not torch.allclose(cache[point], cache[f"{at}{x}_norm.hook_normalized"], atol=1e-2)
            assert not torch.equal(got, hf)
            scale = float(references[1].abs().max())
            assert (
                _measure(f"gemma4 rot_{x} edit vs the attention function given it", got, references[1]) <= 1e-5 * scale
            )
    hm.unwrap()


def test_patterns_are_the_eager_attention_weights_and_scores_the_rotated_queries_and_keys() -> None:
    """Under eager and sdpa: ``hook_pattern`` is HF's eager attention weights, ``softmax(hook_attn_scores)`` the
    pattern, and the scores ``rot_q rot_k^T`` by hand (Gemma 4's tower scales its scores by 1: its norms do it)."""
    model, n_image = vlm("gemma4")
    batch, n = inputs(model, n_image), len(tower_blocks_of(model))
    eager = _eager_weights(model, "gemma4", batch)
    hm = HookedModel.wrap(model)
    points = [f"vision.blocks.{i}.{p}" for i in range(n) for p in ATTENTION]
    for implementation, cache in caches_under_each_implementation(model, hm, batch, points):
        for i in range(n):
            at = f"vision.blocks.{i}.attn."
            pattern, scores = cache[at + "hook_pattern"], cache[at + "hook_attn_scores"]
            assert pattern.shape == eager[i].shape == scores.shape  # [batch, head, query, key]
            assert _measure(f"gemma4 pattern vs eager ({implementation})", pattern, eager[i]) < 1e-6
            assert _measure("gemma4 softmax(scores) vs pattern", torch.softmax(scores, -1), pattern) < 1e-6
            by_hand = torch.einsum("bqhd,bkhd->bhqk", cache[at + "hook_rot_q"], cache[at + "hook_rot_k"])
            assert _measure("gemma4 scores vs rot_q rot_k^T by hand", scores, by_hand) < 1e-5
            z = torch.einsum("bhqk,bkhd->bqhd", pattern, cache[at + "v_norm.hook_normalized"])
            assert _measure("gemma4 z vs pattern @ v_norm by hand", cache[at + "hook_z"], z) < 1e-5
    model.set_attn_implementation("eager")
    hm.unwrap()


@pytest.mark.parametrize("where", ["scores", "pattern"])
def test_an_edit_of_scores_or_pattern_is_the_edit_inside_a_hand_written_attention(where: str) -> None:
    model, n_image = vlm("gemma4")
    batch, blocks = inputs(model, n_image), tower_blocks_of(model)
    edit = _roll if where == "pattern" else _add_to_head_0
    point = "hook_pattern" if where == "pattern" else "hook_attn_scores"
    hm = HookedModel.wrap(model)
    hf = logits_with(model, batch)
    for i, block in enumerate(blocks):
        function = written_out_attention(block.self_attn, {where: edit})
        reference = logits_under_attention(model, batch, f"lensadapters_test_gemma4_{where}_{i}", function)
        with torch.no_grad():
            got = logits_of(
                hm.run_with_hooks(**batch, fwd_hooks=[(f"vision.blocks.{i}.attn.{point}", lambda x, hook: edit(x))])
            )
        assert not torch.equal(got, hf)
        scale = float(reference.abs().max())
        assert _measure(f"gemma4 {where} edit vs hand-written attention", got, reference) <= 1e-6 * scale
    hm.unwrap()


def test_padding_patches_are_masked_keys_as_the_towers_own_mask_says() -> None:
    """Four padding patches (positions ``(-1, -1)``) after each image's 16: the tower masks them as keys, so their
    scores are ``-inf`` and their pattern 0 for every query, as HF's eager weights (under eager and sdpa)."""
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    pixels, positions = batch["pixel_values"], batch["image_position_ids"]
    batch["pixel_values"] = torch.cat([pixels, torch.zeros(2, 4, pixels.shape[-1])], 1)
    batch["image_position_ids"] = torch.cat([positions, torch.full((2, 4, 2), -1)], 1)
    eager = _eager_weights(model, "gemma4", batch)
    hm = HookedModel.wrap(model)
    points = [f"vision.blocks.{i}.attn.{p}" for i in range(len(eager)) for p in ("hook_attn_scores", "hook_pattern")]
    for implementation, cache in caches_under_each_implementation(model, hm, batch, points, checked=False):
        for i, weights in enumerate(eager):
            at = f"vision.blocks.{i}.attn."
            scores, pattern = cache[at + "hook_attn_scores"], cache[at + "hook_pattern"]
            masked = scores == float("-inf")
            assert masked.shape[-1] == 20 and bool(masked[..., 16:].all()) and not bool(masked[..., :16].any())
            assert torch.equal(pattern == 0, masked)
            assert _measure(f"gemma4 padded pattern vs eager ({implementation})", pattern, weights) < 1e-6
    model.set_attn_implementation("eager")
    hm.unwrap()
