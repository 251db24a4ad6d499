"""The points a vision-language model adds to its language model's: the projector's input (the vision tower's
output as the projector reads it) and its output, where image features enter the text stream, and the same of its
audio projector where it has one (see :mod:`lensadapters.adapters.vlm`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.adapters.vlm import (
    AUDIO_EMBEDS_POINT,
    AUDIO_FEATURES_POINT,
    AUDIO_POINTS,
    IMAGE_EMBEDS_POINT,
    IMAGE_FEATURES_POINT,
    IMAGE_POINTS,
    audio_projector_path,
    projector_path,
)
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import InputSite, OutputSite, Site


def create_image_points(wiring: Any, new: Callable[[str], HookPoint]) -> tuple[Optional[str], Optional[str]]:
    """Create the projectors' points (they fire after ``hook_embed``: the model embeds the tokens, then computes the
    image and audio features that replace the image and audio tokens' embeddings); the paths of the vision and the
    audio projector, ``None`` for a model without one."""
    path, audio = projector_path(wiring.hf_model), audio_projector_path(wiring.hf_model)
    for names, condition in (
        (IMAGE_POINTS if path is not None else (), "in a forward with images (pixel_values)"),
        (AUDIO_POINTS if audio is not None else (), "in a forward with audio (input_features)"),
    ):
        for name in names:
            new(name).fires_when = condition
    return path, audio


class FeaturesSite(Site):
    """A projector's input and output in the calls that give it features (a floating-point tensor): a projector
    that also embeds token ids (called with ``input_ids``) is not projecting features then, and neither point
    fires."""

    def __init__(self, module: nn.Module, hook_in: HookPoint, hook_out: HookPoint) -> None:
        self.module, self._in, self._out = module, InputSite(module, hook_in), OutputSite(module, hook_out)
        self.points = (hook_in, hook_out)

    @staticmethod
    def _features(args: tuple, kwargs: dict) -> bool:
        value = args[0] if args else kwargs.get("inputs_embeds")
        return value is not None and value.is_floating_point()

    def install(self) -> list[RemovableHandle]:
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            return self._in._hook(module, args, kwargs) if self._features(args, kwargs) else None

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            return self._out._hook(module, args, output) if self._features(args, kwargs) else None

        return [
            self.module.register_forward_pre_hook(pre, with_kwargs=True),
            self.module.register_forward_hook(post, with_kwargs=True),
        ]


def build_image_sites(
    wiring: Any, paths: tuple[Optional[str], Optional[str]], core: Callable[[str], HookPoint]
) -> None:
    """The projector's input as it enters the module (an edit replaces the vision features it projects) and its
    output as it leaves (an edit replaces the image features the model scatters into the embeddings); the same of
    the audio projector (the audio tower's output, the audio features)."""
    path, audio = paths
    if audio is not None:
        wiring.add_site(
            FeaturesSite(wiring.hf_model.get_submodule(audio), core(AUDIO_FEATURES_POINT), core(AUDIO_EMBEDS_POINT))
        )
    if path is not None:
        projector = wiring.hf_model.get_submodule(path)
        wiring.add_site(InputSite(projector, core(IMAGE_FEATURES_POINT)))
        wiring.add_site(OutputSite(projector, core(IMAGE_EMBEDS_POINT)))
