"""The points a vision-language model adds to its language model's: the projector's output, where image features
enter the text stream (see :mod:`lensadapters.adapters.vlm`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lensadapters.adapters.vlm import IMAGE_EMBEDS_POINT, projector_path
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import OutputSite


def create_image_points(wiring: Any, new: Callable[[str], HookPoint]) -> Optional[str]:
    """Create the projector's point (it fires after ``hook_embed``: the model embeds the tokens, then computes the
    image features that replace the image tokens' embeddings); the projector's path, or ``None`` for a model
    without one."""
    path = projector_path(wiring.hf_model)
    if path is not None:
        new(IMAGE_EMBEDS_POINT)
    return path


def build_image_sites(wiring: Any, path: Optional[str], core: Callable[[str], HookPoint]) -> None:
    """The projector's output as it leaves the module: an edit replaces the image features the model scatters
    into the embeddings."""
    if path is not None:
        wiring.add_site(OutputSite(wiring.hf_model.get_submodule(path), core(IMAGE_EMBEDS_POINT)))
