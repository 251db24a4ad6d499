"""The vision tower's sub-block points (``vision.blocks.{i}.hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_in``,
``hook_mlp_out``, ``ln1``/``ln2.hook_normalized``): each read is what a plain PyTorch hook on the block's children
reads, each edit changes the logits exactly as the same edit by plain hooks does, no hook means HF's logits
bitwise, and a block whose MLP does not read ``resid_pre + attn_out`` gets its residual points only, by name."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.vlm import inputs, tower_blocks_of, vlm
from lensadapters.wiring.vision_tower import VisionTowerWarning
from tests.test_vision_tower import FAMILIES, RECORDED_INSIDE_ON_4, TRANSFORMERS_4, _edit, _logits, _out, _plain

#: the children (attention, MLP, norm before each) of each family's tower blocks, by their HF names
CHILDREN: dict[str, tuple[str, str, str, str]] = {
    "mistral3": ("attention", "feed_forward", "attention_norm", "ffn_norm"),
}
DEFAULT_CHILDREN = ("self_attn", "mlp", "layer_norm1", "layer_norm2")
SERVED = [f for f in FAMILIES if not (TRANSFORMERS_4 and f in RECORDED_INSIDE_ON_4)]


def _resid_mid_reference(block: Any, ln2: Any, mlp: Any, seen: list, edit: Any = None) -> list:
    """Plain hooks doing what TransformerLens' ``hook_resid_mid`` edit means: the MLP's norm reads the edited
    stream, and the block's output is the edited stream plus the MLP's output."""
    stash: dict[str, torch.Tensor] = {}
    handles = [_plain(ln2, "pre", seen, None if edit is None else lambda x: stash.setdefault("mid", edit(x)))]
    if edit is None:
        return handles

    def mlp_out(module: Any, args: tuple, output: Any) -> None:
        stash["mlp"] = output[0] if isinstance(output, tuple) else output

    def block_out(module: Any, args: tuple, output: Any) -> Any:
        value = stash.pop("mid") + stash.pop("mlp")
        return (value, *output[1:]) if isinstance(output, tuple) else value

    return handles + [mlp.register_forward_hook(mlp_out), block.register_forward_hook(block_out, prepend=True)]


def _references(block: Any, names: tuple[str, str, str, str]) -> dict[str, Callable[[list, Any], list]]:
    """For each sub-block point (relative to the block): the plain hooks reading it (and editing it by ``edit``)."""
    attn, mlp, ln1, ln2 = (block.get_submodule(n) for n in names)
    return {
        "ln1.hook_normalized": lambda seen, edit: [_plain(ln1, "post", seen, edit)],
        "hook_attn_out": lambda seen, edit: [_plain(attn, "post", seen, edit)],
        "hook_resid_mid": lambda seen, edit: _resid_mid_reference(block, ln2, mlp, seen, edit),
        "hook_mlp_in": lambda seen, edit: [_plain(ln2, "pre", seen, edit)],
        "ln2.hook_normalized": lambda seen, edit: [_plain(ln2, "post", seen, edit)],
        "hook_mlp_out": lambda seen, edit: [_plain(mlp, "post", seen, edit)],
    }


def _plain_logits(model: Any, batch: dict, handles: list) -> torch.Tensor:
    try:
        return _logits(model, batch)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("name", SERVED)
def test_sub_block_points_read_and_edit_as_plain_hooks_do(name: str) -> None:
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain: dict[str, tuple[list, torch.Tensor]] = {}
    for i, block in enumerate(blocks):
        for point, hooks in _references(block, CHILDREN.get(name, DEFAULT_CHILDREN)).items():
            seen: list = []
            _plain_logits(model, batch, hooks(seen, None))
            plain[f"vision.blocks.{i}.{point}"] = (seen, _plain_logits(model, batch, hooks([], _edit)))
    hf = _logits(model, batch)
    hm = HookedModel.wrap(model)
    assert set(plain) <= set(hm.hook_dict)
    with torch.no_grad():
        assert torch.equal(_out(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: p.startswith("vision.blocks."))
        for point, (seen, edited) in plain.items():
            assert len(seen) >= 1 and torch.equal(cache[point], torch.cat(seen)), point  # every image's call
            assert torch.equal(_out(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: _edit(x))])), edited)
        for i in range(len(blocks)):
            at = f"vision.blocks.{i}."
            mid = cache[at + "hook_resid_pre"] + cache[at + "hook_attn_out"]
            assert torch.equal(cache[at + "hook_resid_mid"], mid)
            assert torch.equal(cache[at + "hook_resid_post"], cache[at + "hook_resid_mid"] + cache[at + "hook_mlp_out"])
    assert torch.equal(_logits(model, batch), hf)
    hm.unwrap()


@pytest.mark.parametrize("name", SERVED)
def test_an_edit_of_resid_mid_is_an_edit_of_attn_out_by_the_same_difference(name: str) -> None:
    """Adding ``d`` to ``hook_resid_mid`` or to ``hook_attn_out`` is the same edit of the residual stream (up to the
    rounding of the sum's order): block 0's, which every family's language model reads."""
    model, n_image = vlm(name)
    batch = inputs(model, n_image)
    hm = HookedModel.wrap(model)
    d = torch.linspace(-1, 1, 32)
    logits = {}
    with torch.no_grad():
        base = _out(hm(**batch))
        for point in ("hook_resid_mid", "hook_attn_out"):
            hooks = [(f"vision.blocks.0.{point}", lambda x, hook: x + d.to(x.dtype))]
            logits[point] = _out(hm.run_with_hooks(**batch, fwd_hooks=hooks))
    assert not torch.allclose(logits["hook_resid_mid"], base, atol=1e-4)
    torch.testing.assert_close(logits["hook_resid_mid"], logits["hook_attn_out"], atol=1e-5, rtol=1e-5)
    hm.unwrap()


def test_a_block_whose_mlp_reads_more_than_the_residual_gets_its_residual_points_only() -> None:
    """A hook of the user's adds 1 to block 0's ``ln2`` input: its MLP no longer reads ``resid_pre + attn_out``; the
    blocks' sub-block points are refused by name, their residual points still served."""
    model, n_image = vlm("llava")
    ln2 = tower_blocks_of(model)[0].layer_norm2
    handle = ln2.register_forward_pre_hook(lambda module, args: (args[0] + 1, *args[1:]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, VisionTowerWarning)]
    assert len(messages) == 1 and "attention and MLP points are not served" in messages[0]
    assert "block 0 has no attention and MLP children" in messages[0]
    served = [p for p in hm.hook_dict if p.startswith("vision.")]
    assert "vision.blocks.0.hook_resid_post" in served and not any("mlp" in p or "attn" in p for p in served)
    hm.unwrap()
    handle.remove()
