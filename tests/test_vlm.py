"""Vision-language models (``*ForConditionalGeneration``): the language model's points under their usual names,
the projector's output (``vision_projector.hook_out``), processor inputs passed through, generation with hooks.

Tiny random LLaVA and LLaVA-NeXT (Llama language model, CLIP vision tower), Mistral 3 (Pixtral vision tower),
multimodal Gemma 3 (SigLIP vision tower), multimodal Gemma 4 (its own vision tower, projector ``embed_vision``; no
audio tower), Idefics3 and SmolVLM (Llama language model, projector ``connector``), built from their configs: 16x16
images in 4x4 patches, the image tokens' count the model's own (16 for LLaVA, 36 for LLaVA-NeXT, 4 for the others).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lensadapters import HookedModel, UnfiredHookWarning, hf
from lensadapters.testing.vlm import (
    BUILDERS,
    FEATURES_POINT,
    HYBRID,
    IMAGE_TOKEN,
    PROJECTOR_POINT,
    SCATTERED_AS_PROJECTED,
    decoder_of,
    embeddings_of,
    hm_projector_path,
    inputs,
    logits_of,
    logits_with,
    module_hooks,
    plain_reference,
    text_model_of,
    vlm,
)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_language_points_equal_the_text_models(name: str) -> None:
    """Without an image, every point of the wrapped vision-language model reads what wrapping a text-only model with
    the same weights reads, under the same names (plus the projector's point); the description is the language
    model's plugin's."""
    model, n_image = vlm(name)
    text = text_model_of(model)
    hm, hm_text = HookedModel.wrap(model), HookedModel.wrap(text)
    assert hm.plugin.name == hm_text.plugin.name and hm.cfg.n_layers == hm_text.cfg.n_layers
    image_points = [
        n for n in hm.hook_names if n.startswith(("vision.", "vision_projector."))
    ]  # the tower; Qwen3-VL: deepstack
    assert [n for n in hm.hook_names if n not in image_points] == hm_text.hook_names
    # after hook_embed: the image features replace embeddings
    assert hm.hook_names[1 : 1 + len(image_points)] == image_points and image_points[-2:] == [
        FEATURES_POINT,
        PROJECTOR_POINT,
    ]
    batch = inputs(model, n_image, image=False)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch)
        logits_text, cache_text = hm_text.run_with_cache(**batch)
    torch.testing.assert_close(logits_of(logits), logits_of(logits_text), rtol=1e-5, atol=1e-5)
    assert set(cache.keys()) == set(cache_text.keys())  # the projector did not run: no image
    for key in cache_text.keys():
        torch.testing.assert_close(cache[key], cache_text[key], rtol=1e-5, atol=1e-5, msg=key)
    assert torch.equal(hm.W_U, hm_text.W_U) and torch.equal(hm.W_E, hm_text.W_E)
    if name in HYBRID:  # a hybrid's stacked W_Q is refused (its linear-attention layers have none): by both alike
        refusals = []
        for wrapped in (hm, hm_text):
            with pytest.raises(Exception) as refusal:
                _ = wrapped.W_Q
            refusals.append((type(refusal.value), str(refusal.value)))
        assert refusals[0] == refusals[1]
    else:
        assert torch.equal(hm.W_Q, hm_text.W_Q)
    hm.unwrap(), hm_text.unwrap()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_with_an_image_points_are_what_the_model_computes(name: str) -> None:
    """``run_with_cache`` takes the processor's inputs (pixel values, token types) and passes them on: the
    projector's output, the residual stream around each layer and the attention patterns (image tokens' masks
    included) equal what plain PyTorch hooks read; the image features are what the first layer reads at the image
    tokens' positions."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    out, seen = plain_reference(model, batch)
    own_hooks = module_hooks(model)  # transformers' own (5.x captures the vision tower's outputs with hooks)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(logits), out.logits)
    for key, value in seen.items():
        assert torch.equal(cache[key], value), key
    if name in SCATTERED_AS_PROJECTED:
        at_images = batch["input_ids"] == IMAGE_TOKEN
        features = cache[PROJECTOR_POINT].reshape(-1, hm.cfg.d_model)
        assert features.shape[0] == at_images.sum()
        assert torch.equal(cache["blocks.0.hook_resid_pre"][at_images], features)
    if name in ("gemma4", "gemma4_unified"):  # sliding layers: image tokens attend to later ones (the model's mask)
        assert bool((cache["blocks.0.attn.hook_pattern"][:, :, 2, 3] > 0).all())
    assert hm.unwrap() is model
    assert module_hooks(model) == own_hooks  # nothing left behind
    assert model.config.get_text_config()._attn_implementation == "eager"  # the pattern points' routing undone
    assert model.config.vision_config._attn_implementation == "eager"


@pytest.mark.parametrize("name", list(BUILDERS))
def test_projector_edit_changes_the_logits_as_a_plain_hook_does(name: str) -> None:
    """An edit of ``vision_projector.hook_out`` (the image features at the image tokens' positions) changes what the
    language model reads exactly as the same edit made by a plain PyTorch hook on the projector; the text
    positions' embeddings are untouched."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)

    def edit(x: torch.Tensor) -> torch.Tensor:
        return x * -2.0 + 0.5

    expected, _ = plain_reference(model, batch, edit)
    clean, _ = plain_reference(model, batch)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        got = hm.run_with_hooks(**batch, fwd_hooks=[(PROJECTOR_POINT, lambda x, hook: edit(x))])
        _, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(got), expected.logits)
    assert not torch.allclose(logits_of(got), clean.logits)
    at_text = batch["input_ids"] != IMAGE_TOKEN  # (Gemma 4 embeds the padding token at the image tokens)
    assert torch.equal(cache["hook_embed"][at_text], embeddings_of(model, batch["input_ids"])[at_text])
    hm.unwrap()


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_rotary_points_are_the_models_multimodal_rotation(name: str) -> None:
    """With an image (3-D positions from the grid), ``hook_rot_q``/``hook_rot_k`` are what transformers' own
    rotation function of the attention's module computes (``apply_multimodal_rotary_pos_emb`` with the sections
    where the rotary module returns one table per axis, transformers 4.x's Qwen2(.5)-VL; ``apply_rotary_pos_emb``
    of the merged tables otherwise) from the (cos, sin) the rotary module returned, bit for bit; an edit of
    ``hook_rot_k`` reaches the attention scores."""
    import sys

    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    decoder = decoder_of(model)
    attention = decoder.layers[1].self_attn
    seen: dict[str, Any] = {}  # the rotary tables, and the normed queries and keys (Qwen3-VL) as the model has them
    handles = [decoder.rotary_emb.register_forward_hook(lambda m, a, out: seen.setdefault("rotary", out))]
    for p in "qk":
        if hasattr(attention, f"{p}_norm"):
            norm = getattr(attention, f"{p}_norm")
            handles.append(norm.register_forward_hook(lambda m, a, out, p=p: seen.setdefault(p, out)))
    hm = HookedModel.wrap(model)
    names = [f"blocks.1.attn.{p}" for p in ("hook_q", "hook_k", "hook_rot_q", "hook_rot_k")]
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=names)
    for handle in handles:
        handle.remove()
    cos, sin = seen["rotary"]
    module = sys.modules[type(attention).__module__]
    q, k = (seen.get(p, cache[f"blocks.1.attn.hook_{p}"]).transpose(1, 2) for p in "qk")
    sections = hf.rope_parameters(model.config.get_text_config())["mrope_section"]
    if cos.dim() == 4:  # one table per position axis (time, height, width): the attention merges them
        assert hasattr(module, "apply_multimodal_rotary_pos_emb")
        rot_q, rot_k = module.apply_multimodal_rotary_pos_emb(q, k, cos, sin, sections)
    else:
        rot_q, rot_k = module.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(cache["blocks.1.attn.hook_rot_q"], rot_q.transpose(1, 2))
    assert torch.equal(cache["blocks.1.attn.hook_rot_k"], rot_k.transpose(1, 2))

    with torch.no_grad():  # an edit of the rotated keys is what attention uses
        edited = {}
        hm.run_with_hooks(
            **batch,
            fwd_hooks=[
                ("blocks.1.attn.hook_rot_k", lambda x, hook: x * 2.0),
                ("blocks.1.attn.hook_attn_scores", lambda x, hook: edited.setdefault("s", x.clone())),
            ],
        )
    keys = 2.0 * cache["blocks.1.attn.hook_rot_k"].repeat_interleave(2, dim=2)  # 4 query heads, 2 kv heads
    expected = torch.einsum("bqhd,bkhd->bhqk", cache["blocks.1.attn.hook_rot_q"], keys)
    causal = torch.ones(expected.shape[-2:], dtype=torch.bool).tril()
    torch.testing.assert_close(edited["s"][..., causal], (expected * attention.scaling)[..., causal])
    hm.unwrap()


def test_deepstack_features_are_added_between_a_layers_output_and_the_next_layers_input() -> None:
    """Qwen3-VL adds the vision tower's deepstack features (``vision_projector.deepstack.0.hook_out``) to the image
    tokens' hidden states after layer 0: ``blocks.0.hook_resid_post`` is the layer's output (transformers 4.x adds
    them into that tensor in place: the point keeps the layer's output), ``blocks.1.hook_resid_pre`` what layer 1
    reads, the sum at the image tokens only. An edit of the features changes the logits as the same edit made by a
    plain PyTorch hook on the deepstack merger."""
    model, n_image = vlm("qwen3_vl")
    batch = inputs(model, n_image)
    hm = HookedModel.wrap(model)
    deepstack = "vision_projector.deepstack.0.hook_out"
    language = [n for n in hm.hook_names if not n.startswith("vision.")]  # (the tower's points come first)
    assert language[1:4] == [deepstack, FEATURES_POINT, PROJECTOR_POINT]
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch)
    post, pre = cache["blocks.0.hook_resid_post"], cache["blocks.1.hook_resid_pre"]
    at_images = batch["input_ids"] == IMAGE_TOKEN
    features = cache[deepstack]
    assert features.shape == (int(at_images.sum()), hm.cfg.d_model)
    assert torch.equal(pre[at_images], post[at_images] + features)
    assert torch.equal(pre[~at_images], post[~at_images]) and not torch.equal(pre, post)

    def edit(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0 - 1.0

    merger = next(m for m in model.modules() if hasattr(m, "deepstack_merger_list")).deepstack_merger_list[0]
    with torch.no_grad():
        got = logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(deepstack, lambda x, hook: edit(x))]))
        clean = logits_of(hm(**batch))
    hm.unwrap()
    expected = logits_with(model, batch, merger.register_forward_hook(lambda m, a, out: edit(out)))
    assert torch.equal(got, expected) and not torch.allclose(got, clean)


def test_a_projector_hook_that_cannot_fire_without_an_image_warns_by_name() -> None:
    """A hook on a projector point in a forward without an image never runs (there are no image features): the
    call warns, naming the point and what it needs, instead of leaving the user with an edit silently not made.
    The default ``run_with_cache`` (no names asked for) and a forward with an image do not warn."""
    model, n_image = vlm("llava")
    text_only, with_image = inputs(model, n_image, image=False), inputs(model, n_image)
    hm = HookedModel.wrap(model)
    edit = [(PROJECTOR_POINT, lambda x, hook: x * 0.0)]
    with torch.no_grad():
        with pytest.warns(UnfiredHookWarning, match=r"vision_projector\.hook_out .*images \(pixel_values\)"):
            hm.run_with_hooks(**text_only, fwd_hooks=edit)
        with pytest.warns(UnfiredHookWarning, match=r"vision_projector\.hook_in"):
            _, cache = hm.run_with_cache(**text_only, names_filter=[FEATURES_POINT])
        assert FEATURES_POINT not in cache
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnfiredHookWarning)
            hm.run_with_cache(**text_only)
            hm.run_with_hooks(**with_image, fwd_hooks=edit)
            with hm.hooks(edit):  # a block warns only if none of its forwards reached the point
                hm(**text_only)
                hm(**with_image)
    assert not any(p.fwd_hooks for p in hm.wiring.hook_dict.values())  # the watchers went with the hooks
    hm.unwrap()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_projector_input_reads_and_edits_the_vision_features_as_a_plain_hook_does(name: str) -> None:
    """``vision_projector.hook_in`` is the vision tower's output as the projector reads it; an edit there changes
    the logits exactly as the same edit made by a plain PyTorch pre-hook on the projector."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    projector = model.get_submodule(hm_projector_path(model))
    seen: list[torch.Tensor] = []

    def edit(x: torch.Tensor) -> torch.Tensor:
        return x * -2.0 + 0.5

    def plain(module: Any, args: tuple, kwargs: dict) -> Any:  # the first input, positional or by keyword
        if args:
            seen.append(args[0].clone())
            return (edit(args[0]), *args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        seen.append(kwargs[key].clone())
        return args, {**kwargs, key: edit(kwargs[key])}

    expected = logits_with(model, batch, projector.register_forward_pre_hook(plain, with_kwargs=True))
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=[FEATURES_POINT])
        got = hm.run_with_hooks(**batch, fwd_hooks=[(FEATURES_POINT, lambda x, hook: edit(x))])
    assert torch.equal(cache[FEATURES_POINT], seen[0])
    assert torch.equal(logits_of(got), expected)
    hm.unwrap()
