"""Llama 4 text's attention through the automatic description: rotary as complex multiplication on interleaved pairs
(a complex table read as ``(cos, sin)``), a parameter-free norm after rotary (one module called on the rotated
queries, then on the rotated keys: ``hook_rot_q``/``hook_rot_k`` are its inputs), and layers without rotary (NoPE,
with attention temperature tuning). Edits through the points are compared with the same edits by plain PyTorch
hooks, and deliberately wrong descriptions are caught by the verifier."""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from lensadapters.adapters.generic import describe, findings
from lensadapters.adapters.generic.describe import interleaved_spec
from lensadapters.adapters.generic.rotated_norm import ROTATED_NORMS
from lensadapters.adapters.generic.verify import check_points
from lensadapters.hooks.rotary import half_table_rotate_half_spec
from lensadapters.testing.every_model_type import build, input_ids, shrink_config
from lensadapters.testing.generic_support import built_and_wrapped, sample_ids, wrap_generic

ROTARY = ("attn.hook_rot_q", "attn.hook_rot_k")


@pytest.fixture(scope="module")
def llama4() -> Iterator[tuple[nn.Module, Any]]:
    yield from built_and_wrapped("llama4_text")


def test_interleaved_pairs_from_a_complex_table_are_complex_multiplication() -> None:
    """``interleaved_spec(r, False, once=True)`` on ``(real, imag)`` of ``e^{i theta}`` rotates as Llama 4's
    ``apply_rotary_emb`` does (each pair of neighbours seen as a complex number, times the table), and ``invert``
    undoes it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g)
    table = torch.polar(torch.ones(2, 5, 4), torch.randn(2, 5, 4, generator=g))
    spec = interleaved_spec(8, False, once=True)
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, 4, 2)) * table[:, :, None, :]).flatten(3)
    rotated = spec.apply(x, table.real, table.imag)
    torch.testing.assert_close(rotated, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(spec.invert(rotated, table.real, table.imag), x, rtol=1e-5, atol=1e-5)
    wrong = half_table_rotate_half_spec(8).apply(x, table.real, table.imag)  # the same table, pairs of halves
    assert not torch.allclose(wrong, expected, atol=1e-3)


def test_llama4_rotary_layers_rotate_then_normalize_and_nope_layers_do_not(llama4: tuple[nn.Module, Any]) -> None:
    """The rotary layers are described with interleaved pairs and the q/k norm after rotary (its first call reads
    the queries, its second the keys); the NoPE layer has no rotary points, and every served point verifies."""
    model, hm = llama4
    nope = [i for i, rope in enumerate(model.config.no_rope_layers) if not rope]
    assert nope and len(nope) < model.config.num_hidden_layers
    layers = findings(model).description.layers
    for i, layer in enumerate(layers):
        served = [f"blocks.{i}.{p}" in hm.hook_names for p in ROTARY]
        assert served == [i not in nope] * 2
        norms = {role: (n.module, n.call) for role, n in layer.rotated_norms.items()}
        assert norms == ({} if i in nope else {"q": ("self_attn.qk_norm", 0), "k": ("self_attn.qk_norm", 1)})
    # every served point verified at wrap time (the MoE's per-expert points, which have no independent reference,
    # are unverified and so not served); again here, the new forms:
    unverified = findings(model).unverified
    assert not {name: why for name, why in unverified.items() if ".mlp." not in name}
    assert not set(unverified) & set(hm.hook_names)
    names = [f"blocks.0.{p}" for p in ROTARY] + [f"blocks.{nope[0]}.attn.hook_{x}" for x in "qk"]
    assert all(why is None for why in check_points(hm.wiring, input_ids(), names).values())


def test_an_edit_of_the_rotated_keys_is_the_same_edit_of_the_norms_second_input(llama4: tuple[nn.Module, Any]) -> None:
    """``hook_rot_q`` reads the q/k norm's first input and ``hook_rot_k`` its second (the rotated keys); an edit of
    ``hook_rot_k`` gives the logits of the same edit made by a plain PyTorch pre-hook on the norm's second call, on a
    batch of two."""
    model, hm = llama4
    ids = sample_ids(model)
    norm = hm.block_modules[1].self_attn.qk_norm
    inputs: list[torch.Tensor] = []
    delta = torch.randn(2, 7, model.config.num_key_value_heads, 16, generator=torch.Generator().manual_seed(4))

    def plain(module: nn.Module, args: tuple) -> Any:
        inputs.append(args[0].detach().clone())
        return (args[0] + delta,) if len(inputs) == 2 else None

    handle = norm.register_forward_pre_hook(plain)
    try:
        expected = model(input_ids=ids).logits
    finally:
        handle.remove()
    read: dict[str, torch.Tensor] = {}

    def record(value: torch.Tensor, hook: Any) -> None:
        read[hook.name] = value.detach().clone()

    def edit(value: torch.Tensor, hook: Any) -> torch.Tensor:
        return value + delta

    names = [f"blocks.1.{p}" for p in ROTARY]
    logits = hm.run_with_hooks(ids, fwd_hooks=[(n, record) for n in names] + [(names[1], edit)])
    torch.testing.assert_close(read[names[0]], inputs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(read[names[1]], inputs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, model(input_ids=ids).logits, atol=1e-3)  # the edit moved them


def test_the_verifier_catches_the_norms_calls_swapped(llama4: tuple[nn.Module, Any]) -> None:
    """A description that reads the queries at the q/k norm's second call and the keys at its first fails on both
    rotary points (the point and its reference differ in heads: a verdict, so neither is served), and passes again
    once restored."""
    model, hm = llama4
    wiring, names = hm.wiring, [f"blocks.0.{p}" for p in ROTARY]
    norms = ROTATED_NORMS[model][0]
    ROTATED_NORMS[model][0] = {"q": norms["k"], "k": norms["q"]}
    try:
        swapped = check_points(wiring, input_ids(), names)
    finally:
        ROTATED_NORMS[model][0] = norms
    assert all(why is not None for why in swapped.values()), swapped  # not served (4 query heads, 2 key heads)
    assert all(why is None for why in check_points(wiring, input_ids(), names).values())


def test_a_temperature_the_probe_sees_leaves_the_nope_layer_undescribed() -> None:
    """Llama 4 scales a NoPE layer's queries by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` before
    attention: with the default ``floor_scale`` (8192) the probe's positions get a factor of exactly 1 and ``hook_q``
    is the projection's output, which the model then scales; with ``floor_scale=2`` the probe sees queries that are
    no projection's output, and the layer is not described (its reason given), nor the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = shrink_config(AutoConfig.for_model("llama4_text"))
    config.floor_scale = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    found = findings(model)
    assert found.description is None
    nope = [i for i, rope in enumerate(config.no_rope_layers) if not rope]
    reason = " ".join(found.missing.values())
    assert "no projection of the attention input gives the queries" in reason
    assert f"(layers {', '.join(map(str, nope))})" in reason


def test_a_wrong_rotation_is_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrap-time: a description that pairs the halves of each head instead of neighbours (the same complex table)
    leaves the rotary points out, with the verifier's reason, and serves the rest."""
    real, specs = describe._match_rotated, {}

    def wrong(*args: Any) -> Any:
        found = real(*args)
        if found is None or found[2] is None:
            return found
        spec = specs.setdefault(found[2].rotary_dim, half_table_rotate_half_spec(found[2].rotary_dim))
        return (*found[:2], spec, *found[3:])  # one spec for queries and keys, as the description's

    monkeypatch.setattr(describe, "_match_rotated", wrong)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("llama4_text")
    hm = wrap_generic(model)
    assert not any(n.endswith(ROTARY) for n in hm.hook_names)
    assert "blocks.0.attn.hook_q" in hm.hook_names and "blocks.0.attn.hook_k" in hm.hook_names
    reasons = " ".join(findings(model).missing.values())
    assert "attn.hook_rot_q" in reasons and "its value is not the reference's (in of Llama4TextL2Norm)" in reasons
    hm.unwrap()


def test_a_rotated_query_edit_under_gradient_checkpointing_gives_the_gradients_without_it(
    llama4: tuple[nn.Module, Any],
) -> None:
    """The recomputation of a checkpointed layer finds the layer's angles again in the complex table the model
    passes its attention module (the core reads it as ``(real, imag)``): an edit of ``hook_rot_q`` gives the
    gradients it gives without checkpointing (where it raised that the rotary module had not run)."""
    reference, plain = llama4
    edit = [("blocks.0.attn.hook_rot_q", lambda t, hook: t * 1.5)]
    try:
        plain.run_with_hooks(input_ids(), fwd_hooks=edit).float().pow(2).mean().backward()
        expected = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    finally:
        reference.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("llama4_text")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing runs in training mode only (the model has no dropout)
        hm = wrap_generic(model)
        hm.run_with_hooks(input_ids(), fwd_hooks=edit).float().pow(2).mean().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert expected and expected.keys() == got.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    hm.unwrap()


def test_a_rotation_turning_the_other_way_before_a_norm_per_projection_is_described() -> None:
    """NanoChat rotates with ``rotate_half`` as ``cat(x2, -x1)`` (rotate-half with ``sin`` negated), then normalizes
    queries and keys with a module each, after the attention module's transpose: ``hook_rot_q``/``hook_rot_k`` are
    those norms' inputs, verified."""
    pytest.importorskip("transformers.models.nanochat")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("nanochat")
    hm = wrap_generic(model)
    layer = findings(model).description.layers[0]
    assert {role: (n.module, n.layout, n.call) for role, n in layer.rotated_norms.items()} == {
        "q": ("self_attn.q_norm", "bhpd", 0),
        "k": ("self_attn.k_norm", "bhpd", 0),
    }
    names = [f"blocks.0.{p}" for p in ROTARY]
    assert all(why is None for why in check_points(hm.wiring, input_ids(), names).values())
    hm.unwrap()
