"""The ends of an automatically described stack: embeddings the model scales in place and adds positions to (CTRL),
a final norm the model also runs elsewhere in the forward (NanoChat's norm of the embeddings). Each point's value
is compared with one computed from the HF modules, and an edit with the same edit made by a plain PyTorch hook."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel
from lensadapters.testing.every_model_type import build, input_ids


def _hooked(model_type: str) -> tuple[Any, HookedModel]:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this transformers version")
    model = build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, HookedModel.wrap(model)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_embeddings_scaled_in_place_before_positions_are_hook_embed() -> None:
    """CTRL: ``e = w(ids); e *= sqrt(d_model); h = e + positions``. ``hook_embed`` is ``w(ids) * sqrt(d_model)``
    exactly, and an edit of it moves the first layer's input by exactly the edit (as a plain pre-hook does)."""
    model, hm = _hooked("ctrl")
    assert "hook_embed" in hm.hook_names
    ids = input_ids()
    factor = float(model.config.n_embd) ** 0.5
    with torch.no_grad():
        expected = model.get_input_embeddings()(ids) * factor
    seen: dict[str, torch.Tensor] = {}
    hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda t, hook: seen.setdefault("v", t.clone()))])
    assert torch.equal(seen["v"], expected)

    delta = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    got = hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda t, hook: t + delta)])
    hm.reset_hooks()
    layer0 = model.transformer.h[0]

    def plain(module: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        moved = x + ((expected + delta) - expected)
        return ((moved, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": moved})

    handle = layer0.register_forward_pre_hook(plain, with_kwargs=True)
    try:
        want = _logits(model, ids)
    finally:
        handle.remove()
    assert not torch.equal(want, _logits(model, ids))  # the edit moves the logits
    assert torch.equal(got, want)


def test_a_final_norm_the_model_also_runs_on_the_embeddings_is_served_on_its_call_after_the_layers() -> None:
    """NanoChat: ``model.norm`` normalizes the embeddings before the first layer and the last layer's output after
    it. ``ln_final`` is the second call only: its values are that call's, an edit reaches the logits as a plain hook
    on that call does, and the first call (the embeddings' norm, ``hook_resid_pre`` of layer 0) is left alone."""
    model, hm = _hooked("nanochat")
    assert {"ln_final.hook_scale", "ln_final.hook_normalized"} <= set(hm.hook_names)
    ids = input_ids()
    norm, last = model.model.norm, model.model.layers[-1]
    outs: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).clone()))
    try:
        plain_logits = _logits(model, ids)
    finally:
        handle.remove()
    with torch.no_grad():
        x = outs[0]
        expected = norm(x)
        weight = getattr(norm, "weight", None)
        normalized = expected / weight if weight is not None else expected
    cache: dict[str, torch.Tensor] = {}
    names = ["ln_final.hook_normalized", "ln_final.hook_scale", "blocks.0.hook_resid_pre"]
    hm.run_with_hooks(ids, fwd_hooks=[(n, lambda t, hook: cache.setdefault(hook.name, t.clone())) for n in names])
    assert torch.allclose(cache["ln_final.hook_normalized"], normalized, atol=1e-6, rtol=0)
    assert torch.allclose(cache["ln_final.hook_scale"].squeeze(-1), x.pow(2).mean(-1).add(norm.eps).sqrt(), atol=1e-6)
    with torch.no_grad():
        assert torch.equal(cache["blocks.0.hook_resid_pre"], norm(model.model.embed_tokens(ids)))

    delta = torch.randn(normalized.shape, generator=torch.Generator().manual_seed(5))
    got = hm.run_with_hooks(ids, fwd_hooks=[("ln_final.hook_normalized", lambda t, hook: t + delta)])
    hm.reset_hooks()
    calls = [0]

    def plain(module: Any, args: tuple, output: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] != 2:  # the embeddings' norm is no ln_final
            return None
        return output + (delta * weight if weight is not None else delta)

    handle = norm.register_forward_hook(plain)
    try:
        want = _logits(model, ids)
    finally:
        handle.remove()
    assert calls[0] == 2 and not torch.equal(want, plain_logits)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.transformers5_only
def test_a_projection_fused_in_groups_of_heads_gives_queries_keys_and_values() -> None:
    """CodeGen: ``qkv_proj``'s output is ``mp_num`` groups, each ``[q | v | k]`` of its heads, and the rotary module
    returns ``(sin, cos)``. ``hook_q``/``hook_k``/``hook_v`` are those parts (computed here as the model's code does),
    and an edit of ``hook_v`` reaches the logits as the same edit of the projection's output by a plain hook."""
    model, hm = _hooked("codegen")
    names = [f"blocks.0.attn.hook_{n}" for n in ("q", "k", "v", "rot_q", "rot_k")]
    assert set(names) <= set(hm.hook_names)
    ids = input_ids()
    attn = model.transformer.h[0].attn
    outs: list[torch.Tensor] = []
    handle = attn.qkv_proj.register_forward_hook(lambda m, a, o: outs.append(o.clone()))
    try:
        plain_logits = _logits(model, ids)
    finally:
        handle.remove()
    local = attn.embed_dim // attn.mp_num
    heads = model.config.n_head
    query, value, key = outs[0].view(*ids.shape, attn.mp_num, 3 * local).split(local, dim=-1)
    expected = {n: t.reshape(*ids.shape, heads, -1) for n, t in (("q", query), ("k", key), ("v", value))}
    cache: dict[str, torch.Tensor] = {}
    hm.run_with_hooks(ids, fwd_hooks=[(n, lambda t, hook: cache.setdefault(hook.name, t.clone())) for n in names])
    for n, want in expected.items():
        assert torch.equal(cache[f"blocks.0.attn.hook_{n}"], want), n

    delta = torch.randn(expected["v"].shape, generator=torch.Generator().manual_seed(7))
    got = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_v", lambda t, hook: t + delta)])
    hm.reset_hooks()

    def plain(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        grouped = output.view(*ids.shape, attn.mp_num, 3 * local).clone()
        grouped[..., local : 2 * local] += delta.reshape(*ids.shape, attn.mp_num, local)
        return grouped.flatten(-2)

    handle = attn.qkv_proj.register_forward_hook(plain)
    try:
        want = _logits(model, ids)
    finally:
        handle.remove()
    assert not torch.equal(want, plain_logits)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
