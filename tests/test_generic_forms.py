"""Description forms of the automatic description checked on small hand-built modules: a norm whose ``eps`` is not
an attribute (measured on the module, :mod:`lensadapters.adapters.generic.eps`); an MLP activation called in the
module's code and named nowhere; a fused q/k/v projection laid out per head; named refusals."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

from lensadapters import HookedModel
from lensadapters.adapters.generic import describe, findings
from lensadapters.adapters.generic.describe import fused_qkv_split
from lensadapters.adapters.generic.norms import norm_behaviour
from lensadapters.adapters.generic.verify import check_points
from lensadapters.testing.every_model_type import VOCAB, build, input_ids
from lensadapters.testing.generic_support import wrap_generic


class _HardcodedLayerNorm(nn.Module):
    """OLMo's non-parametric LayerNorm: ``eps`` is a literal of its forward, not an attribute."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self._literal = (eps,)  # a tuple: nothing norm_behaviour reads as an eps attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], None, None, eps=self._literal[0])


class _HardcodedRMSNorm(nn.Module):
    """RMSNorm with a ``(1 + weight)`` scale and a literal ``eps``."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.1)
        self._literal = (eps,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._literal[0]) * (1 + self.weight)


@pytest.mark.parametrize(
    "module, kind, eps, offset",
    [
        (_HardcodedLayerNorm(1e-5), "LN", 1e-5, 0.0),
        (_HardcodedLayerNorm(1e-12), "LN", 1e-12, 0.0),
        (_HardcodedRMSNorm(16, 1e-6), "RMS", 1e-6, 1.0),
        (_HardcodedRMSNorm(16, 3e-2), "RMS", 3e-2, 1.0),
    ],
)
def test_an_eps_the_module_does_not_keep_is_measured_on_it(module: nn.Module, kind: str, eps: float, offset: float):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    behaviour = norm_behaviour(module, x, module(x))
    assert behaviour is not None and (behaviour.kind, behaviour.eps, behaviour.offset) == (kind, eps, offset)
    spec = behaviour.spec(module)
    assert spec is not None and spec.eps == eps and spec.weight_offset == offset


@pytest.mark.parametrize(
    "eps, why",
    [(1.2345e-5, "not a round number: no exact value to serve"), (0.0, "no eps at all: nothing to measure")],
)
def test_an_eps_that_cannot_be_pinned_down_serves_no_scale(eps: float, why: str) -> None:
    """A LayerNorm is still recognised (its output is served), but no eps is claimed: the scale is not served."""
    module = _HardcodedLayerNorm(eps)
    x = torch.randn(2, 5, 16)
    behaviour = norm_behaviour(module, x, module(x))
    assert behaviour is not None and behaviour.kind == "LN" and behaviour.eps is None, why


def test_a_module_whose_eps_is_no_constant_gets_none() -> None:
    """A deliberately wrong claim caught: a LayerNorm whose "eps" grows with its input's mean square matches a
    LayerNorm with eps 1e-5 on the probe's input, but no constant eps gives its outputs on small inputs, so none is
    claimed (and its scale is not served)."""

    class Relative(_HardcodedLayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, x.shape[-1:], None, None, eps=1e-5 * float(x.pow(2).mean()))

    module = Relative(1e-5)
    x = torch.randn(2, 5, 16)
    behaviour = norm_behaviour(module, x, module(x))
    assert behaviour is not None and behaviour.kind == "LN" and behaviour.eps is None


class _CodedActivationMLP(nn.Module):
    """A gated MLP whose activation is a call in its forward (no ``act_fn`` attribute, none named by the config)."""

    def __init__(self, mlp: nn.Module, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._act = (act,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act[0](self.gate_proj(x)) * self.up_proj(x))


def _with_coded_activation(act: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    model = build("llama")
    model.config.hidden_act = "relu"  # a wrong name: the probe must not believe it
    for layer in model.model.layers:
        layer.mlp = _CodedActivationMLP(layer.mlp, act)
    return model


@pytest.mark.parametrize(
    "act, name", [(F.silu, "silu"), (lambda t: F.gelu(t, approximate="tanh"), None), (torch.tanh, None)]
)
def test_an_activation_the_mlp_calls_in_its_code_is_found_among_the_common_ones(act, name) -> None:
    """SiLU called in the MLP's code (the config naming ReLU, wrongly) is found and the MLP points are served,
    verified against plain hooks at wrap time (value and edit); an activation that is none of the common ones (tanh;
    GELU, whose exact and tanh forms cannot be told apart on the probe) leaves the MLP undescribed, saying why, and
    serves no MLP point."""
    model = _with_coded_activation(act)
    hm = wrap_generic(model)
    found = findings(model)
    if name is None:
        assert "blocks.0.mlp.hook_post" not in hm.hook_names
        assert any("no activation" in why for why in found.missing.values()), found.missing
    else:
        assert found.description is not None and found.description.layers[0].act_fn == name
        names = [f"blocks.{i}.mlp.{p}" for i in (0, 1) for p in ("hook_pre", "hook_pre_linear", "hook_post")]
        assert all(n in hm.hook_names for n in names) and not found.unverified
        assert all(why is None for why in check_points(hm.wiring, input_ids(), names).values())
    hm.unwrap()


@pytest.mark.parametrize("model_type", ["modernbert-decoder", "megatron-bert"])
def test_a_final_norm_followed_by_a_prediction_head_is_served_and_final_at_w_u_is_refused_by_name(
    model_type: str,
) -> None:
    """Regression (``ln_final`` was not served, and ``final @ W_U`` was taken as the logits with no final norm):
    ModernBERT's decoder and Megatron-BERT normalize the last layer's output, then run a dense layer, an activation
    and another norm before the unembedding. ``ln_final`` is that norm, its points verified like any point (value
    and edit); ``W_U``, ``hm.unembed`` and the decompositions by ``W_U`` (``logit_attrs``) are refused by name, since
    ``final @ W_U`` is not the logits."""
    from lensadapters.errors import WeightUnavailableError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type)
        hm = HookedModel.wrap(model, adapter="generic")
    assert {"ln_final.hook_scale", "ln_final.hook_normalized"} <= set(hm.hook_names)
    assert "ln_final.hook_normalized" not in findings(model).missing
    names = ["ln_final.hook_scale", "ln_final.hook_normalized"]
    assert check_points(hm.wiring, input_ids(), names) == dict.fromkeys(names)
    _, cache = hm.run_with_cache(input_ids())
    final = cache["ln_final.hook_normalized"]
    last = cache[f"blocks.{hm.cfg.n_layers - 1}.hook_resid_post"]
    assert torch.equal(final, hm.norm_module("ln_final")(last))  # a LayerNorm's hook_normalized: its output
    stack = cache.accumulated_resid(apply_ln=True)
    for refused in (lambda: hm.W_U, lambda: hm.unembed(final), lambda: cache.logit_attrs(stack, input_ids()[0])):
        with pytest.raises(WeightUnavailableError, match="prediction head"):
            refused()
    hm.unwrap()


def test_a_fused_projection_laid_out_per_head_is_described_and_a_wrong_split_is_caught() -> None:
    """GPT-NeoX (forced onto the generic adapter) fuses q, k and v per head (``[heads, 3, d]``): described with that
    split, its q/k/v points are verified (value and edit against plain hooks on the projection); the contiguous
    ``[q | k | v]`` split, put in on purpose, fails on them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("gpt_neox")
        hm = HookedModel.wrap(model, adapter="generic")
    assert findings(model).description is not None
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v", "blocks.0.attn.hook_rot_q"]
    assert all(n in hm.hook_names for n in names)
    assert all(why is None for why in check_points(hm.wiring, input_ids(), names).values())
    qkv = hm.wiring.qkv_layouts[0]
    heads, d = hm.cfg.n_heads, hm.cfg.d_head
    split, merge = fused_qkv_split(heads, heads, d)
    hm.wiring.qkv_layouts[0] = dataclasses.replace(qkv, split=split, merge=merge)
    try:
        problems = check_points(hm.wiring, input_ids(), names[:3])
    finally:
        hm.wiring.qkv_layouts[0] = qkv
    assert all(why is not None for why in problems.values()), problems
    hm.unwrap()


def test_a_fused_projection_with_q_and_k_norms_is_described_and_a_description_without_them_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Persimmon normalizes the fused projection's queries and keys per head before rotary: described with those
    norms, their points and the rotated queries and keys are verified (value and edit against plain hooks on the
    norm modules and on what attention gets); a description that leaves the norms out, put in on purpose, serves
    no rotated query or key (the wrap-time verification catches them) and says why."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("persimmon")
        hm = HookedModel.wrap(model, adapter="generic")
    qkv = hm.wiring.qkv_layouts[0]
    assert qkv.q_norm is not None and qkv.k_norm is not None
    rotated = ["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k"]
    names = [f"blocks.0.attn.{x}_norm.{p}" for x in "qk" for p in ("hook_scale", "hook_normalized")] + rotated
    assert all(n in hm.hook_names for n in names)
    assert all(why is None for why in check_points(hm.wiring, input_ids(), names).values())
    hm.unwrap()
    without_norms = functools.partial(describe.FusedQKV, q_norm=None, k_norm=None)
    monkeypatch.setattr(describe, "FusedQKV", lambda *a, q_norm=None, k_norm=None, **kw: without_norms(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model, adapter="generic")
    found = findings(model)
    assert hm.wiring.qkv_layouts[0].q_norm is None
    assert not any(n in hm.hook_names for n in rotated)
    reasons = " ".join(found.missing.values())
    for x in ("query", "key"):
        assert f"hook_rot_{x[0]}: its value is not the reference's (attn of the attention function's {x})" in reasons
    hm.unwrap()


@pytest.mark.skipif(
    transformers.__version__.startswith("4."), reason="transformers 4.x's Moshi computes attention in its own code"
)
def test_a_rotary_module_inside_each_attention_module_is_described_and_a_wrong_angle_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moshi's attention modules each hold a rotary module, called after the projections: the core computes the
    angles from the attention module's inputs before them, and the rotated queries and keys are verified (value and
    edit against what attention gets); the same description one position off, put in on purpose, serves no rotated
    query or key and says why."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("moshi")
        hm = HookedModel.wrap(model, adapter="generic")
    rotated = ["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", "blocks.1.attn.hook_rot_k"]
    assert all(n in hm.hook_names for n in rotated)
    assert all(why is None for why in check_points(hm.wiring, input_ids(), rotated).values())
    hm.unwrap()
    inside = describe._rotary_inside_attention

    def one_off(*args: object) -> object:
        path, from_inputs, cos_sin = inside(*args)  # type: ignore[misc]
        return path, lambda m, a, kw: from_inputs(m, a, {**kw, "position_ids": kw["position_ids"] + 1}), cos_sin

    monkeypatch.setattr(describe, "_rotary_inside_attention", one_off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model, adapter="generic")
    assert not any(n in hm.hook_names for n in rotated)
    reasons = " ".join(findings(model).missing.values())
    for x in ("query", "key"):
        assert f"hook_rot_{x[0]}: its value is not the reference's (attn of the attention function's {x})" in reasons


def _flattening_model() -> nn.Module:
    """Llama 4's text model: its mixture of experts returns ``(out, router_logits)`` with ``out`` as ``[b * p, d]``,
    which the decoder layer views as ``[b, p, d]`` before adding it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build("llama4_text")


def test_a_branch_returning_merged_tokens_in_a_tuple_is_served_in_the_residual_shape() -> None:
    """``hook_mlp_out`` of an MLP returning ``([b * p, d], aux)`` is ``[b, p, d]``; on a batch of two, reading it
    gives the module's output viewed as the layer views it, and an edit through it gives the logits of the same edit
    by a plain PyTorch hook on the module (the merged tensor changed in place of the token it belongs to)."""
    model = _flattening_model()
    hm = wrap_generic(model)
    names = [f"blocks.{i}.{p}" for i in range(len(hm.block_modules)) for p in ("hook_attn_out", "hook_mlp_out")]
    assert all(n in hm.hook_names for n in names)
    assert all(why is None for why in check_points(hm.wiring, input_ids(), names).values())
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    delta = torch.zeros(2, 5, model.config.hidden_size)
    delta[1, 3] = torch.randn(model.config.hidden_size)
    moe = hm.block_modules[0].feed_forward
    seen: list[torch.Tensor] = []

    def plain(module: nn.Module, args: tuple, output: tuple) -> tuple:
        seen.append(output[0].detach().clone())
        return (output[0] + delta.reshape(output[0].shape), *output[1:])

    handle = moe.register_forward_hook(plain)
    try:
        expected = model(input_ids=ids).logits
    finally:
        handle.remove()
    read: list[torch.Tensor] = []

    def edit(value: torch.Tensor, hook) -> torch.Tensor:
        read.append(value.detach().clone())
        return value + delta

    logits = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_mlp_out", edit)])
    assert read[0].shape == (2, 5, model.config.hidden_size)
    assert torch.equal(read[0], seen[0].view(2, 5, -1))
    torch.testing.assert_close(logits, expected)
    hm.unwrap()


def test_a_merged_branch_the_layer_adds_in_another_token_order_is_not_served() -> None:
    """A deliberately wrong layout caught: a layer that adds its MLP's merged output with the tokens reversed is not
    its input plus the MLP's output in the layer's shape, so neither branch point is served there (and the reason
    says why)."""
    model = _flattening_model()
    layer = model.model.layers[0]

    def reversed_forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attention, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden_states),
            position_embeddings=kwargs["position_embeddings"],
            attention_mask=kwargs.get("attention_mask"),
        )
        mid = hidden_states + attention
        out, _ = layer.feed_forward(layer.post_attention_layernorm(mid))
        return mid + out.view(mid.shape).flip(1)

    layer.forward = reversed_forward
    hm = wrap_generic(model)
    assert "blocks.0.hook_mlp_out" not in hm.hook_names and "blocks.1.hook_mlp_out" in hm.hook_names
    assert "layers 0)" in findings(model).missing["hook_attn_out and hook_mlp_out"]
    hm.unwrap()


def test_a_layer_norm_of_one_plus_its_weight_is_recognized_with_its_offset() -> None:
    """Regression (Nemotron's ``LayerNorm1P``, ``layer_norm(x, weight + 1, bias)``, was no norm to the automatic
    description, so its layers had no norm points and no description): a LayerNorm whose weight is ``1 + weight``
    is recognized with offset 1, and its spec reproduces the module."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    from lensadapters.hooks.norms import apply_norm

    norm = NemotronLayerNorm1P(8)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
        norm.bias.normal_(generator=torch.Generator().manual_seed(1))
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))
        y = norm(x)
    found = norm_behaviour(norm, x, y)
    assert found is not None and (found.kind, found.offset) == ("LN", 1.0)
    spec = found.spec(norm)
    assert spec is not None and torch.allclose(apply_norm(x, spec), y, atol=1e-6)
    assert norm_behaviour(torch.nn.LayerNorm(8), x, torch.nn.LayerNorm(8)(x)).offset == 0.0  # type: ignore[union-attr]


def test_a_parallel_block_that_normalizes_for_its_mlp_before_its_attention_lists_its_points_in_that_order() -> None:
    """Falcon's new decoder architecture runs ``ln_mlp`` beside ``ln_attn``, before the attention: ``hook_mlp_in``
    and ``ln2``'s points fire before the attention's, and ``hook_names`` says so (the order identity hooks see)."""
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_kv_heads=1,
        new_decoder_architecture=True, parallel_attn=True, bias=False, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    hm = wrap_generic(transformers.AutoModelForCausalLM.from_config(config).eval())
    assert hm.block_layouts[0] is not None and hm.block_layouts[0].ln2_before_attn
    block = [n for n in hm.hook_names if n.startswith("blocks.1.")]
    assert block.index("blocks.1.ln2.hook_normalized") < block.index("blocks.1.attn.hook_q"), block
    fired: list[str] = []

    def note(t: torch.Tensor, hook: Any) -> torch.Tensor:
        fired.append(hook.name)
        return t.clone()

    with torch.no_grad():
        hm.run_with_hooks(input_ids(), fwd_hooks=[(lambda n: True, note)])
    assert fired == hm.hook_names
    hm.unwrap()
