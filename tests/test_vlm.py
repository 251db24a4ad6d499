"""Vision-language models (``*ForConditionalGeneration``): the language model's points under their usual names,
the projector's output (``vision_projector.hook_out``), processor inputs passed through, generation with hooks.

Tiny random LLaVA and LLaVA-NeXT (Llama language model, CLIP vision tower), Mistral 3 (Pixtral vision tower),
multimodal Gemma 3 (SigLIP vision tower), multimodal Gemma 4 (its own vision tower, projector ``embed_vision``; no
audio tower), Idefics3 and SmolVLM (Llama language model, projector ``connector``), built from their configs: 16x16
images in 4x4 patches, the image tokens' count the model's own (16 for LLaVA, 36 for LLaVA-NeXT, 4 for the others).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from lensadapters import HookedModel, UnfiredHookWarning, hf
from lensadapters.testing.models import int8_copy
from lensadapters.testing.tiny_models import needs

IMAGE_TOKEN = 100
PROJECTOR_POINT = "vision_projector.hook_out"
FEATURES_POINT = "vision_projector.hook_in"
TOWER = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _llava(text: str = "LlamaConfig") -> tuple[Any, int]:
    """LLaVA around a Llama language model (or the one of the config class ``text``: Qwen2, as LLaVA-OneVision)."""
    import transformers
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config=getattr(transformers, text)(**TEXT, tie_word_embeddings=False),
        vision_config=CLIPVisionConfig(**TOWER, num_attention_heads=4, projection_dim=32),
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration._from_config(config, attn_implementation="eager"), 16


def _gemma3() -> tuple[Any, int]:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    config = Gemma3Config(
        text_config=Gemma3TextConfig(**TEXT, head_dim=8, sliding_window=4, query_pre_attn_scalar=8),
        vision_config=SiglipVisionConfig(**TOWER, num_attention_heads=4),
        mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=101,
        eoi_token_index=102,
    )
    return Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager"), 4


def _llava_next() -> tuple[Any, int]:
    """LLaVA-NeXT: a base image and one 16x16 crop (``image_grid_pinpoints``), each 16 patch features, plus one
    newline feature per row of the crop: 36 image tokens, not the projector's output one to one."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(
        text_config=LlamaConfig(**TEXT),
        vision_config=CLIPVisionConfig(**TOWER, num_attention_heads=4, projection_dim=32),
        image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=[[16, 16], [16, 32]],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return LlavaNextForConditionalGeneration._from_config(config, attn_implementation="eager"), 36


def _mistral3() -> tuple[Any, int]:
    """Mistral 3: a Pixtral vision tower (2-D RoPE over the patches), patches merged 2x2 by the projector: 4 image
    tokens per 16x16 image; a language model with a 4-token sliding window."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    config = Mistral3Config(
        text_config=MistralConfig(**TEXT, sliding_window=4),
        vision_config=PixtralVisionConfig(**TOWER, num_attention_heads=4, head_dim=8),
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration._from_config(config, attn_implementation="eager"), 4


def _gemma4() -> tuple[Any, int]:
    """Multimodal Gemma 4 (transformers 5.x): the image as 16 patches of 4x4 pixels with their (x, y) positions,
    pooled 2x2 into 4 image tokens; per-layer inputs; bidirectional attention over each image's tokens
    (``use_bidirectional_attention="vision"``); no audio tower (no ``audio_config``)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip("Gemma 4 needs transformers 5.x")
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(
        **TEXT,
        head_dim=8,
        global_head_dim=8,  # one head size: the stacked weights are compared
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=TEXT["vocab_size"],
        use_bidirectional_attention="vision",
        pad_token_id=0,
    )
    tower = dict(TOWER, num_attention_heads=4, num_key_value_heads=4, head_dim=8, pooling_kernel_size=2)
    del tower["image_size"]
    config = Gemma4Config(
        text_config=text,
        vision_config=Gemma4VisionConfig(**tower, position_embedding_size=16),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=101,
        eoi_token_id=102,
    )
    return Gemma4ForConditionalGeneration._from_config(config, attn_implementation="eager"), 4


def _gemma4_unified() -> tuple[Any, int]:
    """Multimodal unified Gemma 4 (transformers 5.x): no vision tower, a vision embedder (``embed_vision``: layer
    norms, a dense layer, 2-D position embeddings) ending with its projection to the language model's width
    (``multimodal_embedder``); 16 merged patches of 4x4 pixels, one image token each; no per-layer inputs."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4UnifiedForConditionalGeneration"):
        pytest.skip("unified Gemma 4 needs transformers 5.x")
    from transformers import (
        Gemma4UnifiedConfig,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    text = Gemma4UnifiedTextConfig(
        **TEXT,
        head_dim=8,
        global_head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention="vision",
        pad_token_id=0,
    )
    vision = Gemma4UnifiedVisionConfig(
        patch_size=2, pooling_kernel_size=2, mm_embed_dim=24, mm_posemb_size=16, output_proj_dims=24
    )
    config = Gemma4UnifiedConfig(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=101,
        eoi_token_id=102,
    )
    return Gemma4UnifiedForConditionalGeneration._from_config(config, attn_implementation="eager"), 16


def _qwen3_5(moe: bool = False) -> tuple[Any, int]:
    """Multimodal Qwen 3.5, dense or MoE (transformers 5.x): a gated DeltaNet layer then a full-attention one whose
    partial rotary is multimodal RoPE (``mrope_section``: time, height, width frequencies from 3-D positions the
    model computes from the image grid); the image as 16 flattened 4x4 patches (two frames each) with its grid
    ``image_grid_thw``, merged 2x2 by the vision tower's ``merger`` into 4 image tokens."""
    transformers = pytest.importorskip("transformers")
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    if not hasattr(transformers, f"{prefix}ForConditionalGeneration"):
        pytest.skip("Qwen 3.5 needs transformers 5.x")
    kinds = ["linear_attention", "full_attention"]
    moe_fields = (
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
        if moe
        else {}
    )
    text = hf.decoder_config(  # a DeltaNet layer with (2, 4) key/value heads of sizes (8, 6), then a full one
        getattr(transformers, f"{prefix}TextConfig"),
        layers=2,
        layer_types=kinds,
        head_dim=16,
        vocab=TEXT["vocab_size"],
        max_pos=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        output_router_logits=False,
        **moe_fields,
    )
    text.rope_parameters["mrope_section"] = [2, 1, 1]
    vision = getattr(transformers, f"{prefix}VisionConfig")(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=16,
    )
    return _qwen_multimodal(prefix, text, vision.to_dict())


def _qwen_vl(prefix: str) -> tuple[Any, int]:
    """Qwen2-VL, Qwen2.5-VL (a Qwen2 language model) and Qwen3-VL (a Qwen3 one): multimodal RoPE on every layer
    (``mrope_section`` [2, 1, 1] of a head's 4 frequencies: chunked by axis in Qwen2(.5)-VL, interleaved in
    Qwen3-VL), the image as 16 flattened 4x4 patches (two frames each) with its grid ``image_grid_thw``, merged 2x2
    by the vision tower's ``merger`` into 4 image tokens. Qwen3-VL's vision tower also gives a deepstack feature
    (from its first block) that the language model adds to the image tokens' hidden states after its first
    layer."""
    import transformers

    if not hasattr(transformers, f"{prefix}ForConditionalGeneration"):
        pytest.skip(f"{prefix} is not in this transformers")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    fields: dict[str, Any] = {"head_dim": 8} if prefix == "Qwen3VL" else {}
    if transformers.__version__.startswith("4."):
        fields.update(rope_theta=10000.0, rope_scaling={**rope, "type": "default"})
    else:
        fields.update(rope_parameters=rope)
    text = getattr(transformers, f"{prefix}TextConfig")(**TEXT, **fields)
    vision: dict[str, Any] = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if prefix == "Qwen2VL":  # embed_dim the tower's width, hidden_size the language model's
        vision.update(embed_dim=32, hidden_size=TEXT["hidden_size"], mlp_ratio=2)
    else:
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=TEXT["hidden_size"])
    if prefix == "Qwen3VL":
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    return _qwen_multimodal(prefix, text, vision)


def _qwen_multimodal(prefix: str, text: Any, vision: dict[str, Any]) -> tuple[Any, int]:
    """The ``<prefix>ForConditionalGeneration`` of a text and a vision config (Qwen's image, vision-start/end and
    video tokens); 4 image tokens per image."""
    import transformers

    config = getattr(transformers, f"{prefix}Config")(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=101,
        vision_end_token_id=102,
        video_token_id=103,
    )
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")._from_config(config, attn_implementation="eager")
    return model, 4


def _idefics3(name: str = "Idefics3") -> tuple[Any, int]:
    """Idefics3 (and SmolVLM, the same structure): one 16x16 image, its 16 patches shuffled 2x2 (``scale_factor``)
    into 4 image tokens by the projector (``connector``)."""
    import transformers

    config = getattr(transformers, f"{name}Config")(
        text_config=transformers.LlamaConfig(**TEXT).to_dict(),
        vision_config=getattr(transformers, f"{name}VisionConfig")(**TOWER, num_attention_heads=4).to_dict(),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    model = getattr(transformers, f"{name}ForConditionalGeneration")._from_config(config, attn_implementation="eager")
    return model, 4


BUILDERS: dict[str, tuple[str, Callable[[], tuple[Any, int]]]] = {
    "llava": ("llama", _llava),
    "gemma3": ("gemma3_text", _gemma3),
    "llava_next": ("llama", _llava_next),
    "mistral3": ("mistral", _mistral3),
    "gemma4": ("gemma4_text", _gemma4),
    "gemma4_unified": ("gemma4_unified_text", _gemma4_unified),
    "idefics3": ("llama", _idefics3),
    "smolvlm": ("llama", lambda: _idefics3("SmolVLM")),
    "qwen3_5": ("qwen3_5_text", _qwen3_5),
    "qwen3_5_moe": ("qwen3_5_moe_text", lambda: _qwen3_5(moe=True)),
    "llava_qwen2": ("qwen2", lambda: _llava("Qwen2Config")),
    "qwen2_vl": ("qwen2", lambda: _qwen_vl("Qwen2VL")),
    "qwen2_5_vl": ("qwen2", lambda: _qwen_vl("Qwen2_5_VL")),
    "qwen3_vl": ("qwen3", lambda: _qwen_vl("Qwen3VL")),
}
#: the models whose projector's output is the image tokens' embeddings one to one
SCATTERED_AS_PROJECTED = (
    *("llava", "gemma3", "mistral3", "gemma4", "gemma4_unified", "idefics3", "smolvlm", "qwen3_5", "qwen3_5_moe"),
    *("llava_qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
)
#: each model's projector (transformers' attribute name), where it is not ``multi_modal_projector``
PROJECTORS = {
    "gemma4": "embed_vision",
    "gemma4_unified": "embed_vision.multimodal_embedder",
    "idefics3": "connector",
    "smolvlm": "connector",
    "qwen3_5": "merger",
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), "visual.merger"),
}
#: the text-only config of language models that have no causal LM of their own (without an image, multimodal RoPE's
#: three position axes are the tokens' indices: the text-only model's rotary)
TEXT_ONLY = {"qwen2_vl_text": "Qwen2Config", "qwen2_5_vl_text": "Qwen2Config", "qwen3_vl_text": "Qwen3Config"}
#: the models with linear-attention layers (no ``W_Q`` of the whole model: a full-attention layer's is compared)
HYBRID = ("qwen3_5", "qwen3_5_moe")


def vlm(name: str) -> tuple[Any, int]:
    """The model (eval mode, seeded weights) and its number of image tokens per image."""
    language, build = BUILDERS[name]
    needs(language)
    torch.manual_seed(0)
    model, n_image = build()
    with torch.no_grad():  # weights of unit scale, so every point's value is far from rounding noise
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval(), n_image


def inputs(model: Any, n_image: int, image: bool = True) -> dict[str, Any]:
    """Two sequences: text, the image's tokens (when ``image``), text; with pixel values for one image each."""
    g = torch.Generator().manual_seed(1)
    text = torch.randint(3, 90, (2, 5), generator=g)
    middle = torch.full((2, n_image), IMAGE_TOKEN) if image else torch.randint(3, 90, (2, n_image), generator=g)
    ids = torch.cat([text[:, :2], middle, text[:, 2:]], dim=1)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if image:
        size = getattr(model.config.vision_config, "image_size", 16)
        if getattr(model.config.vision_config, "pooling_kernel_size", None):  # Gemma 4: patches and their positions
            kwargs["pixel_values"] = torch.rand(2, 16, 3 * 4 * 4, generator=g)
            xy = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1)
            kwargs["image_position_ids"] = xy.reshape(1, 16, 2).expand(2, 16, 2)
        elif getattr(model.config.vision_config, "temporal_patch_size", None):  # Qwen 3.5: patches and the grid
            kwargs["pixel_values"] = torch.rand(2 * 16, 3 * 2 * 4 * 4, generator=g)
            kwargs["image_grid_thw"] = torch.tensor([[1, 4, 4]] * 2)
        elif getattr(model.config, "scale_factor", None):  # Idefics3: images per sequence
            kwargs["pixel_values"] = torch.randn(2, 1, 3, size, size, generator=g)
        elif getattr(model.config, "image_grid_pinpoints", None):  # LLaVA-NeXT: the base image and one crop
            kwargs["pixel_values"] = torch.randn(2, 2, 3, size, size, generator=g)
        else:
            kwargs["pixel_values"] = torch.randn(2, 3, size, size, generator=g)
        if any(getattr(model.config, k, None) for k in ("image_grid_pinpoints", "spatial_merge_size")):
            kwargs["image_sizes"] = torch.tensor([[size, size]] * 2)
        for key in ("token_type_ids", "mm_token_type_ids"):  # Gemma 3 and 4, Qwen 3.5: the image tokens' types
            if key in inspect.signature(model.forward).parameters:
                kwargs[key] = (ids == IMAGE_TOKEN).long()
    return kwargs


def logits_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def decoder_of(model: Any) -> Any:
    """The language model's decoder (transformers 4.x's Idefics3 and SmolVLM give their multimodal base model as
    ``get_decoder()``; its ``text_model`` is the decoder)."""
    decoder = model.get_decoder()
    return getattr(decoder, "text_model", decoder)


def text_model_of(model: Any) -> Any:
    """A text-only causal LM carrying the vision-language model's language weights."""
    config = model.config.get_text_config()
    if config.model_type in TEXT_ONLY:  # no causal LM of transformers' own: the text-only family's, same sizes
        import transformers

        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = getattr(transformers, TEXT_ONLY[config.model_type])(**fields)
    text = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    text.get_decoder().load_state_dict(decoder_of(model).state_dict())
    text.get_output_embeddings().load_state_dict(model.get_output_embeddings().state_dict())
    return text


@pytest.mark.parametrize("name", list(BUILDERS))
def test_language_points_equal_the_text_models(name: str) -> None:
    """Without an image, every point of the wrapped vision-language model reads what wrapping a text-only model with
    the same weights reads, under the same names (plus the projector's point); the description is the language
    model's plugin's."""
    model, n_image = vlm(name)
    text = text_model_of(model)
    hm, hm_text = HookedModel.wrap(model), HookedModel.wrap(text)
    assert hm.plugin.name == hm_text.plugin.name and hm.cfg.n_layers == hm_text.cfg.n_layers
    image_points = [n for n in hm.hook_names if n.startswith("vision_projector.")]  # (Qwen3-VL's deepstack too)
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


def _reference(model: Any, batch: dict[str, Any], edit: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """The model's output and values read with plain PyTorch hooks: the projector's output (changed by ``edit``),
    each decoder layer's input and output (and its per-layer input, Gemma 4), each attention module's weights
    (eager attention)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []

    def projector(module: Any, args: Any, output: torch.Tensor) -> Any:
        seen[PROJECTOR_POINT] = output.detach().clone()
        return None if edit is None else edit(output)

    projector_module = model.get_submodule(hm_projector_path(model))
    handles.append(projector_module.register_forward_hook(projector))
    for i, layer in enumerate(decoder_of(model).layers):

        def pre(module: Any, args: Any, kwargs: Any, i: int = i) -> None:
            seen[f"blocks.{i}.hook_resid_pre"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
            if "per_layer_input" in inspect.signature(module.forward).parameters:
                given = args[1] if len(args) > 1 else kwargs["per_layer_input"]
                seen[f"blocks.{i}.hook_per_layer_input"] = given.detach().clone()

        def post(module: Any, args: Any, output: Any, i: int = i) -> None:
            out = output[0] if isinstance(output, tuple) else output
            seen[f"blocks.{i}.hook_resid_post"] = out.detach().clone()

        def pattern(module: Any, args: Any, output: Any, i: int = i) -> None:
            seen[f"blocks.{i}.attn.hook_pattern"] = output[1].detach().clone()

        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
        if hasattr(layer, "self_attn"):  # (Qwen 3.5's linear-attention layers have none)
            handles.append(layer.self_attn.register_forward_hook(pattern))
    try:
        with torch.no_grad():
            out = model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return out, seen


def _module_hooks(model: Any) -> list[tuple[str, list[int], list[int]]]:
    return [(n, list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()]


def hm_projector_path(model: Any) -> str:
    """The projector's path: the last module whose path ends with one of ``PROJECTORS``' (dotted parts whole)."""
    names = ("multi_modal_projector", *PROJECTORS.values())
    return [n for n, _ in model.named_modules() if f".{n}".endswith(tuple(f".{x}" for x in names))][-1]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_with_an_image_points_are_what_the_model_computes(name: str) -> None:
    """``run_with_cache`` takes the processor's inputs (pixel values, token types) and passes them on: the
    projector's output, the residual stream around each layer and the attention patterns (image tokens' masks
    included) equal what plain PyTorch hooks read; the image features are what the first layer reads at the image
    tokens' positions."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    out, seen = _reference(model, batch)
    own_hooks = _module_hooks(model)  # transformers' own (5.x captures the vision tower's outputs with hooks)
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
    assert _module_hooks(model) == own_hooks  # nothing left behind
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

    expected, _ = _reference(model, batch, edit)
    clean, _ = _reference(model, batch)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        got = hm.run_with_hooks(**batch, fwd_hooks=[(PROJECTOR_POINT, lambda x, hook: edit(x))])
        _, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(got), expected.logits)
    assert not torch.allclose(logits_of(got), clean.logits)
    at_text = batch["input_ids"] != IMAGE_TOKEN  # (Gemma 4 embeds the padding token at the image tokens)
    assert torch.equal(cache["hook_embed"][at_text], _embeddings(model, batch["input_ids"])[at_text])
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
    assert hm.hook_names[1:4] == [deepstack, FEATURES_POINT, PROJECTOR_POINT]
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


def logits_with(model: Any, batch: dict, *handles: Any) -> torch.Tensor:
    """The model's logits on ``batch`` with plain PyTorch hooks (their ``handles``, removed after)."""
    try:
        with torch.no_grad():
            return model(**batch).logits
    finally:
        for handle in handles:
            handle.remove()


def _embeddings(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.get_input_embeddings()(ids)


@pytest.mark.parametrize("name", ["llava", "qwen3_5", "qwen3_vl"])
def test_generate_with_hooks(name: str) -> None:
    """``hm.generate`` with the processor's inputs runs the hooks: an ablation of the image features gives what the
    same ablation by a plain hook gives, and differs from the clean generation (Qwen 3.5: through its hybrid cache,
    the DeltaNet's recurrent states beside the attention's keys and values, with multimodal RoPE positions)."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)

    def ablate(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(output)

    handle = model.get_submodule(hm_projector_path(model)).register_forward_hook(ablate)
    try:
        expected = model.generate(**batch, **settings)
    finally:
        handle.remove()
    clean = model.generate(**batch, **settings)
    hm = HookedModel.wrap(model)
    calls = []

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        calls.append(x.shape)
        return torch.zeros_like(x)

    with hm.hooks(fwd_hooks=[(PROJECTOR_POINT, hook)]):
        got = hm.generate(**batch, **settings)
    assert torch.equal(got, expected) and not torch.equal(got, clean)
    assert len(calls) == 1  # the image is read once, in the first forward; later steps reuse the cache
    hm.unwrap()


def test_a_plugin_that_does_not_declare_vision_language_models_is_not_used_for_one() -> None:
    """The language model's plugin describes a vision-language model only where its architecture declares
    ``vision_language`` (verified there): a LLaVA around an OLMo 2 language model is not given to the OLMo 2 plugin,
    whose description reads the outer config; it is refused by name, as before."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Olmo2Config

    from lensadapters import UnsupportedModelError, get_registry

    needs("olmo2")
    assert not any(arch.vision_language for _, arch in get_registry().claims("olmo2"))
    config = LlavaConfig(
        text_config=Olmo2Config(**TEXT),
        vision_config=CLIPVisionConfig(**TOWER, num_attention_heads=4, projection_dim=32),
        image_token_index=IMAGE_TOKEN,
    )
    with pytest.raises(UnsupportedModelError, match="llava"):
        HookedModel.wrap(LlavaForConditionalGeneration(config))


def test_lora_on_the_language_model() -> None:
    """A ``PeftModel`` with LoRA on the language model's projections: the LoRA points (``attn.hook_q_lora``...), the
    adapted forward, and the effective weights (those of the merged model)."""
    peft = pytest.importorskip("peft")
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    config = peft.LoraConfig(r=2, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    adapted = peft.get_peft_model(model, config).eval()
    with torch.no_grad():
        expected = adapted(**batch).logits
    hm = HookedModel.wrap(adapted)
    assert hm.plugin.name == "llama" and "blocks.1.attn.hook_v_lora" in hm.hook_names
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(logits), expected)
    assert cache["blocks.0.attn.hook_q_lora"].abs().max() > 0
    w_q, w_v = hm.W_Q.detach().clone(), hm.W_V.detach().clone()
    hm.unwrap()
    merged = HookedModel.wrap(adapted.merge_and_unload())
    torch.testing.assert_close(merged.W_Q, w_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.W_V, w_v, rtol=1e-5, atol=1e-6)
    merged.unwrap()


def test_8bit_language_model() -> None:
    """LLaVA loaded in 8-bit (bitsandbytes on the CPU): the points read what the quantized model computes (the
    query projection's output, the logits with an image) and the weights are the dequantized ones, within int8's
    rounding of the float model's."""
    pytest.importorskip("bitsandbytes")
    model, n_image = vlm("llava")
    batch = inputs(model, n_image)
    quantized = int8_copy(model)
    q_proj = quantized.get_decoder().layers[1].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear8bitLt"
    seen = []
    handle = q_proj.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    expected = logits_with(quantized, batch, handle)
    hm = HookedModel.wrap(quantized)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch)
    assert torch.equal(logits_of(logits), expected)
    assert torch.equal(cache["blocks.1.attn.hook_q"].flatten(-2), seen[0])
    float_hm = HookedModel.wrap(model)
    error = (hm.W_Q - float_hm.W_Q).abs().max() / float_hm.W_Q.abs().max()
    assert 0 < error < 2 / 127
    hm.unwrap(), float_hm.unwrap()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_transformer_lens_style_calls_pass_the_image_inputs_on(name: str) -> None:
    """A TransformerLens-style call (``return_type=``...) passes the multimodal model's own inputs (``pixel_values``,
    Gemma 3's ``token_type_ids``) on to it; a keyword neither TransformerLens nor the model has is still refused."""
    from lensadapters import TransformerLensKeywordError

    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    with torch.no_grad():
        expected = model(**batch).logits
    hm = HookedModel.wrap(model)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, return_type="logits", **rest)
        stopped = hm(ids, stop_at_layer=1, **rest)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)  # the call builds its own attention mask
    # the input of block 1 (Qwen3-VL's differs from block 0's output by the deepstack features it adds after it)
    torch.testing.assert_close(stopped, cache["blocks.1.hook_resid_pre"])
    with pytest.raises(TransformerLensKeywordError, match="image_size"):
        hm(ids, return_type="logits", image_size=3, **rest)
    hm.unwrap()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_transformer_lens_style_generate_with_an_image(name: str) -> None:
    """``hm.generate`` with TransformerLens' keywords takes the image inputs (to the first forward, with the key/value
    cache) and gives Hugging Face's greedy tokens, its hooks active; without the cache it refuses by name."""
    from lensadapters import TransformerLensKeywordError

    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    expected = model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    hm = HookedModel.wrap(model)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    calls = []
    with hm.hooks(fwd_hooks=[(PROJECTOR_POINT, lambda x, hook: calls.append(x.shape))]):
        got = hm.generate(ids, max_new_tokens=3, do_sample=False, stop_at_eos=False, return_type="tokens", **rest)
    assert torch.equal(got, expected) and len(calls) == 1
    with pytest.raises(TransformerLensKeywordError, match="use_past_kv_cache=True"):
        hm.generate(ids, max_new_tokens=2, use_past_kv_cache=False, stop_at_eos=False, return_type="tokens", **rest)
    with pytest.raises(TypeError, match="image_size"):
        hm.generate(ids, max_new_tokens=2, stop_at_eos=False, return_type="tokens", image_size=3)
    hm.unwrap()


def test_padded_batch_with_an_image_on_multimodal_rope_is_refused() -> None:
    """Qwen 3.5 gives its language model positions computed from the image grid: a TransformerLens-style call on a
    padded batch with an image (positions counted from the mask) is refused by name, not computed with the wrong
    positions; models whose positions are the tokens' indices (LLaVA) keep the padded call."""
    from lensadapters import TransformerLensKeywordError
    from lensadapters.adapters.vlm import computes_image_positions

    model, n_image = vlm("qwen3_5")
    batch = inputs(model, n_image)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    hm = HookedModel.wrap(model)
    with pytest.raises(TransformerLensKeywordError, match="multimodal RoPE"):
        hm(ids, return_type="logits", attention_mask=mask, **rest)
    with torch.no_grad():  # unpadded, or padded without an image: served
        assert hm(ids, return_type="logits", **rest).shape[:2] == ids.shape
        assert hm(ids, return_type="logits", attention_mask=mask).shape[:2] == ids.shape
    hm.unwrap()
    assert not computes_image_positions(vlm("llava")[0])


AUDIO_TOKEN = 103


def _gemma4_audio() -> Any:
    """Multimodal Gemma 4 with a tiny audio tower (``audio_config``): 16 frames of 8 mel features, subsampled 4x
    into 4 audio tokens, projected by ``embed_audio``."""
    model, _ = _gemma4()
    from transformers import Gemma4AudioConfig, Gemma4ForConditionalGeneration

    config = model.config
    config.audio_config = Gemma4AudioConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[8, 4],
        output_proj_dims=16,
        attention_chunk_size=4,
        attention_context_left=5,
    )
    config.audio_token_id = AUDIO_TOKEN
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()


def _audio_inputs() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.tensor([[1, 5, *[AUDIO_TOKEN] * 4, 7, 8]]),
        "input_features": torch.randn(1, 16, 8, generator=generator),
        "input_features_mask": torch.ones(1, 16, dtype=torch.bool),
    }


def test_audio_projector_points_read_and_edit_as_plain_hooks_do() -> None:
    """``audio_projector.hook_in`` is the audio tower's output as ``embed_audio`` reads it and
    ``audio_projector.hook_out`` its output (the audio features that replace the audio tokens' embeddings): each
    reads what a plain PyTorch hook on the projector sees, an edit at each changes the logits exactly as the same
    edit by a plain hook, and neither fires without audio (nor exists in a model without an audio tower)."""
    from lensadapters.adapters.vlm import AUDIO_EMBEDS_POINT, AUDIO_FEATURES_POINT

    model = _gemma4_audio()
    batch = _audio_inputs()
    projector = model.model.embed_audio
    seen: dict[str, torch.Tensor] = {}

    def edit(x: torch.Tensor) -> torch.Tensor:
        return x * -2.0 + 0.5

    def read_in(module: Any, args: tuple, kwargs: dict) -> None:
        seen["in"] = (args[0] if args else kwargs["inputs_embeds"]).clone()

    def read_out(module: Any, args: tuple, output: torch.Tensor) -> None:
        seen["out"] = output.clone()

    def edit_in(module: Any, args: tuple, kwargs: dict) -> Any:
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "inputs_embeds": edit(kwargs["inputs_embeds"])}

    def edit_out(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return edit(output)

    expected = {}
    reading = projector.register_forward_pre_hook(read_in, with_kwargs=True), projector.register_forward_hook(read_out)
    clean = logits_with(model, batch, *reading)
    for point, register, hook in (
        (AUDIO_FEATURES_POINT, projector.register_forward_pre_hook, edit_in),
        (AUDIO_EMBEDS_POINT, projector.register_forward_hook, edit_out),
    ):
        handle = register(hook, **({"with_kwargs": True} if point == AUDIO_FEATURES_POINT else {}))
        expected[point] = logits_with(model, batch, handle)
    hm = HookedModel.wrap(model)
    assert {AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT} <= set(hm.hook_names)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch, names_filter=[AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT])
        assert torch.equal(logits_of(logits), clean)
        assert torch.equal(cache[AUDIO_FEATURES_POINT], seen["in"])
        assert torch.equal(cache[AUDIO_EMBEDS_POINT], seen["out"])
        for point in (AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT):
            got = hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: edit(x))])
            assert torch.equal(logits_of(got), expected[point])
            assert not torch.equal(expected[point], clean)
        _, text_only = hm.run_with_cache(torch.tensor([[1, 5, 7, 8]]))
    assert AUDIO_FEATURES_POINT not in text_only and AUDIO_EMBEDS_POINT not in text_only
    hm.unwrap()
    without_audio = HookedModel.wrap(_gemma4()[0])
    assert not {AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT} & set(without_audio.hook_names)
    without_audio.unwrap()


def test_audio_projector_points_skip_a_call_that_embeds_token_ids() -> None:
    """A projector that also embeds token ids (Gemma 3n's ``embed_audio(input_ids=...)``, in every call) is not
    projecting features then: neither point fires, and the features call after it is read as usual."""
    from lensadapters.hooks.hook_point import HookPoint
    from lensadapters.wiring.vision import FeaturesSite

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.projection = torch.nn.Embedding(4, 3), torch.nn.Linear(2, 3)

        def forward(self, input_ids: Any = None, inputs_embeds: Any = None) -> torch.Tensor:
            return self.embedding(input_ids) if input_ids is not None else self.projection(inputs_embeds)

    module = Embedder()
    hook_in, hook_out = (
        HookPoint("audio_projector.hook_in", lambda p: None),
        HookPoint("audio_projector.hook_out", lambda p: None),
    )
    fired: list[torch.Tensor] = []
    for point in (hook_in, hook_out):
        point.add_hook(lambda x, hook: fired.append(x))
    handles = FeaturesSite(module, hook_in, hook_out).install()
    features = torch.randn(2, 2)
    with torch.no_grad():
        module(input_ids=torch.tensor([1, 2]))
        assert fired == []
        out = module(inputs_embeds=features)
    for handle in handles:
        handle.remove()
    assert len(fired) == 2 and torch.equal(fired[0], features) and torch.equal(fired[1], out)
