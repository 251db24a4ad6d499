"""Attention computed in the model's own code (no attention interface), served by the softmax capture
(:mod:`lensadapters.hooks.softmax_capture`) where the automatic description verified it
(:mod:`lensadapters.adapters.generic.own_attention`). Three forms, on tiny models no plugin claims: a softmax of
``[b, heads, q, k]`` scores (GPT-Neo), of ``[b * heads, q, k]`` scores from ``baddbmm`` (GPT-NeoX-Japanese), and
``F.scaled_dot_product_attention`` called in the model's code (Falcon under sdpa)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lensadapters import HookedModel
from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.own_attention import _Op, own_call
from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks import softmax_capture
from lensadapters.testing.every_model_type import build, input_ids


def _wrap(model: torch.nn.Module) -> HookedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedModel.wrap(model, adapter="generic")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


class _HandEdit(TorchFunctionMode):
    """The plain-PyTorch edit: adds ``delta`` to the first softmax's input (``scores``) or output (``pattern``)."""

    def __init__(self, part: str, delta: torch.Tensor) -> None:
        super().__init__()
        self.part, self.delta, self.done = part, delta, False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax) or self.done:
            return func(*args, **kwargs)
        self.done = True
        x = args[0]
        if self.part == "scores":
            return func(x + self.delta.reshape(x.shape), *args[1:], **kwargs)
        out = func(*args, **kwargs)
        return out + self.delta.reshape(out.shape)


def _by_hand(module: torch.nn.Module, part: str, delta: torch.Tensor) -> Callable[[], None]:
    modes: list[_HandEdit] = []

    def push(m: Any, a: Any) -> None:
        modes.append(_HandEdit(part, delta))
        modes[-1].__enter__()

    def pop(m: Any, a: Any, o: Any) -> None:
        modes.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(push), module.register_forward_hook(pop, always_call=True)]
    return lambda: [h.remove() for h in handles] and None


@pytest.fixture(scope="module")
def neo() -> tuple[torch.nn.Module, HookedModel]:
    model = build("gpt_neo")
    return model, _wrap(model)


def test_the_own_code_layers_are_described_in_full(neo: tuple[torch.nn.Module, HookedModel]) -> None:
    model, hm = neo
    found = findings(model)
    assert set(found.own_attention) == set(range(len(hm.block_modules)))
    for name in ("q", "k", "v", "attn_scores", "pattern", "z"):
        assert f"blocks.0.attn.hook_{name}" in hm.hook_names
    assert not found.unverified.get("blocks.0.attn.hook_pattern")


def test_the_pattern_is_eager_math_from_the_modules_weights(neo: tuple[torch.nn.Module, HookedModel]) -> None:
    """GPT-Neo: scores ``q·kᵀ`` (no scaling), causal; recomputed from the projections' weights on the layer's input."""
    model, hm = neo
    ids = input_ids()
    _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0."))
    attention = model.transformer.h[0].attn.attention
    x = model.transformer.h[0].ln_1(cache["blocks.0.hook_resid_pre"])
    heads = hm.cfg.n_heads
    q, k, v = (
        p(x).unflatten(-1, (heads, -1)).transpose(1, 2) for p in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    scores = q @ k.transpose(-1, -2)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    pattern = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], pattern)
    served = cache["blocks.0.attn.hook_attn_scores"]
    torch.testing.assert_close(served[..., causal], scores[..., causal])
    assert bool((served[..., ~causal] < -1e30).all())  # masked, as the model masks them (finfo.min)
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"], (pattern @ v).transpose(1, 2))


@pytest.mark.parametrize("part", ["scores", "pattern"])
def test_an_edit_is_the_same_edit_by_hand_with_exact_gradients(neo: tuple[torch.nn.Module, HookedModel], part: str):
    model, hm = neo
    ids = input_ids()
    heads, p = hm.cfg.n_heads, ids.shape[1]
    base = torch.randn(1, heads, p, p, generator=torch.Generator().manual_seed(3)) * 0.1
    base = base.tril() if part == "pattern" else base  # never onto a masked score

    def run(through_point: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad()
        delta = base.clone().requires_grad_(True)
        name = "blocks.0.attn." + ("hook_attn_scores" if part == "scores" else "hook_pattern")
        if through_point:
            with hm.hooks(fwd_hooks=[(name, lambda t, hook: t + delta)]):
                logits = _logits(model, ids)
        else:
            remove = _by_hand(model.transformer.h[0].attn, part, delta)
            try:
                logits = _logits(model, ids)
            finally:
                remove()
        logits.square().sum().backward()
        weight = model.transformer.h[0].attn.attention.q_proj.weight
        return logits.detach(), delta.grad, weight.grad.clone()

    hooked, by_hand = run(True), run(False)
    assert not torch.equal(hooked[0], _logits(model, ids).detach())  # the edit moved the logits
    for a, b in zip(hooked, by_hand):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_hook_is_the_models_own_forward_and_pushes_no_mode() -> None:
    model = build("gpt_neo")
    ids = input_ids()
    before = _logits(model, ids)
    hm = _wrap(model)
    depth: list[int] = []
    inner = model.transformer.h[0].attn.attention  # runs inside the module the capture hooks
    handle = inner.register_forward_pre_hook(lambda m, a: depth.append(torch._C._len_torch_function_stack()))
    try:
        plain = _logits(model, ids)
        with hm.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", lambda t, hook: None)]):
            other_layer = _logits(model, ids)
        with hm.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
            read_only = _logits(model, ids)
    finally:
        handle.remove()
    assert depth == [0, 0, 1]  # no hook, or another layer's: nothing pushed for this layer
    assert torch.equal(plain, before)
    assert torch.equal(other_layer, before)
    assert torch.equal(read_only, before)  # a hook that reads changes nothing


def test_training_mode_is_refused_by_name(neo: tuple[torch.nn.Module, HookedModel]) -> None:
    model, hm = neo
    model.train()
    try:
        with hm.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
            with pytest.raises(UnsupportedModelError, match="GPTNeoAttention.*eval mode"):
                _logits(model, input_ids())
        assert torch._C._len_torch_function_stack() == 0  # nothing left pushed
    finally:
        model.eval()


def test_baddbmm_scores_of_merged_heads_read_as_the_models_weights() -> None:
    """GPT-NeoX-Japanese: ``baddbmm`` on ``[b * heads, q, d]``, viewed back to ``[b, heads, q, k]`` before the
    softmax; the pattern is the attention weights the model returns itself, an edit matches the one by hand."""
    model = build("gpt_neox_japanese")
    hm = _wrap(model)
    ids = input_ids()
    assert "blocks.0.attn.hook_pattern" in hm.hook_names
    _, cache = hm.run_with_cache(ids, names_filter="blocks.0.attn.hook_pattern")
    own = model(input_ids=ids, output_attentions=True, use_cache=False).attentions[0]
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], own)
    delta = torch.randn(own.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    with hm.hooks(fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda t, hook: t + delta)]):
        hooked = _logits(model, ids)
    remove = _by_hand(model.gpt_neox_japanese.layers[0].attention, "scores", delta)
    try:
        by_hand = _logits(model, ids)
    finally:
        remove()
    torch.testing.assert_close(hooked, by_hand, rtol=0, atol=0)


def test_sdpa_called_in_the_models_code_is_computed_explicitly() -> None:
    """Falcon under sdpa calls ``F.scaled_dot_product_attention`` itself: while hooked, the capture computes it
    explicitly; its pattern is the weights the model's own eager path returns."""
    model = build("falcon")
    model.config._attn_implementation = "sdpa"
    hm = _wrap(model)
    ids = input_ids()
    assert "blocks.0.attn.hook_pattern" in hm.hook_names
    plain = _logits(model, ids)
    _, cache = hm.run_with_cache(ids, names_filter="blocks.0.attn.hook_pattern")
    with hm.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
        read = _logits(model, ids)
    model.config._attn_implementation = "eager"  # its softmax path, with the additive mask it is written for
    try:
        own = model(input_ids=ids, output_attentions=True, use_cache=False).attentions[0]
    finally:
        model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], own)
    torch.testing.assert_close(read, plain)  # explicit attention: sdpa's numbers up to rounding


def test_a_wrong_capture_is_caught_and_the_points_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that views the scores wrongly (keys reversed) fails the verification: the points are not served,
    and the warning's account says why."""
    right = softmax_capture.as_heads
    monkeypatch.setattr(softmax_capture, "as_heads", lambda t, heads: right(t, heads).flip(-1))
    model = build("gpt_neo")
    hm = _wrap(model)
    found = findings(model)
    assert "blocks.0.attn.hook_pattern" not in hm.hook_names
    assert "blocks.0.attn.hook_attn_scores" not in hm.hook_names
    assert "not the reference" in found.unverified["blocks.0.attn.hook_pattern"]
    assert "blocks.0.attn.hook_q" in hm.hook_names  # the rest of the layer is served


def test_a_layer_with_two_softmaxes_gets_no_own_code_call() -> None:
    x = torch.zeros(1, 2, 3, 3)
    ops = [_Op("softmax", "attn", (x,), x), _Op("softmax", "attn", (x,), x)]
    parts, why = own_call(torch.nn.Module(), 0, ops, 1)
    assert parts is None and "more than one softmax" in why


def test_a_linear_subclass_is_read_only_where_its_forward_is_the_linear_map() -> None:
    """Falcon's ``FalconLinear`` (``x @ weight.T + bias`` in its own forward) is read; a subclass that computes
    something else is not (the weight would not be the matrix)."""
    from lensadapters.adapters.defaults import lensadapters_linear_weight

    class Plain(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T + self.bias

    class Scaled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    read = lensadapters_linear_weight(module=Plain(4, 3))
    assert read is not None and read.W.shape == (4, 3)
    assert lensadapters_linear_weight(module=Scaled(4, 3)) is None


def _neo_calling_sdpa() -> torch.nn.Module:
    """Tiny GPT-Neo whose attention modules call ``F.scaled_dot_product_attention`` in their own code (an instance
    attribute standing for a model written so, as transformers 4.x's ``*SdpaAttention`` classes are): causal, no
    padding, GPT-Neo's unscaled scores."""
    model = build("gpt_neo")

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None, *rest: Any):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=1.0)
        return out, None

    for layer in model.transformer.h:
        layer.attn.attention._attn = attend
    return model


def test_sdpa_in_the_models_code_is_verified_against_pytorchs_math_attention() -> None:
    """The verification's reference for a ``scaled_dot_product_attention`` call in the model's code is PyTorch's own
    math implementation (its weights; its output must be the kernel's): the scores and pattern are served verified,
    the pattern is those weights, and an edit of the pattern is the same edit made by hand to them."""
    model = _neo_calling_sdpa()
    hm = _wrap(model)
    found = findings(model)
    for name in ("attn_scores", "pattern"):
        assert f"blocks.0.attn.hook_{name}" in hm.hook_names
        assert not found.unverified.get(f"blocks.0.attn.hook_{name}")
    ids = input_ids()
    _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    q, k, v = (cache[f"blocks.0.attn.hook_{x}"].transpose(1, 2) for x in "qkv")
    _, weights = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True, scale=1.0)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], weights)

    def halve(t: torch.Tensor) -> torch.Tensor:
        return t * torch.tensor([0.5, 1.0, 1.0, 1.0])[: t.shape[1], None, None]

    edited = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: halve(t))])
    layer = model.transformer.h[0].attn.attention

    def by_hand(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *rest: Any):
        _, w = torch.ops.aten._scaled_dot_product_attention_math(query, key, value, is_causal=True, scale=1.0)
        return halve(w) @ value, None

    layer._attn = by_hand
    expected = _logits(model, ids)
    torch.testing.assert_close(edited.logits if hasattr(edited, "logits") else edited, expected)


def test_a_wrong_sdpa_capture_is_caught_and_the_points_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving the explicit sdpa with its keys reversed fails the verification against PyTorch's math attention."""
    right = softmax_capture.as_heads
    monkeypatch.setattr(softmax_capture, "as_heads", lambda t, heads: right(t, heads).flip(-1))
    model = _neo_calling_sdpa()
    hm = _wrap(model)
    assert "blocks.0.attn.hook_pattern" not in hm.hook_names
    assert "not the reference" in findings(model).unverified["blocks.0.attn.hook_pattern"]


def test_key_heads_the_model_repeated_are_read_once_and_a_routers_softmax_is_no_attention() -> None:
    """Grouped-query attention written in the model's code repeats each key/value head per query head before the
    product: the call's keys and values are each head once (the projections give those). A softmax over a
    ``[tokens, experts]`` matrix beside the attention (a router's) does not make the layer's attention ambiguous."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 4, generator=g) for h in (4, 2, 2))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    repeated = tuple(t.repeat_interleave(2, dim=1) for t in (k, v))
    router = torch.softmax(torch.randn(3, 8, generator=g), -1)
    ops = [_Op("sdpa", "attn", (q, *repeated), out), _Op("softmax", "mlp.gate", (router,), router)]
    layer = torch.nn.Module()
    layer.attn = torch.nn.Module()
    parts, why = own_call(layer, 0, ops, 1)
    assert parts is not None, why
    assert parts["kv_heads"] == 2 and torch.equal(parts["key"], k) and torch.equal(parts["value"], v)
