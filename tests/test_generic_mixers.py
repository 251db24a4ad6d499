"""The generic adapter's mixer form (:mod:`lensadapters.adapters.generic.mixer`): state-space, linear-attention and
recurrent layers, alone (Mamba) or beside attention layers (hybrids), get ``hook_attn_out`` (the token mixer's
output), ``hook_mlp_out`` and their mixer's internal points at module boundaries, each verified at wrap time; a hook
goes through generation with the model's own cache; a point whose module the model skips in a cached step raises."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel, Registry
from lensadapters.adapters.generic import GenericAdapterWarning, findings
from lensadapters.adapters.generic import mixer as mixer_form
from lensadapters.adapters.generic import plugin as generic_plugin
from lensadapters.adapters.generic.references import Reference
from lensadapters.adapters.generic.scan import SCAN_POINTS
from lensadapters.adapters.generic.verify import check_points
from lensadapters.testing.contract_support import check_edited_generation
from lensadapters.testing.every_model_type import NotBuildable, build, input_ids
from lensadapters.testing.strategies import Inputs

#: the layers a hybrid's tiny model needs for a layer of each kind where the census's count may give it one kind only
#: (Jamba's attention every 8 layers from layer 4: transformers 4.x runs its first 4 Mamba layers alone)
HYBRID_LAYERS = {"jamba": 8}


def _wrap(model_type: str) -> tuple[torch.nn.Module, HookedModel]:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this transformers")
    try:
        model = build(model_type, layers=HYBRID_LAYERS.get(model_type))
    except NotBuildable as why:
        pytest.skip(f"{model_type}: {why}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        return model, HookedModel.wrap(model, registry=Registry())


def _layer(hm: HookedModel, i: int) -> list[str]:
    return [n[len(f"blocks.{i}.") :] for n in hm.hook_names if n.startswith(f"blocks.{i}.")]


def test_a_state_space_model_gets_its_mixer_output_and_internals_each_verified() -> None:
    model, hm = _wrap("mamba")
    names = _layer(hm, 0)
    # the mixer's output is hook_attn_out (no MLP in a Mamba block); the projections it calls are its internals
    assert names[0] == "hook_resid_pre" and names[-2:] == ["hook_attn_out", "hook_resid_post"], names
    assert {"mixer.hook_in_proj", "mixer.hook_x_proj", "mixer.hook_out_proj_input"} <= set(names), names
    assert not any(n.startswith(("attn.", "mlp.")) or n == "hook_mlp_out" for n in names), names
    assert {"blocks.0.ln1.hook_scale", "ln_final.hook_scale", "ln_final.hook_normalized"} <= set(hm.hook_names)
    # (the selective scan's points are checked by the scan itself on every hooked call and in tests/test_generic_scan*)
    served = [f"blocks.3.{n}" for n in _layer(hm, 3) if n.split(".")[-1] not in SCAN_POINTS] + ["ln_final.hook_scale"]
    assert check_points(hm.wiring, input_ids(), served) == dict.fromkeys(served)  # value and edit, each
    _, cache = hm.run_with_cache(input_ids())
    mixer = model.backbone.layers[0].mixer
    assert cache["blocks.0.mixer.hook_out_proj_input"].shape[-1] == mixer.out_proj.in_features
    hm.unwrap()


@pytest.mark.parametrize("model_type", ["jamba", "qwen3_next", "recurrent_gemma"])
def test_a_hybrid_serves_every_layer_what_verifies_for_its_kind(model_type: str) -> None:
    model, hm = _wrap(model_type)
    found = findings(model)
    mixing = [i for i, b in enumerate(found.blocks) if b.mixer is not None and b.mixer.internals]
    attention = [i for i in range(hm.cfg.n_layers) if i not in mixing]  # the attention layers
    assert attention and mixing
    assert not any(n.startswith("attn.") for i in mixing for n in _layer(hm, i))
    every = {"hook_resid_pre", "ln1.hook_scale", "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "hook_mlp_out"}
    for i in range(hm.cfg.n_layers):  # the residual, norm and branch points in every layer, whatever its kind
        assert every <= set(_layer(hm, i)), (i, _layer(hm, i))
    # checked at wrap time; again here, independently, the points the census does not check (layer 0's canonical)
    # (the selective scan's points are checked by the scan itself on every hooked call and in tests/test_generic_scan*)
    served = [
        f"blocks.{mixing[-1]}.{n}"
        for n in _layer(hm, mixing[-1])
        if n not in every and n.split(".")[-1] not in SCAN_POINTS
    ]
    served += [f"blocks.{attention[-1]}.{n}" for n in ("ln1.hook_normalized", "hook_resid_mid", "ln2.hook_scale")]
    checked = check_points(hm.wiring, input_ids(), served, points_per_pass=1)  # (RecurrentGemma 4.x: its state)
    # a routed expert's points can be checked only where this input routes a token to that expert (the wrap-time
    # probe's input did; tests/test_generic_expert_list.py checks them on inputs that do)
    unrouted = {n for n, why in checked.items() if ".mlp.experts." in n and why and "did not fire" in why}
    assert checked == {n: None for n in served if n not in unrouted} | {n: checked[n] for n in unrouted}
    assert len(unrouted) < len([n for n in served if ".mlp.experts." in n]) or not unrouted
    hm.unwrap()


def test_a_convolution_point_shows_the_positions_the_model_uses() -> None:
    """A causal convolution's output ``[b, channels, p + padding]`` is served as ``[b, p, channels]``, the first
    ``p`` positions (what the model continues with); an edit there reaches the logits as a plain hook's does."""
    model, hm = _wrap("recurrent_gemma")
    name = next(n for n in hm.hook_names if n.endswith(".hook_conv_1d"))
    seen: list[torch.Tensor] = []
    layer = hm.block_modules[int(name.split(".")[1])]
    handle = layer.temporal_block.conv_1d.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        _, cache = hm.run_with_cache(input_ids(), names_filter=[name])
    finally:
        handle.remove()
    p = input_ids().shape[1]
    assert seen[0].shape[-1] > p  # the padding's positions, which the model drops
    assert torch.equal(cache[name], seen[0][..., :p].transpose(1, 2))
    assert check_points(hm.wiring, input_ids(), [name]) == {name: None}
    hm.unwrap()


def test_a_single_mixture_of_experts_branch_is_the_mlp_and_a_single_mixer_is_the_attention_slot() -> None:
    """Regression: a layer that is one mixture of experts (Nemotron-H's MoE layers) was taken for a token mixer,
    its experts grouping the tokens differently (bits apart) once one token's routing changed."""
    model, hm = _wrap("nemotron_h")
    kinds = {i: type(layer.mixer).__name__ for i, layer in enumerate(hm.block_modules)}
    for i, kind in kinds.items():
        names = _layer(hm, i)
        if "MoE" in kind or kind.endswith("MLP"):
            assert "hook_mlp_out" in names and "hook_attn_out" not in names, (kind, names)
        else:
            assert "hook_attn_out" in names and "hook_mlp_out" not in names, (kind, names)
    hm.unwrap()


def test_an_internal_point_that_fails_verification_is_not_served_and_the_warning_says_why(monkeypatch) -> None:
    """A deliberately wrong reference (the projection's input where the point is its output) is caught at wrap time:
    the point is absent, and the warning names it; the others stay."""
    right = mixer_form.reference

    def wrong(model, layer, i, rest):
        ref = right(model, layer, i, rest)
        return Reference("in", ref.module) if ref is not None and rest.endswith("hook_in_proj") else ref

    monkeypatch.setattr(generic_plugin, "internal_reference", wrong)
    model, hm = _wrap("mamba")
    assert not any(n.endswith("hook_in_proj") for n in hm.hook_names)
    assert "blocks.0.mixer.hook_x_proj" in hm.hook_names
    why = findings(model).missing["token-mixer points that failed verification"]
    assert "blocks.0.mixer.hook_in_proj" in why, why
    hm.unwrap()


@pytest.mark.parametrize(
    "model_type, points",
    [
        ("mamba", ("blocks.1.hook_attn_out", "blocks.1.mixer.hook_x_proj")),
        ("qwen3_next", ("blocks.0.hook_attn_out", "blocks.0.linear_attn.hook_in_proj_qkvz", "blocks.3.hook_mlp_out")),
    ],
)
def test_generation_with_an_edited_mixer_point_continues_through_the_models_cache(model_type, points) -> None:
    """Each step of generation (the model's own cache: states of the state-space or linear-attention layers, keys
    and values of the attention layers) gives the logits of one forward over the generated tokens with the same
    edit, and the edit changes them."""
    model, hm = _wrap(model_type)
    ids = input_ids()
    inputs = Inputs(ids, torch.ones_like(ids), [0])
    for point in points:
        assert point in hm.hook_names, (point, hm.hook_names)
        one_pass, unedited, _ = check_edited_generation(
            hm, inputs, point, lambda t, hook: t * 1.5, atol=lambda logits: 1e-4 * float(logits.abs().max()) + 1e-5
        )
        assert not torch.allclose(one_pass, unedited)
    hm.unwrap()


def test_a_hooked_point_whose_module_a_cached_step_skips_raises_and_leaves_no_hook() -> None:
    """The convolution of a recurrent layer runs as a module on the prompt, and from its weights in each cached
    step: a hook on its point fails in that step with an error naming the point, not silently."""
    model, hm = _wrap("recurrent_gemma")
    name = next(n for n in hm.hook_names if n.endswith(".hook_conv_1d"))
    ids = input_ids()
    with torch.no_grad():
        plain = model(ids).logits
        with pytest.raises(RuntimeError, match=name.replace(".", r"\.")):
            with hm.hooks([(name, lambda t, hook: t)]):
                hm.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert torch.equal(model(ids).logits, plain)
    hm.unwrap()


def test_the_census_counts_a_token_mixer_as_the_attention_slot() -> None:
    """The census's rule: a layer without an ``...Attention`` child whose matrix child names no MLP has that mixer's
    output (``hook_attn_out``) and no ``attn.*`` point; Mamba's layer (a mixer alone) has no MLP point either, and a
    hybrid's mixer layer keeps its MLP's."""
    from lensadapters.testing.census import applicable_points

    mamba = applicable_points(build("mamba").backbone.layers[0])
    assert "blocks.0.hook_attn_out" in mamba
    assert not any(".attn." in p or ".mlp." in p or p.endswith("hook_mlp_out") for p in mamba), mamba
    hybrid = applicable_points(build("qwen3_next").model.layers[0])  # a linear-attention layer, then its MoE
    assert {"blocks.0.hook_attn_out", "blocks.0.hook_mlp_out"} <= set(hybrid)
    assert not any(".attn." in p for p in hybrid), hybrid
