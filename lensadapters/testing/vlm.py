"""Builders of tiny random vision-language (and audio) models for the tests of ``*ForConditionalGeneration``: the
models (``BUILDERS``, ``vlm``), their inputs, and what plain PyTorch hooks read and compute on them
(``plain_reference``, ``logits_with``), to compare the wrapped model's points with.

LLaVA and LLaVA-NeXT (Llama language model, CLIP vision tower), Mistral 3 (Pixtral vision tower), multimodal Gemma 3
(SigLIP vision tower), multimodal Gemma 4 (its own vision tower, projector ``embed_vision``; with ``gemma4_audio`` a
tiny audio tower), Idefics3 and SmolVLM (Llama language model, projector ``connector``), Qwen 2/2.5/3 VL and 3.5,
built from their configs: 16x16 images in 4x4 patches, the image tokens' count the model's own.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from lensadapters import hf
from lensadapters.testing.tiny_models import needs
from lensadapters.wiring.vision_tower import tower_blocks, vision_tower

IMAGE_TOKEN = 100
PROJECTOR_POINT = "vision_projector.hook_out"


def tower_block_points(
    attention: tuple[str, ...] = (), output: bool = True, post_norms: bool = False, scales: bool = True
) -> tuple[str, ...]:
    """A vision tower block's points (relative to ``vision.blocks.{i}.``) in the order they fire: the residual and
    sub-block points, ``attention``'s between ``ln1`` and ``hook_attn_out``, ``hook_resid_post`` last (``output``);
    ``ln1``'s and ``ln2``'s ``hook_scale`` before their ``hook_normalized`` (``scales``: their ``NormSpec`` is
    known, as every tested tower's is); with ``post_norms`` (sandwich-normed blocks, Gemma 4's) ``ln1_post``'s and
    ``ln2_post``'s ``hook_scale`` and ``hook_normalized`` before ``hook_attn_out`` and ``hook_mlp_out``."""

    def post(norm: str) -> tuple[str, ...]:
        return (f"{norm}.hook_scale", f"{norm}.hook_normalized") if post_norms else ()

    def pre(norm: str) -> tuple[str, ...]:
        return (f"{norm}.hook_scale", f"{norm}.hook_normalized") if scales else (f"{norm}.hook_normalized",)

    before = ("hook_resid_pre", *pre("ln1"), *attention, *post("ln1_post"), "hook_attn_out")
    after = ("hook_resid_mid", "hook_mlp_in", *pre("ln2"), *post("ln2_post"), "hook_mlp_out")
    return (*before, *after, *(("hook_resid_post",) if output else ()))


FEATURES_POINT = "vision_projector.hook_in"
TOWER: dict[str, Any] = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
TEXT: dict[str, Any] = dict(
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
        vision_config=PixtralVisionConfig(**TOWER, num_attention_heads=4, head_dim=8),  # type: ignore[call-arg]
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration._from_config(config, attn_implementation="eager"), 4


def gemma4_vlm() -> tuple[Any, int]:
    """Multimodal Gemma 4 (transformers 5.x): the image as 16 patches of 4x4 pixels with their (x, y) positions,
    pooled 2x2 into 4 image tokens; per-layer inputs; bidirectional attention over each image's tokens
    (``use_bidirectional_attention="vision"``); no audio tower (no ``audio_config``)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip("Gemma 4 needs transformers 5.x")
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(  # type: ignore[call-arg]
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

    text = Gemma4UnifiedTextConfig(  # type: ignore[call-arg]
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
    moe_fields: dict[str, Any] = (
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
    "gemma4": ("gemma4_text", gemma4_vlm),
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


def plain_reference(model: Any, batch: dict[str, Any], edit: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
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


def module_hooks(model: Any) -> list[tuple[str, list[int], list[int]]]:
    return [(n, list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()]


def tower_blocks_of(model: Any) -> Any:
    """The blocks of ``model``'s vision tower (found as the wiring finds them; asserted found)."""
    found = vision_tower(model)
    assert found is not None
    blocks = tower_blocks(found[1])
    assert blocks is not None
    return blocks[1]


def hm_projector_path(model: Any) -> str:
    """The projector's path: the last module whose path ends with one of ``PROJECTORS``' (dotted parts whole)."""
    names = ("multi_modal_projector", *PROJECTORS.values())
    return [n for n, _ in model.named_modules() if f".{n}".endswith(tuple(f".{x}" for x in names))][-1]


def logits_with(model: Any, batch: dict, *handles: Any) -> torch.Tensor:
    """The model's logits on ``batch`` with plain PyTorch hooks (their ``handles``, removed after)."""
    try:
        with torch.no_grad():
            return model(**batch).logits
    finally:
        for handle in handles:
            handle.remove()


def embeddings_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.get_input_embeddings()(ids)


AUDIO_TOKEN = 103


def gemma4_audio() -> Any:
    """Multimodal Gemma 4 with a tiny audio tower (``audio_config``): 16 frames of 8 mel features, subsampled 4x
    into 4 audio tokens, projected by ``embed_audio``."""
    model, _ = gemma4_vlm()
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


def audio_inputs() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.tensor([[1, 5, *[AUDIO_TOKEN] * 4, 7, 8]]),
        "input_features": torch.randn(1, 16, 8, generator=generator),
        "input_features_mask": torch.ones(1, 16, dtype=torch.bool),
    }
