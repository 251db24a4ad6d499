"""Gemma 4 (text) against an independent reference: the forward written out from the Hugging Face modules' live
weights (only the rotary module is called, for its ``(cos, sin)``), on a model with wider full-attention heads,
proportional RoPE, per-layer inputs, random ``layer_scalar`` buffers and a final-logit softcap. Every hook point's
value, and the logits after an edit at every hook point, match the reference with the same edit; plus the
refusals of what the plugin does not describe. Transformers 5.x only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers.models.gemma4", reason="Gemma 4 needs transformers 5.x")
pytestmark = pytest.mark.transformers5_only

from lensadapters_gemma4.reference import N_EXPERTS, Reference, perturb, reference_edit  # noqa: E402
from lensadapters_gemma4.testing import Gemma4Contract, gemma4_config  # noqa: E402

from lensadapters import UnsupportedModelError, WeightUnavailableError  # noqa: E402
from lensadapters.plugin_api import layer_weight  # noqa: E402
from lensadapters.testing import assert_close  # noqa: E402

CONTRACT = Gemma4Contract()


def exact_model(**overrides: Any) -> torch.nn.Module:
    """Per-layer inputs 16 wide: with 4, the per-layer branch's norm of a 4-wide product near zero amplified float32
    rounding so far that the model's own logits moved by up to 6.6e-5 between one and two threads (the tolerances
    here are 2e-5 and 5e-5; at 16 the largest errors against the reference are 1.1e-5 and 1.3e-5 on 1, 2 and 3
    threads)."""
    fields: dict[str, Any] = dict(
        layers=3, global_every=2, head_dim=4, global_head_dim=8, window=3, ple=16, final_cap=3.0, theta=1000.0
    )
    model = CONTRACT.make_model(gemma4_config(**{**fields, **overrides}), 1, "eager")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:  # as checkpoints have them
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=generator))
            if getattr(layer, "enable_moe_block", False):  # the router's scales, initialized to ones
                for scale in (layer.router.scale, layer.router.per_expert_scale):
                    scale.copy_(0.5 + torch.rand(scale.shape, generator=generator))
    return model


IDS = torch.tensor([[5, 9, 17, 3, 30, 11, 8]])


#: the exactness models: 3 layers (sliding, full, full); 4 layers (sliding, full, then a sliding and a full layer
#: reading layers 0's and 1's keys and values, with double-wide MLPs)
MODELS = {
    "own keys and values": {},
    "shared keys and values": dict(layers=4, num_kv_shared_layers=2, use_double_wide_mlp=True),
    "keys as values": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "experts beside the MLP": dict(
        layers=2, enable_moe_block=True, num_experts=N_EXPERTS, top_k_experts=2, moe_intermediate_size=8
    ),
    # gemma4_unified_text (Gemma4UnifiedForCausalLM): no per-layer inputs; layers 2 and 3 read layers 0's and 1's
    # keys and values, and the full layers' values are their keys
    "unified": dict(
        unified=True,
        ple=0,
        layers=4,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
}


@pytest.mark.parametrize("fields", list(MODELS.values()), ids=list(MODELS))
def test_every_point_matches_the_reference(fields):
    model = exact_model(**fields)
    hm = CONTRACT.wrap(model)
    reference = Reference(model)
    with torch.no_grad():
        expected_logits = reference.forward(IDS)
        logits, cache = hm.run_with_cache(IDS, names_filter=lambda n: True)
        hf_logits = model(IDS).logits
    assert hm.cfg.d_head == 4 and hm.cfg.extra["global_head_dim"] == 8
    assert type(model).__name__ == ("Gemma4UnifiedForCausalLM" if fields.get("unified") else "Gemma4ForCausalLM")
    assert set(reference.values) <= set(cache.keys())
    worst = 0.0
    for name, value in reference.values.items():
        got = cache[name]
        finite = torch.isfinite(value)
        assert torch.equal(finite, torch.isfinite(got)), name
        worst = max(worst, (got[finite] - value[finite]).abs().max().item())
        assert_close(got, value, name, atol=2e-5)
    assert_close(logits, expected_logits, "logits", atol=2e-5)
    assert torch.equal(hf_logits, logits)
    for i, layer in enumerate(model.model.layers):  # each layer's weights in its own head size
        attn = layer.self_attn
        own = not attn.is_kv_shared_layer
        kv = attn.k_proj.weight.shape[0] // attn.head_dim if own else 0
        values = (attn.k_proj if attn.v_proj is None else attn.v_proj) if own else None  # k_eq_v: W_V is W_K
        projections = (("W_Q", attn.q_proj, 4), ("_W_K", attn.k_proj if own else None, kv), ("_W_V", values, kv))
        for name, module, heads in projections[: 3 if own else 1]:
            expected = module.weight.T.unflatten(-1, (heads, -1)).permute(1, 0, 2)
            assert torch.equal(layer_weight(hm.wiring, name, i), expected), (name, i)
        if attn.is_kv_shared_layer:
            source = {"sliding_attention": 0, "full_attention": 1}[attn.layer_type]
            with pytest.raises(WeightUnavailableError, match=f"attends with layer {source}'s keys and values"):
                layer_weight(hm.wiring, "_W_K", i)
        assert torch.equal(layer_weight(hm.wiring, "W_O", i), attn.o_proj.weight.T.unflatten(0, (4, -1)))
    # every point but the per-head inputs (copies of hook_resid_pre) is checked; sharing layers have no k/v points
    layers = model.model.layers
    assert set(cache.keys()) - set(reference.values) == {
        f"blocks.{i}.hook_{x}_input"
        for i in range(len(layers))
        # neither in a layer reading another's keys and values, nor where one projection gives both
        for x in ("q" if layers[i].self_attn.is_kv_shared_layer or layers[i].self_attn.v_proj is None else "qkv")
    }
    print(f"largest error against the reference: {worst:.2e}")
    assert worst < 2e-5
    hm.unwrap()


@pytest.mark.parametrize("fields", list(MODELS.values()), ids=list(MODELS))
def test_an_edit_at_every_point_does_what_the_reference_does(fields):
    """Edits of a source layer's key and value points reach the layers that read them (the reference's shared
    keys and values are the edited ones). With the MoE block: every point of the MLP half of each block (the
    attention's are the other models'; the cost of a reference run per point)."""
    model = exact_model(**fields)
    hm = CONTRACT.wrap(model)
    names = hm.hook_names
    if getattr(model.config, "enable_moe_block", False):
        mlp_half = (".mlp.", ".ln2.", ".ln2_post.", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out")
        names = [n for n in names if any(part in n for part in mlp_half)]
    with torch.no_grad():
        base = hm(IDS).logits
        reference = Reference(model)
        reference.forward(IDS)
        for name in names:
            expected = Reference(model, reference_edit(model, name, reference.values)).forward(IDS)
            got = hm.run_with_hooks(IDS, fwd_hooks=[(name, lambda t, hook: perturb(hook.name)(t))])
            # ln1's scale: the q/k/v norms undo it; an expert without rows: nothing to edit
            unused = name.endswith("ln1.hook_scale") or not reference.values.get(name, IDS).numel()
            assert (got - base).abs().max() > 1e-6 or unused, name
            assert_close(got, expected, f"edit of {name}", atol=5e-5)
    hm.unwrap()


@pytest.mark.parametrize("fields", list(MODELS.values()), ids=list(MODELS))
def test_a_run_from_a_residual_reads_what_the_model_computes_from_the_tokens(fields):
    """``start_at_layer`` with ``tokens=``: the logits of the reference's run on those tokens, from every layer (the
    blocks read the per-layer inputs of the tokens, and sharing layers the keys and values of their source layers);
    an edit of a per-layer input is used in such a run. Without the tokens it is refused, naming them (without
    per-layer inputs: naming the layer whose keys and values a later layer reads)."""
    model = exact_model(**fields)
    hm = CONTRACT.wrap(model)
    n = model.config.num_hidden_layers
    ple = getattr(model.config, "hidden_size_per_layer_input", 0)
    reference = Reference(model)
    with torch.no_grad():
        expected = reference.forward(IDS)
        for start in range(n + 1):
            residual = reference.values[
                f"blocks.{start}.hook_resid_pre" if start < n else f"blocks.{n - 1}.hook_resid_post"
            ]
            assert_close(hm(residual, start_at_layer=start, tokens=IDS), expected, f"from layer {start}", atol=2e-5)
            if start == n or (not ple and start == 0):  # the residual is all the rest reads
                assert_close(hm(residual, start_at_layer=start), expected, f"from layer {start} alone", atol=2e-5)
                continue
            if not ple:  # a later layer reads the keys and values of one before the start
                with pytest.raises(ValueError, match=r"attends with the keys and values of block \d.*tokens="):
                    hm(residual, start_at_layer=start)
                continue
            with pytest.raises(ValueError, match=r"blocks\.L\.hook_per_layer_input.*tokens="):
                hm(residual, start_at_layer=start)
            name = f"blocks.{start}.hook_per_layer_input"
            edited = Reference(model, {name: perturb(name)}).forward(IDS)
            with hm.hooks([(name, lambda t, hook: perturb(hook.name)(t))]):
                got = hm(residual, start_at_layer=start, tokens=IDS)
            assert_close(got, edited, f"edit of {name} from layer {start}", atol=5e-5)
    hm.unwrap()


def test_a_run_from_after_a_key_value_source_layer_names_it():
    """Layers 2 and 3 attend with layers 0's and 1's keys and values: from layer 1 on, the refusal names them too
    (the run with ``tokens=`` is the reference's: above). Without per-layer inputs transformers itself cannot run
    such a model (``_maybe_slice_kv_shared_inputs`` slices the absent per-layer inputs)."""
    model = exact_model(**MODELS["shared keys and values"])
    hm = CONTRACT.wrap(model)
    residual = torch.zeros(1, IDS.shape[1], model.config.hidden_size)
    for start, named in ((1, "block 2 attends with the keys and values of block 0"), (3, "block 3 .* block 1")):
        with pytest.raises(ValueError, match=f"{named}.*tokens="):
            hm(residual, start_at_layer=start)
    with pytest.raises(ValueError) as info:
        hm(residual, start_at_layer=0)
    assert "attends" not in str(info.value)
    with pytest.raises(ValueError, match=r"\[batch, pos\] = \[1, 7\]"):
        hm(residual, start_at_layer=1, tokens=IDS[:, :3])
    hm.unwrap()


def test_patching_a_token_restores_the_clean_run_only_with_its_per_layer_inputs():
    """The per-layer inputs are computed from the token ids beside the residual stream: patching the residual of a
    corrupted token leaves them corrupted (as the model computes), patching them too gives the clean run."""
    model = exact_model()
    hm = CONTRACT.wrap(model)
    corrupted = IDS.clone()
    corrupted[0, 2] = 40
    n = model.config.num_hidden_layers
    with torch.no_grad():
        clean, cache = hm.run_with_cache(IDS)
        dirty = hm(corrupted).logits

        def patch(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, 2] = cache[hook.name][:, 2]
            return t

        residual_only = hm.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.hook_resid_pre", patch)])
        side = [(f"blocks.{i}.hook_per_layer_input", patch) for i in range(n)]
        both = hm.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.hook_resid_pre", patch), *side])
    assert (residual_only - clean).abs().max() > 1e-3 and (dirty - clean).abs().max() > 1e-3
    assert_close(both, clean, "residual and per-layer inputs patched", atol=1e-5)
    assert hm.layout.side_inputs == ("hook_per_layer_input",)
    hm.unwrap()


def test_wrapping_is_exact_without_per_layer_inputs():
    model = exact_model(ple=0)
    hm = CONTRACT.wrap(model)
    assert not [n for n in hm.hook_names if "per_layer" in n]
    with torch.no_grad():
        _, cache = hm.run_with_cache(IDS, names_filter=lambda n: True)
        reference = Reference(model)
        reference.forward(IDS)
    for name, value in reference.values.items():
        assert_close(cache[name], value, name, atol=2e-5)
    hm.unwrap()


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    ],
)
def test_what_is_not_described_is_refused(fields, match):
    layers = fields.pop("layers", 2)
    config = gemma4_config(layers=layers, global_every=2)
    for key, value in fields.items():
        setattr(config, key, value)
    from transformers import Gemma4ForCausalLM

    with pytest.raises(UnsupportedModelError, match=match):
        CONTRACT.wrap(Gemma4ForCausalLM(config))


def test_multimodal_model_without_a_vision_tower_reads_as_its_text_model():
    """A ``Gemma4ForConditionalGeneration`` without a vision tower (what ``AutoModelForCausalLM`` builds from a Gemma 4
    config without ``vision_config``) is its language model: the same points as a ``Gemma4ForCausalLM`` with the
    same weights, reading the same values. (With a vision tower: ``tests/test_vlm.py``.)"""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    config = Gemma4Config(text_config=gemma4_config().to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    text = Gemma4ForCausalLM(model.config.get_text_config()).eval()
    text.model.load_state_dict(model.get_decoder().state_dict())
    text.lm_head.load_state_dict(model.lm_head.state_dict())
    hm, hm_text = CONTRACT.wrap(model), CONTRACT.wrap(text)
    assert hm.hook_names == hm_text.hook_names
    with torch.no_grad():
        logits, cache = hm.run_with_cache(IDS)
        logits_text, cache_text = hm_text.run_with_cache(IDS)
    assert_close(logits, logits_text, "logits")
    for key in cache_text.keys():
        assert_close(cache[key], cache_text[key], key)
    hm.unwrap(), hm_text.unwrap()


MOE = MODELS["experts beside the MLP"]
#: points of a layer's experts branch, one per step of the routing and the experts (each a gradient check: the
#: gate, post and result points of an expert and mlp.hook_moe_out are linear steps like hook_pre and hook_dense_out)
MOE_POINTS = (
    "hook_mlp_in",
    "mlp.hook_dense_out",
    "mlp.hook_router_logits",
    "mlp.hook_expert_weights",
    "mlp.hook_routing_weights",
    "mlp.experts.{e}.hook_pre",
)


def check_gradient_through(model: torch.nn.Module, name: str, shape: torch.Size) -> None:
    """``t + delta`` at ``name``: the logits and the gradient of their squares with respect to ``delta`` are the
    reference's through the same edit."""
    hm = CONTRACT.wrap(model)
    delta = (0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(3))).requires_grad_()
    got = hm.run_with_hooks(IDS, fwd_hooks=[(name, lambda t, hook: t + delta)])
    (grad,) = torch.autograd.grad(got.square().sum(), delta)
    expected = Reference(model, {name: lambda t: t + delta}).forward(IDS)
    assert_close(got, expected, f"edit of {name}", atol=5e-5)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), delta)
    assert grad.abs().max() > 0, name
    assert_close(grad, expected_grad, f"gradient through {name}", atol=1e-4)
    hm.unwrap()


@pytest.mark.parametrize("point", MOE_POINTS)
def test_gradients_through_an_edit_of_an_experts_point_are_the_reference_s(point):
    """``t + delta`` at a point of layer 0's experts branch (routing re-selected after an edit of the
    probabilities, the per-expert scale on the selected weights, the experts on their own pre-norm)."""
    model = exact_model(**MOE)
    hm = CONTRACT.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(IDS, names_filter=lambda n: n.startswith("blocks.0.mlp."))
    hm.unwrap()
    used = cache["blocks.0.mlp.hook_expert_indices"][0, -1, 0].item()  # an expert the last token uses
    name = "blocks.0." + point.format(e=used)
    shape = cache[name].shape if name in cache else cache["blocks.0.mlp.hook_dense_out"].shape
    check_gradient_through(model, name, shape)


#: a unified model's points along the path of an edit: a source layer's keys-as-values (read by layer 3 too), the
#: residual stream, a sharing layer's queries, the double-wide MLP of a sharing layer, a norm's scale
UNIFIED_POINTS = (
    "blocks.1.attn.hook_v",
    "blocks.0.hook_resid_mid",
    "blocks.3.attn.hook_rot_q",
    "blocks.2.mlp.hook_post",
    "blocks.1.ln2_post.hook_scale",
)


@pytest.mark.parametrize("name", UNIFIED_POINTS)
def test_gradients_through_an_edit_of_a_unified_model_s_point_are_the_reference_s(name):
    model = exact_model(**MODELS["unified"])
    reference = Reference(model)
    with torch.no_grad():
        reference.forward(IDS)
    check_gradient_through(model, name, reference.values[name].shape)


def test_experts_weights_are_the_live_parameters():
    """``W_in``/``W_gate``/``W_out`` per expert, ``W_router`` (the router's ``proj``, which reads the router's own
    normalized and scaled input), the dense MLP beside the experts through ``mlp_weights(..., dense=True)``."""
    from lensadapters.moe import router_weight
    from lensadapters.weights import mlp_weights

    model = exact_model(**MOE)
    hm = CONTRACT.wrap(model)
    m = model.config.moe_intermediate_size
    assert (hm.cfg.num_experts, hm.cfg.experts_per_token, hm.cfg.d_mlp) == (N_EXPERTS, 2, m)
    for i, layer in enumerate(model.model.layers):
        experts = layer.experts
        assert torch.equal(hm.W_gate[i], experts.gate_up_proj[:, :m].transpose(1, 2))
        assert torch.equal(hm.W_in[i], experts.gate_up_proj[:, m:].transpose(1, 2))
        assert torch.equal(hm.W_out[i], experts.down_proj.transpose(1, 2))
        assert torch.equal(router_weight(hm.wiring, i), layer.router.proj.weight.T)
        assert torch.equal(hm.W_router[i], layer.router.proj.weight.T)
        for role, linear in (("in", "up_proj"), ("gate", "gate_proj"), ("out", "down_proj")):
            W, _ = mlp_weights(hm.wiring, i, role, dense=True)
            assert torch.equal(W, getattr(layer.mlp, linear).weight.T), (i, role)
    with pytest.raises(WeightUnavailableError, match="no dense MLP beside experts"):
        mlp_weights(CONTRACT.wrap(exact_model()).wiring, 0, "in", dense=True)
    hm.unwrap()
