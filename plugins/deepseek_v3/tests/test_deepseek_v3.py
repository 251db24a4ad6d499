"""DeepSeek-V3: the contract suite in its mixture-of-experts form over random tiny DeepSeek-V3 configs, plus the
family's own checks: every hook point's value and the effect of an edit at every hook point against an independent
float64 reference written from the Hugging Face modules' parameters (``lensadapters_deepseek_v3.reference``), the
latent weights, the refusals of what multi-head latent attention cannot make exact."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lensadapters_deepseek_v3
import pytest
import torch
from lensadapters_deepseek_v3.reference import reference_run
from lensadapters_deepseek_v3.testing import DeepseekV3Contract, deepseek_v3_config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from lensadapters.errors import UnsupportedModelError, WeightUnavailableError
from lensadapters.registry import get_registry
from lensadapters.testing.contract_support import perturb
from lensadapters.testing.reference import assert_edits_match, points_against_reference, seeded_tokens

PLUGIN_ROOT = Path(__file__).resolve().parents[1]


class TestDeepseekV3(DeepseekV3Contract):
    """The plugin's contract suite (``lensadapters_deepseek_v3.testing``, also run by ``lensadapters check
    deepseek_v3``)."""


CONTRACT = TestDeepseekV3()


def test_entry_point_is_declared() -> None:
    """The distribution declares the plugin in the ``lensadapters`` entry-point group, and the module registers as
    the ``deepseek_v3`` architecture."""
    if sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
        assert project["name"] == "lensadapters-deepseek-v3"
        assert project["entry-points"]["lensadapters"] == {"deepseek_v3": "lensadapters_deepseek_v3"}
    infos = get_registry().infos
    if "deepseek_v3" in infos:
        assert infos["deepseek_v3"].plugin is lensadapters_deepseek_v3
    assert [a.name for a in lensadapters_deepseek_v3.lensadapters_architectures()] == ["deepseek_v3"]
    assert lensadapters_deepseek_v3.ARCH.model_types == ("deepseek_v3", "deepseek_v2")


CONFIGS = {
    "q latent, interleaved rope, dense first layer": dict(
        n_heads=4, hidden=32, layers=2, dense_layers=1, experts=6, top_k=2, groups=(3, 2)
    ),
    "q_proj, rotate-half rope, raw weights": dict(
        n_heads=2, hidden=16, layers=2, q_lora_rank=None, interleave=False, norm_topk_prob=False, groups=(2, 1)
    ),
    "top-3 of 4 in one group, tied": dict(n_heads=4, hidden=32, layers=1, experts=4, top_k=3, groups=(1, 1), tied=True),
    "V2 group-limited greedy, q latent": dict(
        v2=True, n_heads=2, hidden=16, layers=1, experts=4, top_k=2, groups=(2, 1), scale=2.5
    ),
    "V2 greedy, q_proj, dense first layer, tied": dict(
        v2=True,
        topk_method="greedy",
        n_heads=4,
        hidden=32,
        layers=2,
        dense_layers=1,
        q_lora_rank=None,
        experts=6,
        top_k=3,
        tied=True,
    ),
}
# the edit test is the slow one: two V3 configs and the one-layer V2 one
EDITED = [*list(CONFIGS)[:2], "V2 group-limited greedy, q latent"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_point_matches_the_independent_reference(name: str) -> None:
    """Every hook point the reference names (all but the head-input points and ``hook_attn_in``) holds the float64
    reference's value (``-inf`` where it masks), and the logits are the reference's: the largest error is float32
    rounding."""
    compared, names = points_against_reference(CONTRACT, deepseek_v3_config(**CONFIGS[name]), reference_run)
    assert compared == [n for n in names if not n.endswith("_input") and not n.endswith("hook_attn_in")]


def _edit(name: str, n_experts: int) -> Any:
    if name.endswith("hook_expert_indices"):
        return lambda t, hook: (t + 1) % n_experts
    return perturb


@pytest.mark.parametrize("name", EDITED)
def test_edits_at_every_point_match_the_independent_reference(name: str) -> None:
    """The same edit at any hook point gives the logits the reference gives with that edit at the same place:
    latents, the shared rope key, per-head keys and values, routing (re-selected through the groups and the bias)
    and experts; every edit changes the logits."""
    config = deepseek_v3_config(**CONFIGS[name])
    model = CONTRACT.make_model(config, 1)
    hm = CONTRACT.wrap(model)
    edit = lambda name: _edit(name, config.n_routed_experts)  # noqa: E731
    assert_edits_match(hm, model, seeded_tokens(), reference_run, edit)
    hm.unwrap()


def test_no_hooks_is_bitwise_and_unwrap_gives_the_model_back() -> None:
    """Without hooks the wrapped model's logits are HF's own, bitwise, and so are they after ``unwrap()``."""
    model = CONTRACT.make_model(deepseek_v3_config(**CONFIGS["q latent, interleaved rope, dense first layer"]), 2)
    ids = seeded_tokens()
    with torch.no_grad():
        reference = model(ids).logits
        hm = CONTRACT.wrap(model)
        assert torch.equal(hm(ids).logits, reference)
        hm.run_with_cache(ids)
        assert torch.equal(hm(ids).logits, reference)
        hm.unwrap()
        assert torch.equal(model(ids).logits, reference)


def test_latent_weights_are_the_exact_maps() -> None:
    """``latent_weights`` gives the per-head maps from the latents: ``hook_q == hook_q_latent @ W_Q_latent``,
    ``hook_k``'s no-rope columns and ``hook_v`` from ``hook_kv_latent``, ``hook_k_rope`` from ``ln1``'s output;
    ``W_K``/``W_V`` (and ``W_Q`` with a query latent) are refused by name."""
    model = CONTRACT.make_model(deepseek_v3_config(**CONFIGS["q latent, interleaved rope, dense first layer"]), 3)
    hm = CONTRACT.wrap(model)
    c = model.config
    with torch.no_grad():
        _, cache = hm.run_with_cache(seeded_tokens())
        for layer in range(c.num_hidden_layers):
            a = f"blocks.{layer}.attn."
            w = lensadapters_deepseek_v3.latent_weights(hm, layer)
            ln1 = cache[f"blocks.{layer}.ln1.hook_normalized"] * model.model.layers[layer].input_layernorm.weight
            q = torch.einsum("bpr,hrd->bphd", cache[a + "hook_q_latent"], w["W_Q_latent"])
            torch.testing.assert_close(q, cache[a + "hook_q"])
            k = torch.einsum("bpr,hrd->bphd", cache[a + "hook_kv_latent"], w["W_K_latent"])
            torch.testing.assert_close(k, cache[a + "hook_k"][..., : c.qk_nope_head_dim])
            v = torch.einsum("bpr,hrd->bphd", cache[a + "hook_kv_latent"], w["W_V_latent"])
            torch.testing.assert_close(v, cache[a + "hook_v"])
            torch.testing.assert_close(ln1 @ w["W_K_rope"], cache[a + "hook_k_rope"])
    for name in ("W_Q", "W_K", "W_V"):
        with pytest.raises(WeightUnavailableError, match="latent_weights"):
            getattr(hm, name)
    hm.unwrap()


def test_w_q_without_a_query_latent() -> None:
    """Where ``q_proj`` projects the residual directly, ``W_Q`` is served: ``hook_q == ln1 output @ W_Q``."""
    model = CONTRACT.make_model(deepseek_v3_config(**CONFIGS["q_proj, rotate-half rope, raw weights"]), 4)
    hm = CONTRACT.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(seeded_tokens())
        ln1 = cache["blocks.0.ln1.hook_normalized"] * model.model.layers[0].input_layernorm.weight
        torch.testing.assert_close(torch.einsum("bpm,hmd->bphd", ln1, hm.W_Q[0]), cache["blocks.0.attn.hook_q"])
    hm.unwrap()


@pytest.mark.parametrize("point", ["attn.hook_k", "attn.hook_rot_k"])
def test_one_heads_rope_columns_edit_equals_the_reference(point: str) -> None:
    """An edit of the rope columns of one head's key (one key every head shares in the model) gives the logits the
    float64 reference gives with the same edit of that head's key, and leaves no hook behind."""
    model = CONTRACT.make_model(deepseek_v3_config(n_heads=2, hidden=16, layers=1), 5)
    hm = CONTRACT.wrap(model)
    ids = seeded_tokens()
    nope = model.config.qk_nope_head_dim

    def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[:, :, 1, nope:] = t[:, :, 1, nope:] * 3 - 0.5
        return t

    with torch.no_grad():
        got = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.0.{point}", edit)])
        expected, _ = reference_run(model, ids, {f"blocks.0.{point}": edit})
        plain = model(ids).logits
        assert (expected.float() - plain).abs().max() > 1e-3
        torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-4)
        assert torch.equal(hm(ids).logits, plain)
    hm.unwrap()


def test_other_key_value_heads_are_refused() -> None:
    config = deepseek_v3_config(n_heads=2, hidden=16, layers=1)
    config.num_key_value_heads = 1
    model = CONTRACT.make_model(config, 0)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        CONTRACT.wrap(model)


def _plain_key_gradient(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The gradient of ``logits.sum()`` at the keys ``[b, h, p, d]`` the attention function of layer 0 gets: a plain
    tensor hook there, in an attention function registered in transformers' interface for this call (the model's
    own implementation)."""
    attention = model.model.layers[0].self_attn
    implementation = model.config._attn_implementation
    own = sys.modules[type(attention).__module__]
    original = own.eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
    grads: list[torch.Tensor] = []

    def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if module is attention:
            key.register_hook(grads.append)
        return original(module, query, key, *args, **kwargs)

    AttentionInterface.register("deepseek-test", attend)
    model.config._attn_implementation = "deepseek-test"
    try:
        model(ids).logits.sum().backward()
    finally:
        model.config._attn_implementation = implementation
    return grads[0]


@pytest.mark.parametrize("point", ["attn.hook_k", "attn.hook_rot_k"])
def test_one_heads_key_gradient_is_the_attention_functions(point: str) -> None:
    """A backward hook on ``hook_rot_k`` gets, bit for bit, the gradient a plain tensor hook on the keys the attention
    function gets sees (per head; the model's one rope key is a copy per head there); on ``hook_k``, that gradient
    through rotary: the no-rope columns the same, the rope columns summed over the heads the shared key's gradient
    (``hook_k_rope``'s). No hook is left behind."""
    model = CONTRACT.make_model(deepseek_v3_config(n_heads=2, hidden=16, layers=1), 5)
    hm = CONTRACT.wrap(model)
    ids = seeded_tokens()
    nope = model.config.qk_nope_head_dim
    grads: dict[str, torch.Tensor] = {}
    names = [f"blocks.0.{point}", "blocks.0.attn.hook_k_rope"]
    with hm.hooks(bwd_hooks=[(n, lambda g, hook: grads.setdefault(hook.name, g)) for n in names]):
        hm(ids).logits.sum().backward()
    expected = _plain_key_gradient(model, ids).transpose(1, 2)
    got = grads[names[0]]
    assert expected.abs().max() > 0
    if point.endswith("hook_rot_k"):
        assert torch.equal(got, expected)
    else:
        assert torch.equal(got[..., :nope], expected[..., :nope])
        assert (got[..., nope:] - expected[..., nope:]).abs().max() > 1e-4  # rotary undone
        torch.testing.assert_close(got[..., nope:].sum(-2), grads[names[1]])
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, model(ids).logits)
    hm.unwrap()


def test_deepseek_v2_rotary_keeps_the_pairs_interleaved() -> None:
    """DeepSeek-V2 multiplies the interleaved rope pairs by the model's complex rotations and keeps them interleaved:
    ``hook_rot_q``'s rope columns are ``(q[2i] + i q[2i+1]) * freqs_cis`` pair by pair, from the rotary module's own
    complex output, and the no-rope columns are ``hook_q``'s."""
    config = deepseek_v3_config(**CONFIGS["V2 greedy, q_proj, dense first layer, tied"])
    model = CONTRACT.make_model(config, 6)
    hm = CONTRACT.wrap(model)
    ids = seeded_tokens()
    nope = config.qk_nope_head_dim
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids)
        freqs = model.model.rotary_emb(torch.zeros(1), torch.arange(ids.shape[1])[None])
        assert freqs.is_complex()
        for a in ("blocks.0.attn.hook_q", "blocks.1.attn.hook_q"):  # a dense layer, then a MoE layer
            q, rot = cache[a], cache[a.replace("hook_q", "hook_rot_q")]
            pairs = torch.view_as_complex(q[..., nope:].float().reshape(*q.shape[:-1], -1, 2).contiguous())
            expected = torch.view_as_real(pairs * freqs[:, :, None, :]).flatten(-2)
            torch.testing.assert_close(rot[..., nope:], expected)
            assert torch.equal(rot[..., :nope], q[..., :nope])
    hm.unwrap()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(topk_method="noaux_tc"), "topk_method"),
        (dict(num_experts_per_tok=3), "kept groups"),
    ],
)
def test_deepseek_v2_routers_the_model_cannot_run_are_refused(change: dict, match: str) -> None:
    """A DeepSeek-V2 ``topk_method`` transformers does not implement, and a group-limited top-k larger than the kept
    groups' experts (the model would pick masked experts at weight 0), are refused at wrap time, by name."""
    config = deepseek_v3_config(v2=True, n_heads=2, hidden=16, layers=1, experts=4, top_k=2, groups=(2, 1))
    model = CONTRACT.make_model(config, 0)
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        CONTRACT.wrap(model)


V2_GRADIENT_POINTS = (
    "blocks.0.attn.hook_kv_latent",
    "blocks.0.attn.hook_k_rope",
    "blocks.0.attn.hook_rot_q",
    "blocks.0.attn.hook_v",
    "blocks.0.mlp.hook_router_logits",
    "blocks.0.mlp.hook_routing_weights",
)


def test_deepseek_v2_gradients_through_edits_match_the_reference() -> None:
    """The gradient of the logits with respect to an edit's size at a DeepSeek-V2 point (the latents, the shared
    rope key, the rotated queries, the values, the router) is the float64 reference's, computed by autograd through
    the same edit."""
    config = deepseek_v3_config(**CONFIGS["V2 group-limited greedy, q latent"])
    model = CONTRACT.make_model(config, 7)
    hm = CONTRACT.wrap(model)
    ids = seeded_tokens()
    direction = torch.Generator()

    def edit_by(size: torch.Tensor) -> Any:
        def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:  # the same direction in both runs
            d = torch.randn(t.shape, generator=direction.manual_seed(0), dtype=torch.float64)
            return t + (size * d).to(t.dtype)

        return edit

    for point in V2_GRADIENT_POINTS:
        grads = []
        for run in ("ours", "reference"):
            size = torch.zeros((), dtype=torch.float64, requires_grad=True)
            if run == "ours":
                logits = hm.run_with_hooks(ids, fwd_hooks=[(point, edit_by(size))])
            else:
                logits, _ = reference_run(model, ids, {point: edit_by(size)})
            readout = (logits.double() * torch.linspace(-1, 1, logits.shape[-1])).sum()
            grads.append(torch.autograd.grad(readout, size)[0])
        assert grads[1].abs() > 1e-3, point
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5, msg=point)
    hm.unwrap()
