"""Qwen3-Next (transformers 4.57 and 5): the contract suite over tiny hybrid configs, then the family's own checks."""

from __future__ import annotations

import pytest
from lensadapters_qwen3_next.testing import Qwen3NextContract


class TestQwen3Next(Qwen3NextContract):
    """The plugin's contract suite (``lensadapters_qwen3_next.testing``, also run by ``lensadapters check
    qwen3_next``)."""


# The properties Qwen3NextContract.not_served refuses (named, with why) are skipped there, here and in every variant.


# --- the family's own checks ------------------------------------------------------------------------------------

import lensadapters_qwen3_next  # noqa: E402
import torch  # noqa: E402
from lensadapters_qwen3_next.reference import deltanet_reference, refuse, unfuse  # noqa: E402
from lensadapters_qwen3_next.testing import qwen3_next_config  # noqa: E402

from lensadapters.plugin_api import GATED_DELTANET_POINTS  # noqa: E402
from lensadapters.testing import assert_close  # noqa: E402
from lensadapters.testing.families import left_padded_tokens  # noqa: E402

CONTRACT = TestQwen3Next()
MIXER_POINTS = GATED_DELTANET_POINTS
PROJECTION_POINTS = ("hook_qkv", "hook_z", "hook_b", "hook_a")
MOE = [False, True]


def _model(moe: bool = False, **fields):
    return CONTRACT.make_model(qwen3_next_config(moe=moe, **fields), 0)


def _mixer_input(model, layer: int, ids):
    """The linear-attention layer's input and output in the model's own forward (plain PyTorch hooks)."""
    seen = {}
    mixer = model.model.layers[layer].linear_attn
    pre = mixer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(x=kwargs["hidden_states"]), with_kwargs=True
    )
    post = mixer.register_forward_hook(lambda m, args, out: seen.update(out=out))
    with torch.no_grad():
        model(ids)
    pre.remove(), post.remove()
    return seen["x"], seen["out"]


def _noise(name: str, shape, dtype) -> torch.Tensor:
    """A fixed edit direction per point, different at every element (an elementwise-uniform edit would not tell
    a wrong regrouping of the fused projections from the right one)."""
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=generator).to(dtype)


def _edit(name: str, value: torch.Tensor) -> torch.Tensor:
    return value * 1.5 + 0.25 * _noise(name, value.shape, value.dtype)


@pytest.mark.parametrize("heads", [(2, 4), (1, 2), (2, 2)], ids=["gqa2", "one_key_head", "no_gqa"])
def test_unfused_views_are_the_models_own_split(heads):
    """hook_qkv/hook_z/hook_b/hook_a are the fused projections' columns as the model's fix_query_key_value_ordering
    regroups them (and the reference's per-key-head reading agrees with it)."""
    model = _model(linear_heads=heads)
    mixer = model.model.layers[0].linear_attn
    qkvz, ba = torch.randn(2, 3, mixer.in_proj_qkvz.out_features), torch.randn(2, 3, mixer.in_proj_ba.out_features)
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(qkvz, ba)
    flat = [x.reshape(2, 3, -1) for x in (q, k, v)]
    from lensadapters.plugin_api import split_per_key_head

    qkv, z2, b2, a2 = split_per_key_head(mixer, qkvz, ba)
    assert torch.equal(qkv, torch.cat(flat, dim=-1)) and torch.equal(z2, z)
    assert torch.equal(b2, b) and torch.equal(a2, a)
    views = unfuse(mixer, qkvz, ba)
    assert torch.equal(views["hook_qkv"], qkv) and torch.equal(views["hook_z"], z)
    assert torch.equal(views["hook_b"], b) and torch.equal(views["hook_a"], a)
    back = refuse(mixer, views, torch.zeros_like(qkvz), torch.zeros_like(ba))
    assert torch.equal(back[0], qkvz) and torch.equal(back[1], ba)


@pytest.mark.parametrize("moe", MOE, ids=["dense", "moe"])
@pytest.mark.parametrize("heads", [(2, 4), (1, 2)], ids=["gqa2", "one_key_head"])
def test_deltanet_points_are_the_modules_values(moe, heads):
    """Every linear_attn point equals the independent reference (plain PyTorch on the layer's own input: its own
    reading of the fused layout, its own token-by-token delta rule), and the reference's output is the module's."""
    model = _model(moe, linear_heads=heads)
    hm = CONTRACT.wrap(model)
    ids, _ = left_padded_tokens(pads=(0, 0))
    x, out = _mixer_input(model, 0, ids)
    reference, ref_out = deltanet_reference(model.model.layers[0].linear_attn, x)
    assert_close(ref_out, out, "reference output", atol=1e-5)
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0."))
    for name in MIXER_POINTS:
        value = cache[f"blocks.0.linear_attn.{name}"]
        assert value.shape == reference[name].shape, name
        assert_close(value, reference[name], name, atol=1e-5)
        print(f"VALUE {name}: {(value - reference[name]).abs().max().item():.2e}")
    assert_close(cache["blocks.0.hook_attn_out"], out, "hook_attn_out", atol=0)


@pytest.mark.parametrize("name", MIXER_POINTS)
def test_deltanet_edits_change_downstream_exactly(name):
    """An edit of each linear_attn point gives the logits the reference computes with the same edit, put in the
    model as the layer's output (plain PyTorch hook); gradients reach the edit."""
    model = _model()
    hm = CONTRACT.wrap(model)
    ids, _ = left_padded_tokens(pads=(0, 0))
    x, _ = _mixer_input(model, 0, ids)
    _, edited_out = deltanet_reference(
        model.model.layers[0].linear_attn, x, lambda n, v: _edit(n, v) if n == name else v
    )
    handle = model.model.layers[0].linear_attn.register_forward_hook(lambda m, a, out: edited_out)
    with torch.no_grad():
        expected = model(ids).logits
        handle.remove()
        plain = model(ids).logits
    with torch.no_grad():
        got = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.0.linear_attn.{name}", lambda t, hook: _edit(name, t))])
    assert (got - plain).abs().max() > 1e-4, f"editing {name} changed nothing"
    assert_close(got, expected, f"logits after editing {name}", atol=1e-4)
    print(f"EDIT {name}: {(got - expected).abs().max().item():.2e}")
    assert torch.equal(hm.model(ids).logits.detach(), plain), "the edit left a hook behind"
    scale = torch.ones((), requires_grad=True)
    logits = hm.run_with_hooks(
        ids, fwd_hooks=[(f"blocks.0.linear_attn.{name}", lambda t, hook: t * scale + (scale - 1) * 0.25)]
    )
    (grad,) = torch.autograd.grad(logits.square().sum(), scale)
    assert grad.abs() > 0, f"no gradient through an edit of {name}"


@pytest.mark.parametrize("name", PROJECTION_POINTS)
@pytest.mark.parametrize("heads", [(2, 4), (1, 2), (2, 2)], ids=["gqa2", "one_key_head", "no_gqa"])
def test_projection_view_edits_are_edits_of_the_fused_outputs(name, heads):
    """An edit of a per-role view (hook_qkv/z/b/a) gives exactly the logits of the unhooked model whose fused
    projection outputs carry the same edit where the reference reads that view (plain PyTorch hooks on
    in_proj_qkvz and in_proj_ba; the model's own forward runs on)."""
    model = _model(linear_heads=heads)
    hm = CONTRACT.wrap(model)
    ids, _ = left_padded_tokens(pads=(0, 0))
    mixer, fused = model.model.layers[0].linear_attn, {}

    def record(which):
        return lambda m, a, out: fused.__setitem__(which, out)

    def write_back(m, a, out):  # in_proj_ba runs after in_proj_qkvz: both outputs known here
        views = unfuse(mixer, fused["qkvz"], out)
        views[name] = _edit(name, views[name])
        qkvz, ba = refuse(mixer, views, fused["qkvz"], out)
        fused["edited"] = qkvz
        return ba

    handles = [
        mixer.in_proj_qkvz.register_forward_hook(record("qkvz")),
        mixer.in_proj_qkvz.register_forward_hook(lambda m, a, out: fused.get("edited")),
    ]
    # the qkvz edit needs the view of ba too only for hook_b/hook_a; for the qkvz views it is the first output's
    if name in ("hook_b", "hook_a"):
        handles.append(mixer.in_proj_ba.register_forward_hook(write_back))
    else:
        handles[1].remove()

        def qkvz_edit(m, a, out):
            zeros = torch.zeros(*out.shape[:-1], mixer.in_proj_ba.out_features)
            views = unfuse(mixer, out, zeros)
            views[name] = _edit(name, views[name])
            return refuse(mixer, views, out, zeros)[0]

        handles[1] = mixer.in_proj_qkvz.register_forward_hook(qkvz_edit)
    with torch.no_grad():
        expected = model(ids).logits
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        plain = model(ids).logits
        got = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.0.linear_attn.{name}", lambda t, hook: _edit(name, t))])
    assert (got - plain).abs().max() > 1e-4, f"editing {name} changed nothing"
    assert_close(got, expected, f"logits after editing {name}", atol=1e-5)
    print(f"FUSED-EDIT {name} {heads}: {(got - expected).abs().max().item():.2e}")


def test_attention_gate_is_the_projection_half_and_edits_reach_z():
    """attn.hook_gate is q_proj's gate half of each head; hook_z is (pattern @ v) * sigmoid(gate); an edit of the
    gate changes hook_z and the logits exactly as editing q_proj's output would."""
    model = _model()
    hm = CONTRACT.wrap(model)
    ids, _ = left_padded_tokens(pads=(0, 0))
    layer, attn = 3, model.model.layers[3].self_attn
    seen = {}
    h = attn.q_proj.register_forward_hook(lambda m, a, out: seen.update(x=a[0], q=out))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith(f"blocks.{layer}.attn."))
    h.remove()
    both = seen["q"].unflatten(-1, (hm.cfg.n_heads, 2, hm.cfg.d_head))
    assert torch.equal(cache[f"blocks.{layer}.attn.hook_gate"], both[..., 1, :])
    assert torch.equal(cache[f"blocks.{layer}.attn.hook_q"], both[..., 0, :])
    pattern, v = cache[f"blocks.{layer}.attn.hook_pattern"], cache[f"blocks.{layer}.attn.hook_v"]
    v = v.repeat_interleave(hm.cfg.n_heads // hm.cfg.n_key_value_heads, dim=2)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, v) * torch.sigmoid(both[..., 1, :])
    assert_close(cache[f"blocks.{layer}.attn.hook_z"], z, "hook_z", atol=1e-6)
    print(f"VALUE attn.hook_z: {(cache[f'blocks.{layer}.attn.hook_z'] - z).abs().max().item():.2e}")

    def gate_edit(t, hook=None):
        return t - 1.0

    def proj_edit(m, a, out):
        parts = out.unflatten(-1, (hm.cfg.n_heads, 2, hm.cfg.d_head)).clone()
        parts[..., 1, :] = gate_edit(parts[..., 1, :])
        return parts.flatten(-3)

    handle = attn.q_proj.register_forward_hook(proj_edit)
    with torch.no_grad():
        expected = model(ids).logits
    handle.remove()
    with torch.no_grad():
        got = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_gate", gate_edit)])
    assert_close(got, expected, "logits after a gate edit", atol=0)
    with pytest.raises(lensadapters_qwen3_next.WeightUnavailableError, match="query_weights"):
        _ = hm.W_Q
    W_Q, W_gate, _, _ = lensadapters_qwen3_next.query_weights(hm, layer)  # no bias in these configs
    assert_close(torch.einsum("bpd,hde->bphe", seen["x"], W_Q), both[..., 0, :], "W_Q", atol=1e-5)
    assert_close(torch.einsum("bpd,hde->bphe", seen["x"], W_gate), both[..., 1, :], "W_gate", atol=1e-5)


def test_shared_expert_points():
    """The MoE layers' shared expert: its points are its modules' values, and an edit of its gate's logit acts as
    the same edit of the gate module's output."""
    model = _model(moe=True)
    hm = CONTRACT.wrap(model)
    ids, _ = left_padded_tokens(pads=(0, 0))
    pre = "blocks.0.mlp."
    shared, seen = model.model.layers[0].mlp.shared_expert, {}
    handle = shared.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0."))
    handle.remove()
    x = seen["x"].unflatten(0, ids.shape)  # the block runs its experts on [b * p, d_model]
    assert_close(cache[pre + "shared_expert.hook_gate"], shared.gate_proj(x), "gate", atol=1e-6)
    assert_close(cache[pre + "shared_expert.hook_pre"], shared.up_proj(x), "up", atol=1e-6)
    assert_close(cache[pre + "shared_expert.hook_result"], shared(x), "result", atol=1e-6)
    gate_logit = model.model.layers[0].mlp.shared_expert_gate(x)
    assert_close(cache[pre + "hook_shared_gate"], gate_logit, "shared gate", atol=1e-6)
    with torch.no_grad():
        off = hm.run_with_hooks(ids, fwd_hooks=[(pre + "hook_shared_gate", lambda t, hook: torch.full_like(t, -1e4))])
        handle = model.model.layers[0].mlp.shared_expert_gate.register_forward_hook(
            lambda m, a, o: torch.full_like(o, -1e4)
        )
        expected = model(ids).logits
        handle.remove()
    assert_close(off, expected, "logits with the shared expert gated off", atol=0)


def test_dense_layers_beside_moe_layers():
    """mlp_only_layers makes a layer dense in an MoE model: it gets the dense MLP points, the others the experts'."""
    model = _model(moe=True, layer_types=["linear_attention", "full_attention"], mlp_only_layers=[1])
    hm = CONTRACT.wrap(model)
    assert "blocks.1.mlp.hook_pre" in hm.hook_dict and "blocks.1.mlp.hook_router_logits" not in hm.hook_dict
    assert "blocks.0.mlp.hook_router_logits" in hm.hook_dict and "blocks.0.mlp.hook_shared_gate" in hm.hook_dict
    ids, _ = left_padded_tokens(pads=(0, 0))
    seen = {}
    handle = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, a, out: seen.update(up=out))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids)
    handle.remove()
    assert torch.equal(cache["blocks.1.mlp.hook_pre_linear"], seen["up"])


@pytest.mark.parametrize("moe", MOE, ids=["dense", "moe"])
@pytest.mark.parametrize("point", ["hook_beta", "hook_qkv"])
def test_generation_through_the_hybrid_cache(moe, point):
    """Greedy generation with reading hooks on every point matches generation without hooks, every point firing;
    an edit of a DeltaNet point during generation gives, at each step, the logits of the full forward with that
    edit on the whole sequence (the edited convolution and recurrent states are what the cache carries on)."""
    from lensadapters.testing.contract_support import greedy_kwargs
    from lensadapters.testing.family_checks import generate_with_hooks

    model = _model(moe)
    hm = CONTRACT.wrap(model)
    ids, mask = left_padded_tokens(pads=(0, 0), length=5)
    generate_with_hooks(hm, ids, mask, None, steps=3)
    name = f"blocks.0.linear_attn.{point}"
    fired = []

    def edit(t, hook):
        fired.append(t.shape[1])
        return t * 0.5 + 0.1

    kwargs = greedy_kwargs(3)
    with torch.no_grad(), hm.hooks([(name, edit)]):
        out = hm.model.generate(ids, attention_mask=mask, **kwargs)
    assert fired == [5, 1, 1], fired
    with torch.no_grad():
        full = hm.run_with_hooks(out.sequences[:, :-1], fwd_hooks=[(name, lambda t, hook: t * 0.5 + 0.1)])
    worst = 0.0
    for step, logits in enumerate(out.logits):
        assert_close(logits, full[:, ids.shape[1] - 1 + step], f"step {step} logits with the edit", atol=1e-4)
        worst = max(worst, (logits - full[:, ids.shape[1] - 1 + step]).abs().max().item())
    print(f"GENERATE {point} {'moe' if moe else 'dense'}: {worst:.2e}")
    plain = model.generate(ids, attention_mask=mask, **kwargs)
    assert not all(torch.equal(a, b) for a, b in zip(plain.logits, out.logits)), "the edit changed nothing"


def _recomputing_edit(t, hook):
    """An expert edit that changes no value but makes the core compute the layer's experts itself (on transformers
    4.57, at the MoE module's output)."""
    return t.clone()


@pytest.mark.parametrize("shared", [None, "hook_shared_gate", "shared_expert.hook_result"])
@pytest.mark.parametrize("together", [True, False], ids=["one_call", "expert_hook_first"])
def test_recomputed_moe_layer_keeps_the_gated_shared_expert(shared, together):
    """Where the core computes a MoE layer's experts itself (an edited expert point; on transformers 4.57 at the MoE
    module's output, its experts a ModuleList), the layer's output still holds the shared expert times the sigmoid of
    its gate's logit (MoELayout.shared_gate), with an edit of the shared expert's or the gate's point included: the
    logits are those of the same edit made by plain PyTorch hooks, whether the shared point's hook was added with the
    expert's or after a forward with the expert's alone."""
    model = _model(moe=True, layer_types=["linear_attention", "full_attention"])
    hm = CONTRACT.wrap(model)
    ids, _ = left_padded_tokens(pads=(0, 0))
    moe = model.model.layers[0].mlp
    shared_edits = {
        "hook_shared_gate": (moe.shared_expert_gate, lambda t: t - 1.5),
        "shared_expert.hook_result": (moe.shared_expert, lambda t: t * 2.0 + 0.1),
    }
    expected_hooks = []
    fwd = [(f"blocks.0.mlp.experts.{e}.hook_post", _recomputing_edit) for e in (0, 1)]
    if shared is not None:
        module, edit = shared_edits[shared]
        expected_hooks.append(module.register_forward_hook(lambda m, a, out: edit(out)))
    with torch.no_grad():
        expected = model(ids).logits
    for handle in expected_hooks:
        handle.remove()
    with torch.no_grad():
        if shared is None or together:
            extra = [] if shared is None else [(f"blocks.0.mlp.{shared}", lambda t, hook: shared_edits[shared][1](t))]
            got = hm.run_with_hooks(ids, fwd_hooks=fwd + extra)
        else:
            with hm.hooks(fwd):
                hm(ids)  # the MoE site's hooks are installed before the shared point's
                with hm.hooks([(f"blocks.0.mlp.{shared}", lambda t, hook: shared_edits[shared][1](t))]):
                    got = hm(ids).logits
    worst = (got - expected).abs().max().item()
    print(f"RECOMPUTED MoE {shared}: {worst:.2e}")
    assert_close(got, expected, f"logits with the experts recomputed ({shared})", atol=1e-5)
    if shared is not None:
        with torch.no_grad():
            plain = model(ids).logits
        assert (plain - expected).abs().max() > 1e-3, "the shared edit changed nothing"
