"""Multi-head latent attention (:mod:`lensadapters.adapters.latent_attention`): the generic adapter recognises it in a
tiny DeepSeek-V3 (no plugin asked for) and serves its points verified; an edit at each point of the form equals the
same edit made by a plain PyTorch hook on the model's own modules; a wrong description is caught by the wrap-time
verification."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from lensadapters import Architecture, HookedModel, Registry, WeightUnavailableError, hf
from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.plugin import verify_description
from lensadapters.adapters.latent_attention import LatentAttention, form_of, latent_rotary
from lensadapters.errors import HookReturnError
from lensadapters.hf import tiny_config_of

Tensor = torch.Tensor
IDS = torch.tensor([[3, 9, 4, 17, 5, 30, 2]])
#: (query latent rank, interleaved rope): a query latent with interleaved rope, and q_proj with rotate-half
SHAPES = {"q latent, interleaved": (16, True), "q_proj, rotate-half": (None, False)}


#: the latent attention's sizes besides the query latent: a key/value latent of 12, each head's query and key of 8
#: dimensions without rotary then 4 with it, values of 6
LATENT = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4, v_head_dim=6)
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _model(q_lora_rank: Any, interleave: bool) -> torch.nn.Module:
    config = tiny_config_of(
        DeepseekV3Config,
        kv_heads=4,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        first_k_dense_replace=2,  # dense layers only (no expert is built): the attention is what is tested here
        initializer_range=0.3,  # edits that move the logits well above float32 rounding
        **LATENT,
        **SPECIAL,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def _generic(model: torch.nn.Module) -> HookedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedModel.wrap(model, adapter="generic")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_generic_adapter_recognises_latent_attention_and_serves_it_verified(shape: str) -> None:
    """The automatic description finds the form from the probe's values (the projections, the latents' norms, the
    head sizes, the rope layout), serves every latent point verified, leaves out ``hook_k`` and ``hook_rot_k`` (their
    rope columns are one key every head shares: the check's edit is refused by name), and refuses ``W_K``/``W_V`` by
    name."""
    q_lora_rank, interleave = SHAPES[shape]
    model = _model(q_lora_rank, interleave)
    hm = _generic(model)
    form = form_of(hm.wiring, 0)
    assert form is not None
    assert (form.heads, form.kv_rank, form.nope, form.rope, form.v_head_dim) == (4, 12, 8, 4, 6)
    assert form.kv_down == "self_attn.kv_a_proj_with_mqa" and form.kv_up == "self_attn.kv_b_proj"
    assert form.kv_norm == "self_attn.kv_a_layernorm"
    if q_lora_rank:
        assert (form.q_down, form.q_norm, form.q) == (
            "self_attn.q_a_proj",
            "self_attn.q_a_layernorm",
            "self_attn.q_b_proj",
        )
    else:
        assert (form.q_down, form.q_norm, form.q) == (None, None, "self_attn.q_proj")
    served = [n[len("blocks.1.attn.") :] for n in hm.hook_names if n.startswith("blocks.1.attn.")]
    expected = ["hook_q_latent"] if q_lora_rank else []
    expected += ["hook_q", "hook_rot_q", "hook_k_rope", "hook_kv_latent", "hook_v"]
    expected += ["hook_attn_scores", "hook_pattern", "hook_z", "hook_result"]
    assert served == expected
    unverified = findings(model).unverified
    assert "rope columns" in unverified["blocks.0.attn.hook_rot_k"]
    assert "rope columns" in unverified["blocks.0.attn.hook_k"]
    for name in ("W_K", "W_V") + (("W_Q",) if q_lora_rank else ()):
        with pytest.raises(WeightUnavailableError, match="latent_weights"):
            getattr(hm, name)
    hm.unwrap()


def _plain_edit(form: LatentAttention, name: str, delta: Tensor) -> Callable[..., Any]:
    """A plain PyTorch forward hook adding the point ``name``'s delta to its part of the output of the module the
    model computes it in."""
    nope, rank, heads = form.nope, form.kv_rank, form.heads

    def kv_up(out: Tensor, columns: slice) -> Tensor:
        per_head = out.flatten(1, -2).unflatten(-1, (heads, -1)).clone()
        per_head[..., columns] += delta[..., : per_head[..., columns].shape[-1]]
        return per_head.flatten(-2).reshape(out.shape)

    edits: dict[str, Callable[[Tensor], Tensor]] = {
        "hook_q_latent": lambda out: out + delta,
        "hook_kv_latent": lambda out: out + delta,
        "hook_k_rope": lambda out: torch.cat((out[..., :rank], out[..., rank:] + delta), dim=-1),
        "hook_q": lambda out: out + delta.flatten(-2),
        "hook_k": lambda out: kv_up(out, slice(0, nope)),
        "hook_v": lambda out: kv_up(out, slice(nope, None)),
    }
    return lambda module, args, out: edits[name](out)


def _declared(model: torch.nn.Module, form: LatentAttention) -> HookedModel:
    """A plugin declaring the form (every point served, as a plugin serves them: the generic adapter found it)."""
    arch = Architecture(name="latent_test", model_types=("deepseek_v3",), transformers=">=4.57,<6")
    family = hf.DecoderFamily.named("DeepseekV3", "deepseek_v3", qkv=(form.kv_norm, form.kv_down, form.kv_up), mlp=None)
    declared = hf.DecoderPlugin(
        arch,
        family,
        lambda seed: model.config,
        latent_attention=lambda m, layer: form,
        mlp=lambda m, layer: hf.SWIGLU_MLP,
    )
    registry = Registry()
    registry.register(declared, "latent_test")
    return HookedModel.wrap(model, adapter=arch.name, registry=registry)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_edit_at_each_latent_point_equals_a_plain_pytorch_hook(shape: str) -> None:
    """An edit of ``hook_q_latent``, ``hook_kv_latent``, ``hook_k_rope``, ``hook_q``, ``hook_k`` (its no-rope
    columns), ``hook_v`` and ``hook_rot_k`` (its no-rope columns) gives the logits a plain forward hook on the module
    computing that value gives with the same edit; an edit of the shared rope columns per head is refused by name."""
    q_lora_rank, interleave = SHAPES[shape]
    model = _model(q_lora_rank, interleave)
    generic = _generic(model)
    form = form_of(generic.wiring, 1)
    assert form is not None
    generic.unwrap()
    hm = _declared(model, form)
    _, cache = hm.run_with_cache(IDS)
    layer = model.model.layers[1]
    modules = {
        "hook_q_latent": form.q_norm,
        "hook_kv_latent": form.kv_norm,
        "hook_k_rope": form.kv_down,
        "hook_q": form.q,
        "hook_k": form.kv_up,
        "hook_v": form.kv_up,
    }
    generator = torch.Generator().manual_seed(0)
    deltas = {
        n: torch.randn(cache[f"blocks.1.attn.{n}"].shape, generator=generator) * 0.5 for n in modules if modules[n]
    }
    deltas["hook_k"][..., form.nope :] = 0.0  # the no-rope columns only: the rope ones are shared by the heads
    with torch.no_grad():
        base = model(IDS).logits
        for name, delta in deltas.items():
            handle = layer.get_submodule(modules[name]).register_forward_hook(_plain_edit(form, name, delta))
            try:
                expected = model(IDS).logits
            finally:
                handle.remove()
            got = hm.run_with_hooks(IDS, fwd_hooks=[(f"blocks.1.attn.{name}", lambda t, hook, d=delta: t + d)])
            assert (expected - base).abs().max() > 1e-2, name
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)
        # hook_rot_k's no-rope columns are hook_k's (rotary leaves them as they are)
        no_rope = deltas["hook_k"]
        rot, k = (
            hm.run_with_hooks(IDS, fwd_hooks=[(f"blocks.1.attn.{point}", lambda t, hook: t + no_rope)])
            for point in ("hook_rot_k", "hook_k")
        )
        torch.testing.assert_close(rot, k)
        for point in ("hook_k", "hook_rot_k"):
            with pytest.raises(HookReturnError, match="hook_k_rope"):
                hm.run_with_hooks(IDS, fwd_hooks=[(f"blocks.1.attn.{point}", lambda t, hook: t * 2)])
        assert torch.equal(hm(IDS).logits, base)
    hm.unwrap()


def test_hooks_added_one_at_a_time_read_the_rotated_keys() -> None:
    """A hook on ``hook_k_rope`` first, then one on ``hook_rot_k``: the site is installed again with the rotary
    angles the second needs (it stayed installed without them, and the forward raised ``KeyError``)."""
    model = _model(16, True)
    generic = _generic(model)
    form = form_of(generic.wiring, 0)
    assert form is not None
    generic.unwrap()
    hm = _declared(model, form)
    seen: dict[str, Tensor] = {}
    for name in ("blocks.0.attn.hook_k_rope", "blocks.0.attn.hook_rot_k"):
        hm.add_hook(name, lambda t, hook: seen.setdefault(hook.name, t))
    with torch.no_grad():
        hm(IDS)
    _, cache = hm.run_with_cache(IDS, names_filter=lambda n: n.startswith("blocks.0.attn.hook_rot"))
    assert torch.equal(seen["blocks.0.attn.hook_rot_k"], cache["blocks.0.attn.hook_rot_k"])
    hm.reset_hooks()
    hm.unwrap()


def test_a_wrong_latent_description_is_caught_by_the_verification() -> None:
    """The wrap-time verification checks the form's claims against the model's own attention function: a description
    with the other rope layout fails at the rotated queries and keys, which the true description passes."""
    model = _model(16, True)
    hm = _generic(model)
    described = findings(model).description
    assert described is not None
    true = [layer.qkv for layer in described.layers]
    form = form_of(hm.wiring, 0)
    assert form is not None
    assert not {n for n in verify_description(hm.wiring) if n.endswith(("hook_rot_q", "hook_k_rope", "hook_v"))}
    bad = dataclasses.replace(form, rotary=latent_rotary(form.nope, form.rope, "rotate_half"))
    try:
        for layer in described.layers:
            layer.qkv = bad.qkv()
        caught = verify_description(hm.wiring)
    finally:
        for layer, qkv in zip(described.layers, true):
            layer.qkv = qkv
    assert "not the reference" in caught["blocks.0.attn.hook_rot_q"]
    assert "not the reference" in caught["blocks.1.attn.hook_rot_q"]
    hm.unwrap()


def test_attribution_patching_of_latent_heads_is_the_derivative_along_the_patch() -> None:
    """Attribution patching on the automatically described latent attention: each head's score for ``hook_q``,
    ``hook_v`` and ``hook_z`` is the derivative of the metric along the clean-minus-corrupted patch of that head;
    edge attribution is refused by name (the heads' queries, keys and values have no per-head input points)."""
    from lensadapters import attribution
    from lensadapters import edge_attribution as eap

    hm = _generic(_model(16, True))
    corrupted = IDS.clone()
    corrupted[0, 2] = 11

    def metric(logits: Tensor) -> Tensor:
        return (logits[:, -1, 5] - logits[:, -1, 7]).sum()

    result = attribution.attribute(hm, IDS, corrupted, metric, ["q", "v", "z"], progress=False)
    for short in ("q", "v", "z"):
        scores = result.scores(short, ("layer", "head"))
        for layer, head in ((0, 1), (1, 3)):
            name = f"blocks.{layer}.attn.hook_{short}"
            delta = (result.clean[name] - result.corrupted[name])[:, :, head].double()
            size = torch.zeros((), dtype=torch.float64, requires_grad=True)

            def patch(x: Tensor, hook: Any, head: int = head, delta: Tensor = delta, size: Tensor = size) -> Tensor:
                x = x.clone()
                x[:, :, head] = x[:, :, head] + (size * delta).to(x.dtype)
                return x

            value = metric(hm.run_with_hooks(corrupted, fwd_hooks=[(name, patch)]))
            expected = float(torch.autograd.grad(value, size)[0])
            assert abs(expected) > 1e-6, name
            assert abs(float(scores[layer, head]) - expected) <= 1e-4 * max(1.0, abs(expected)), (name, head)
    with pytest.raises(attribution.AttributionUnavailable, match="per-head input points"):
        eap.edge_attribution(hm, IDS, corrupted, metric, progress=False)
    hm.unwrap()
