"""Hook points as attributes (``hm.blocks[0].attn.hook_pattern``) and TransformerLens' HookPoint methods."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters import HookedModel, HookPoint
from lensadapters.testing.tiny_models import ARCH_NAMES, first_causal, tiny


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_every_hook_point_is_an_attribute(arch: str) -> None:
    hm = HookedModel.wrap(tiny(arch))
    for name in hm.hook_names:
        node: Any = hm
        for part in name.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        assert isinstance(node, HookPoint) and node is hm.hook_dict[name]
    assert len(hm.blocks) == hm.cfg.n_layers and hm.blocks[-1].hook_resid_pre is hm.point(
        f"blocks.{hm.cfg.n_layers - 1}.hook_resid_pre"
    )
    assert [b.hook_resid_post.name for b in hm.blocks] == [f"blocks.{i}.hook_resid_post" for i in range(len(hm.blocks))]
    assert len(hm.blocks[:1]) == 1
    with pytest.raises(IndexError):
        hm.blocks[hm.cfg.n_layers]
    hm.unwrap()


def test_hook_point_add_hook_and_remove_hooks() -> None:
    hm = HookedModel.wrap(tiny(first_causal()))
    ids = torch.zeros(1, 3, dtype=torch.long)
    seen: list[str] = []
    hm.hook_dict["blocks.0.hook_resid_pre"].add_hook(lambda t, hook: seen.append(hook.name))
    hm.blocks[0].attn.hook_pattern.add_hook(lambda t, hook: seen.append(hook.name), is_permanent=True)
    with torch.no_grad():
        hm(ids)
    assert seen == ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern"] and hm.has_hooks
    hm.reset_hooks()
    seen.clear()
    with torch.no_grad():
        hm(ids)
    assert seen == ["blocks.0.attn.hook_pattern"]  # the permanent one stays
    hm.blocks[0].attn.hook_pattern.remove_hooks(including_permanent=True)
    assert not hm.has_hooks
    hm.unwrap()


def test_misspelled_names_and_decoder_layer_attributes() -> None:
    hm = HookedModel.wrap(tiny(first_causal()))
    with pytest.raises(AttributeError, match="hook_pattern"):
        _ = hm.blocks[0].attn.hook_patern
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = hm.nonsense
    norm_attr = hm.block_layouts[0].ln1.split(".")[0]  # the decoder layer's own attribute (not a hook name)
    with pytest.warns(DeprecationWarning, match="block_modules"):
        module = getattr(hm.blocks[0], norm_attr)
    assert module is getattr(hm.block_modules[0], norm_attr)
    hm.unwrap()


def test_a_property_that_raises_keeps_its_message() -> None:
    for arch in ARCH_NAMES:
        hm = HookedModel.wrap(tiny(arch))
        if hm.cfg.positional_embedding_type == "rotary":
            with pytest.raises(AttributeError, match="no learned position embeddings"):
                _ = hm.W_pos
            hm.unwrap()
            return
        hm.unwrap()
    pytest.skip("no rotary architecture installed")
