"""Tiny vision-language models for the vision tower's points (``tests/test_vision_tower.py``): LLaVA and
LLaVA-NeXT (CLIP towers), Gemma 3 (SigLIP), Idefics3 and SmolVLM, Mistral 3 (Pixtral), Qwen2-VL (a tower the probe
refuses); eager attention, seeded weights of unit scale, and their inputs with an image."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

IMAGE_TOKEN = 100
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


def _eager(cls: Any, config: Any) -> Any:
    return cls._from_config(config, attn_implementation="eager")


def _llava(next_: bool = False) -> tuple[Any, int]:
    import transformers

    fields: dict[str, Any] = dict(image_grid_pinpoints=[[16, 16], [16, 32]]) if next_ else {}
    prefix = "LlavaNext" if next_ else "Llava"
    config = getattr(transformers, f"{prefix}Config")(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=transformers.CLIPVisionConfig(**TOWER, num_attention_heads=4, projection_dim=32),
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        **fields,
    )
    return _eager(getattr(transformers, f"{prefix}ForConditionalGeneration"), config), 36 if next_ else 16


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
    return _eager(Gemma3ForConditionalGeneration, config), 4


def _mistral3() -> tuple[Any, int]:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    config = Mistral3Config(
        text_config=MistralConfig(**TEXT, sliding_window=4),
        vision_config=PixtralVisionConfig(**TOWER, num_attention_heads=4, head_dim=8),  # type: ignore[call-arg]
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return _eager(Mistral3ForConditionalGeneration, config), 4


def _idefics3(name: str) -> tuple[Any, int]:
    import transformers

    config = getattr(transformers, f"{name}Config")(
        text_config=transformers.LlamaConfig(**TEXT).to_dict(),
        vision_config=getattr(transformers, f"{name}VisionConfig")(**TOWER, num_attention_heads=4).to_dict(),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    return _eager(getattr(transformers, f"{name}ForConditionalGeneration"), config), 4


def _qwen2_vl() -> tuple[Any, int]:
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if transformers.__version__.startswith("4."):
        fields: dict[str, Any] = dict(rope_theta=10000.0, rope_scaling={**rope, "type": "default"})
    else:
        fields = dict(rope_parameters=rope)
    config = transformers.Qwen2VLConfig(
        text_config=transformers.Qwen2VLTextConfig(**TEXT, **fields).to_dict(),
        vision_config=dict(
            depth=2,
            num_heads=4,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            embed_dim=32,
            hidden_size=TEXT["hidden_size"],
            mlp_ratio=2,
        ),
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=101,
        vision_end_token_id=102,
        video_token_id=103,
    )
    return _eager(transformers.Qwen2VLForConditionalGeneration, config), 4


#: each family's builder: the model and its number of image tokens per image
BUILDERS: dict[str, Callable[[], tuple[Any, int]]] = {
    "llava": _llava,
    "llava_next": lambda: _llava(next_=True),
    "gemma3": _gemma3,
    "idefics3": lambda: _idefics3("Idefics3"),
    "smolvlm": lambda: _idefics3("SmolVLM"),
    "mistral3": _mistral3,
    "qwen2_vl": _qwen2_vl,
}


def tiny_vlm(name: str) -> tuple[Any, int]:
    """The model (eval mode, weights of unit scale so every point's value is far from rounding noise) and its
    number of image tokens per image."""
    torch.manual_seed(0)
    model, n_image = BUILDERS[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval(), n_image


def vlm_inputs(model: Any, n_image: int, image: bool = True) -> dict[str, Any]:
    """Two sequences: text, the image's tokens (when ``image``), text; with pixel values for one image each."""
    g = torch.Generator().manual_seed(1)
    text = torch.randint(3, 90, (2, 5), generator=g)
    middle = torch.full((2, n_image), IMAGE_TOKEN) if image else torch.randint(3, 90, (2, n_image), generator=g)
    ids = torch.cat([text[:, :2], middle, text[:, 2:]], dim=1)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if not image:
        return kwargs
    vision = model.config.vision_config
    size = getattr(vision, "image_size", 16)
    if getattr(vision, "temporal_patch_size", None):  # Qwen: flattened patches and the grid
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
    if "token_type_ids" in inspect.signature(model.forward).parameters:  # Gemma 3: the image tokens' types
        kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    return kwargs
