"""Gemma 4's vision tower (transformers 5.x): its sandwich-normed blocks (a norm before and after the attention and
the MLP) get their sub-block points, ``hook_attn_out``/``hook_mlp_out`` after the post norms (what the block adds to
the residual, TransformerLens' Gemma 2 semantics), each read what a plain PyTorch hook on the Hugging Face module
reads (and, for the post norms, an RMSNorm written out here of what the attention and MLP gave), each edit changing
the logits exactly as the same edit by plain hooks does, and no hook giving HF's logits bitwise."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.vlm import inputs, tower_blocks_of, vlm
from tests.test_vision_tower import _edit, _logits, _out, _plain
from tests.test_vision_tower_parts import _plain_logits, _resid_mid_reference

pytestmark = pytest.mark.transformers5_only

#: the sub-block points of a sandwich-normed tower block (relative to ``vision.blocks.{i}.``), in the order they fire
SUB_BLOCK = (
    "hook_resid_pre",
    "ln1.hook_normalized",
    "hook_attn_out",
    "hook_resid_mid",
    "hook_mlp_in",
    "ln2.hook_normalized",
    "hook_mlp_out",
    "hook_resid_post",
)


def _references(block: Any) -> dict[str, Callable[[list, Any], list]]:
    """For each sub-block point: the plain hooks on Gemma 4's block children reading it (and editing it by ``edit``)."""
    ln1, post_attn = block.input_layernorm, block.post_attention_layernorm
    ln2, post_mlp = block.pre_feedforward_layernorm, block.post_feedforward_layernorm
    return {
        "ln1.hook_normalized": lambda seen, edit: [_plain(ln1, "post", seen, edit)],
        "hook_attn_out": lambda seen, edit: [_plain(post_attn, "post", seen, edit)],
        # the edited stream reaches the MLP's norm and the residual: block output = edited + post-MLP norm's output
        "hook_resid_mid": lambda seen, edit: _resid_mid_reference(block, ln2, post_mlp, seen, edit),
        "hook_mlp_in": lambda seen, edit: [_plain(ln2, "pre", seen, edit)],
        "ln2.hook_normalized": lambda seen, edit: [_plain(ln2, "post", seen, edit)],
        "hook_mlp_out": lambda seen, edit: [_plain(post_mlp, "post", seen, edit)],
    }


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm written out: ``x / sqrt(mean(x^2) + eps) * w``."""
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def test_sandwich_block_points_read_and_edit_as_plain_hooks_do() -> None:
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    blocks = tower_blocks_of(model)
    plain: dict[str, tuple[list, torch.Tensor]] = {}
    for i, block in enumerate(blocks):
        for point, hooks in _references(block).items():
            seen: list = []
            _plain_logits(model, batch, hooks(seen, None))
            plain[f"vision.blocks.{i}.{point}"] = (seen, _plain_logits(model, batch, hooks([], _edit)))
    raw: dict[str, list] = {}  # the attention's and MLP's own outputs, before the post norms
    handles = [
        _plain(getattr(block, child), "post", raw.setdefault(f"{i}.{child}", []))
        for i, block in enumerate(blocks)
        for child in ("self_attn", "mlp")
    ]
    hf = _plain_logits(model, batch, handles)
    hm = HookedModel.wrap(model)
    names = [p for p in hm.hook_dict if p.startswith("vision.blocks.")]
    assert names[: 2 * len(SUB_BLOCK)] == [p for i in range(2) for p in (f"vision.blocks.{i}.{s}" for s in SUB_BLOCK)]
    with torch.no_grad():
        assert torch.equal(_out(hm(**batch)), hf)  # no hooks: HF's forward
        _, cache = hm.run_with_cache(**batch, names_filter=lambda p: p.startswith("vision.blocks."))
        for point, (seen, edited) in plain.items():
            assert len(seen) == 1 and torch.equal(cache[point], seen[0]), point
            got = _out(hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook: _edit(x))]))
            assert torch.equal(got, edited) and not torch.equal(got, hf), point
        for i, block in enumerate(blocks):
            at = f"vision.blocks.{i}."
            assert torch.equal(cache[at + "hook_resid_mid"], cache[at + "hook_resid_pre"] + cache[at + "hook_attn_out"])
            assert torch.equal(cache[at + "hook_resid_post"], cache[at + "hook_resid_mid"] + cache[at + "hook_mlp_out"])
            # hook_attn_out / hook_mlp_out are the post norms of the attention's / MLP's outputs, not those outputs
            for point, child, norm in (
                ("hook_attn_out", "self_attn", block.post_attention_layernorm),
                ("hook_mlp_out", "mlp", block.post_feedforward_layernorm),
            ):
                (inner,) = raw[f"{i}.{child}"]
                assert not torch.allclose(cache[at + point], inner, atol=1e-2)
                torch.testing.assert_close(cache[at + point], _rms(inner, norm.weight, norm.eps), atol=1e-5, rtol=1e-5)
    assert torch.equal(_logits(model, batch), hf)
    hm.unwrap()
    assert torch.equal(_logits(model, batch), hf)


def test_an_edit_of_resid_mid_is_an_edit_of_attn_out_by_the_same_difference() -> None:
    """Adding ``d`` to ``hook_resid_mid`` or to ``hook_attn_out`` (after the post-attention norm) is the same edit of
    the residual stream, up to the rounding of the sum's order; adding it to the attention's own output is not (the
    post norm rescales it)."""
    model, n_image = vlm("gemma4")
    batch = inputs(model, n_image)
    d = torch.linspace(-1, 1, 32)
    attn = tower_blocks_of(model)[0].self_attn
    inside = _logits(model, batch, attn.register_forward_hook(lambda m, a, out: (out[0] + d, *out[1:])))
    hm = HookedModel.wrap(model)
    logits = {}
    with torch.no_grad():
        base = _out(hm(**batch))
        for point in ("hook_resid_mid", "hook_attn_out"):
            hooks = [(f"vision.blocks.0.{point}", lambda x, hook: x + d.to(x.dtype))]
            logits[point] = _out(hm.run_with_hooks(**batch, fwd_hooks=hooks))
    assert not torch.allclose(logits["hook_resid_mid"], base, atol=1e-4)
    torch.testing.assert_close(logits["hook_resid_mid"], logits["hook_attn_out"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(inside, logits["hook_attn_out"], atol=1e-4)
    hm.unwrap()
