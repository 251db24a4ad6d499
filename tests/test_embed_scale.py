"""``hook_embed`` of models that scale their embeddings (Gemma: ``sqrt(d_model)``), from token ids and from
``inputs_embeds``: a read is what the first block gets, an edit is exactly what the first block gets, ``W_E[ids]`` is
the model's own product, in float32, bfloat16 and float16 (transformers 4.x Gemma 2 multiplies after the embedding
module, in its forward; the other versions and Gemma 3 scale inside the module). Every installed architecture whose
description declares an embedding scale is checked, at a width whose square root no dtype represents. Where the
blocks read side inputs the model computes from the input (``ModelLayout.side_inputs``), the embeddings feed those
too: an edit reaches them as the model computes, and ``inputs_embeds`` are the model's own embeddings of tokens."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.sites import first_input, replace_first_input
from lensadapters.testing.tiny_models import ARCH_NAMES, from_config, tiny

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _scaled_config(family: str) -> Any:
    """The tiny model's config at width 48 (sqrt(48) is not representable in any of the dtypes), or None where the
    architecture's description declares no embedding scale."""
    hm = HookedModel.wrap(tiny(family))
    try:
        if hm.wiring.layout.embed_scale == 1.0:
            return None
    finally:
        hm.unwrap()
    config = copy.deepcopy(tiny(family).config)
    config.hidden_size = 48
    return config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ARCH_NAMES)
def test_hook_embed_is_what_the_first_block_gets_from_ids_and_from_inputs_embeds(family, dtype) -> None:
    config = _scaled_config(family)
    if config is None:
        pytest.skip(f"{family} declares no embedding scale")
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    model = from_config(config).to(dtype)
    edit = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    embeds = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    hm = HookedModel.wrap(model)
    first_block = model.get_submodule(f"{hm.wiring.layout.blocks}.0")
    side_inputs = hm.layout.side_inputs
    embedding = model.get_submodule(hm.layout.embed)
    hm.unwrap()
    if side_inputs:  # side inputs computed from the token ids: the model recovers the ids from exact embeddings only
        with torch.no_grad():
            embeds = model.get_input_embeddings()(
                torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(2))
            )

    first_inputs: dict = {}

    def replaced(module, args, kwargs):  # the same edit as a plain PyTorch hook on the first block's input
        return replace_first_input(args, kwargs, edit)

    def record(module, args, kwargs):
        first_inputs[len(first_inputs)] = first_input(args, kwargs)

    inputs: list[dict] = [{"input": ids}, {"inputs_embeds": embeds}]
    with torch.no_grad():
        handle = first_block.register_forward_pre_hook(record, with_kwargs=True)
        model(ids)
        try:
            model(inputs_embeds=embeds)
        except RuntimeError:  # transformers' Gemma 4 compares half-precision embeddings with the table times a float
            assert side_inputs and dtype != torch.float32, f"{family} {dtype} refuses its own embeddings"
            inputs.pop()
        handle.remove()
        if side_inputs:  # the model computes its side inputs from the embeddings too: the edit reaches them
            handle = embedding.register_forward_hook(lambda module, args, output: edit)
        else:
            handle = first_block.register_forward_pre_hook(replaced, with_kwargs=True)
        expected = model(ids).logits
        handle.remove()
    hm = HookedModel.wrap(model)
    seen: dict = {}
    try:
        what = f"{family} {dtype}"
        for i, kwargs in enumerate(inputs):
            args = (kwargs.pop("input"),) if "input" in kwargs else ()
            _, cache = hm.run_with_cache(*args, names_filter=["hook_embed", "blocks.0.hook_resid_pre"], **kwargs)
            assert torch.equal(cache["hook_embed"], first_inputs[i]), what
            assert torch.equal(cache["blocks.0.hook_resid_pre"], first_inputs[i]), what
            seen.clear()
            if side_inputs and i == 1:  # the model recovers the token ids from the embeddings: edited, it has none
                with pytest.raises(RuntimeError, match="exact"):
                    hm.run_with_hooks(*args, fwd_hooks=[("hook_embed", lambda x, hook: edit)], **kwargs)
                continue
            logits = hm.run_with_hooks(
                *args,
                fwd_hooks=[
                    ("hook_embed", lambda x, hook: edit),
                    ("blocks.0.hook_resid_pre", lambda x, hook: seen.setdefault("x", x.clone())),
                ],
                **kwargs,
            )
            assert torch.equal(seen["x"], edit), what  # the edit reaches the first block exactly
            if i == 0:
                assert torch.equal(logits, expected), what
        assert torch.equal(hm.W_E[ids], first_inputs[0]), what
    finally:
        hm.unwrap()
