"""Vision-language models: a transformers ``*ForConditionalGeneration`` around a language model.

Such a model (LLaVA, multimodal Gemma 3...) is a vision tower, a projector and a language model (the decoder
``get_decoder()`` returns, or the text config's model inside it where that is the multimodal base model, with the
output embeddings ``get_output_embeddings()``). Its config nests the language model's config
(``config.text_config``, ``get_text_config()``) next to a ``vision_config``. The model is wrapped as the language
model's plugin describes it: the registry chooses that plugin from the text config's ``model_type``, the plugin
finds the decoder stack inside the whole model, and the language model's points have their usual names. The core
adds the projector's input (the vision tower's output as the projector reads it, :data:`IMAGE_FEATURES_POINT`) and
its output, where image features enter the text stream (:data:`IMAGE_EMBEDS_POINT`), under TransformerLens' Bridge
names, and the same two points of the audio projector where the model has one (:data:`AUDIO_POINTS`).

Nothing here names an architecture: the model is recognized from transformers' own generic accessors.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from torch import nn

#: the point at the projector's output (TransformerLens 4.x Bridge: ``vision_projector.hook_out``)
IMAGE_EMBEDS_POINT = "vision_projector.hook_out"
#: the point at the projector's input: the vision tower's output as the projector reads it (the Bridge's
#: ``vision_projector.hook_in``)
IMAGE_FEATURES_POINT = "vision_projector.hook_in"
#: the points a vision-language model adds, in the order they fire; neither fires in a call without an image
IMAGE_POINTS = (IMAGE_FEATURES_POINT, IMAGE_EMBEDS_POINT)
#: the attributes transformers' vision-language models give the module that maps vision features to the language
#: model's width (its output replaces the image tokens' embeddings): ``multi_modal_projector`` in most,
#: ``embed_vision`` where the model also embeds audio (its ``embed_audio`` is not a vision projector), ``connector``
#: where the projector also merges patches (pixel shuffle), ``merger`` where the vision tower ends with it (it
#: merges neighbouring patches and maps them to the language model's width), ``multimodal_embedder`` where a vision
#: embedder (one of those names, returning a model output, not the features) ends with it
PROJECTOR_NAMES = ("multi_modal_projector", "embed_vision", "connector", "merger", "multimodal_embedder")
#: the point at the audio projector's output, where audio features enter the text stream (named as the vision
#: projector's in TransformerLens' Bridge, which names no audio projector)
AUDIO_EMBEDS_POINT = "audio_projector.hook_out"
#: the point at the audio projector's input: the audio tower's output as the projector reads it
AUDIO_FEATURES_POINT = "audio_projector.hook_in"
#: the points a model with an audio projector adds, in the order they fire; neither fires in a call without audio
AUDIO_POINTS = (AUDIO_FEATURES_POINT, AUDIO_EMBEDS_POINT)
#: the attribute transformers' multimodal models give the module that maps the audio tower's output to the language
#: model's width (its output replaces the audio tokens' embeddings)
AUDIO_PROJECTOR_NAMES = ("embed_audio",)


def text_config(model: nn.Module) -> Any:
    """The config of the text model (``config.get_text_config()``: the config itself for a text-only model)."""
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def _submodule_path(model: nn.Module, target: nn.Module) -> Optional[str]:
    for name, module in model.named_modules():
        if module is target:
            return name
    return None


def language_model(model: nn.Module) -> Optional[nn.Module]:
    """The language model's decoder inside a vision-language model (``get_decoder()``), or ``None`` when ``model``
    is not one (no ``vision_config``, or a text config that is the config itself)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return None
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if get_text is not None else None
    if text is None or text is config or not getattr(text, "model_type", None):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if get_decoder is not None else None
    except (AttributeError, NotImplementedError):
        return None
    if isinstance(decoder, nn.Module) and getattr(getattr(decoder, "config", None), "vision_config", None) is not None:
        decoder = _text_model_in(decoder, text)
    if not isinstance(decoder, nn.Module) or decoder is model or _submodule_path(model, decoder) is None:
        return None
    return decoder


def _text_model_in(base: nn.Module, text: Any) -> Optional[nn.Module]:
    """The language model inside a multimodal base model: the submodule built from the text config (its
    ``model_type``, no vision config). Where ``get_decoder()`` gives the multimodal base model itself (transformers
    4.x's Idefics3 and SmolVLM), that is the decoder."""
    for module in base.modules():
        config = getattr(module, "config", None)
        if module is not base and getattr(config, "model_type", None) == text.model_type:
            return module if getattr(config, "vision_config", None) is None else None
    return None


def language_model_type(model: nn.Module) -> Optional[str]:
    """The ``model_type`` of a vision-language model's language model (the plugin that describes it claims that
    type), or ``None`` when ``model`` is not a vision-language model."""
    if language_model(model) is None:
        return None
    return str(text_config(model).model_type)


def projector_path(model: nn.Module) -> Optional[str]:
    """The path of a vision-language model's projector (its output is the image features that replace the image
    tokens' embeddings), or ``None``. Of a projector inside another (a vision embedder ending with its projection
    to the language model's width), the inner one: its output is the features."""
    if language_model(model) is None:
        return None
    found: Optional[str] = None
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTOR_NAMES and isinstance(module, nn.Module):
            if found is not None and not name.startswith(found + "."):
                break
            found = name
    return found


def audio_projector_path(model: nn.Module) -> Optional[str]:
    """The path of a vision-language model's audio projector (built where its config has an ``audio_config``), or
    ``None``."""
    if language_model(model) is None:
        return None
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in AUDIO_PROJECTOR_NAMES and isinstance(module, nn.Module):
            return name
    return None


def _keywords(forward: Any) -> set[str]:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return set()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def multimodal_inputs(model: nn.Module) -> frozenset[str]:
    """The keywords a vision-language model's forward takes beyond its language model's (``pixel_values``,
    ``image_sizes``, ``vision_feature_layer``...; not ``labels``): what a TransformerLens-style call passes on to
    it. Empty for any other model."""
    decoder = language_model(model)
    if decoder is None:
        return frozenset()
    return frozenset(_keywords(model.forward) - _keywords(decoder.forward) - {"labels"})


def computes_image_positions(model: nn.Module) -> bool:
    """Whether a vision-language model gives its language model positions computed from the image grids
    (multimodal RoPE: transformers' ``get_rope_index``), not the tokens' indices: positions counted from an
    attention mask are not its positions where an image is given."""
    if language_model(model) is None:
        return False
    return any(callable(getattr(module, "get_rope_index", None)) for module in model.modules())


def class_to_check(model: Any) -> Any:
    """The model whose class says which implementation computes the language model: the decoder of a
    vision-language model (the outer class is the multimodal one), the model itself otherwise."""
    decoder = language_model(model) if isinstance(model, nn.Module) else None
    return decoder if decoder is not None else model
