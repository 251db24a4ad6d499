"""The points a vision-language model adds to its language model's: the projector's input (the vision tower's
output as the projector reads it) and its output, where image features enter the text stream (see
:mod:`lensadapters.adapters.vlm`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lensadapters.adapters.vlm import IMAGE_EMBEDS_POINT, IMAGE_FEATURES_POINT, IMAGE_POINTS, projector_path
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import InputSite, OutputSite


def create_image_points(wiring: Any, new: Callable[[str], HookPoint]) -> Optional[str]:
    """Create the projector's points (they fire after ``hook_embed``: the model embeds the tokens, then computes the
    image features that replace the image tokens' embeddings); the projector's path, or ``None`` for a model
    without one."""
    path = projector_path(wiring.hf_model)
    if path is not None:
        for name in IMAGE_POINTS:
            new(name)
    return path


def build_image_sites(wiring: Any, path: Optional[str], core: Callable[[str], HookPoint]) -> None:
    """The projector's input as it enters the module (an edit replaces the vision features it projects) and its
    output as it leaves (an edit replaces the image features the model scatters into the embeddings)."""
    if path is not None:
        projector = wiring.hf_model.get_submodule(path)
        wiring.add_site(InputSite(projector, core(IMAGE_FEATURES_POINT)))
        wiring.add_site(OutputSite(projector, core(IMAGE_EMBEDS_POINT)))
