"""Multi-head latent attention (:mod:`lensadapters.adapters.latent_attention`): the generic adapter recognises it in a
tiny DeepSeek-V3 (no plugin asked for) and serves its points verified; an edit at each point of the form equals the
same edit made by a plain PyTorch hook on the model's own modules; a wrong description is caught by the wrap-time
verification."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Callable

import pytest
import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

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
    head sizes, the rope layout), serves every latent point verified (``hook_k`` and ``hook_rot_k`` too, whose
    per-head rope columns are one key every head shares in the model), and refuses ``W_K``/``W_V`` by name."""
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
    expected += ["hook_q", "hook_rot_q", "hook_k_rope", "hook_kv_latent", "hook_k", "hook_rot_k", "hook_v"]
    expected += ["hook_attn_scores", "hook_pattern", "hook_z", "hook_result"]
    assert served == expected, served
    assert not [n for n in findings(model).unverified if ".attn." in n]
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
    computing that value gives with the same edit (the rope columns: the next test)."""
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
    edge attribution gets a graph with every head's query, key and value input (the per-head input points, verified
    at wrap time; the DeepSeek plugin's head-input tests check its scores against a plain
    per-head reference)."""
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
    graph = eap.edge_attribution(hm, IDS, corrupted, metric, progress=False).graph
    inputs = [d.name.rsplit(".", 1)[-1] for d in graph.downstream if d.kind == "attn"]
    assert [inputs.count(w) for w in "qkv"] == [hm.cfg.n_layers * hm.cfg.n_heads] * 3
    hm.unwrap()


#: transformers 5 caches MLA's latents and decompresses them at every step; transformers 4 the per-head keys
CACHES_LATENTS = int(transformers.__version__.split(".")[0]) >= 5


def _with_key_edit(model: torch.nn.Module, layer: int, edit: Callable[[Tensor, Any], Tensor]) -> Tensor:
    """The logits with ``edit(key, angles)`` applied by hand to the keys ``[b, h, p, d]`` the attention function of
    layer ``layer`` gets: a plain attention function registered in transformers' interface for this call (the
    model's own implementation, given the edited keys), with the layer's rotary angles recorded by a plain
    pre-hook."""
    attention = model.model.layers[layer].self_attn
    implementation = model.config._attn_implementation
    own = sys.modules[type(attention).__module__]
    original = own.eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
    angles: list[Any] = []

    def attend(module: torch.nn.Module, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> Any:
        return original(module, query, edit(key, angles[-1]) if module is attention else key, *args, **kwargs)

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        angles.append(kwargs["position_embeddings"])

    AttentionInterface.register("latent-test", attend)
    handle = attention.register_forward_pre_hook(record, with_kwargs=True)
    model.config._attn_implementation = "latent-test"
    try:
        return model(IDS).logits
    finally:
        model.config._attn_implementation = implementation
        handle.remove()


def _rotate(model: torch.nn.Module, k: Tensor, angles: Any) -> Tensor:
    """The model's own rotary of the keys' rope columns ``k`` ``[b, h, p, rope]``."""
    own = sys.modules[type(model.model.layers[0].self_attn).__module__]
    if not model.config.rope_interleave:
        return own.apply_rotary_pos_emb(k, k, *angles)[1]
    return own.apply_rotary_pos_emb_interleave(k, k, *angles)[1]


@pytest.mark.parametrize("declared", [False, True], ids=["generic", "declared"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_heads_rope_columns_edit_equals_a_plain_hook_on_the_key(shape: str, declared: bool) -> None:
    """An edit of the rope columns of one head of ``hook_rot_k`` gives, bit for bit, the logits of the same edit
    made by hand on the keys the model's attention function gets; one of ``hook_k`` (before rotary) those of that
    head's rope key with the edit, rotated by the model's own rotary, in the keys (and of the no-rope columns too,
    with both at once); a hook on the layer's pattern sees the edited keys; the implementation is the model's again
    after."""
    q_lora_rank, interleave = SHAPES[shape]
    model = _model(q_lora_rank, interleave)
    hm = _generic(model)
    form = form_of(hm.wiring, 1)
    assert form is not None
    if declared:
        hm.unwrap()
        hm = _declared(model, form)
    nope, implementation = form.nope, model.config._attn_implementation
    rope_key: list[Tensor] = []
    handle = (
        model.model.layers[1]
        .get_submodule(form.kv_down)
        .register_forward_hook(lambda m, a, out: rope_key.append(out[..., form.kv_rank :]))
    )
    generator = torch.Generator().manual_seed(1)
    delta = torch.zeros(1, IDS.shape[1], form.heads, form.d_head)
    delta[:, :, 2, nope:] = torch.randn(delta[:, :, 2, nope:].shape, generator=generator) * 0.5
    both = delta.clone()
    both[:, :, 1, :nope] = torch.randn(both[:, :, 1, :nope].shape, generator=generator) * 0.5

    def rotated_key_edit(d: Tensor) -> Callable[[Tensor, Any], Tensor]:
        def edit(key: Tensor, angles: Any) -> Tensor:
            shared = rope_key[-1][:, None].expand(-1, form.heads, -1, -1)
            rope = _rotate(model, shared + d.transpose(1, 2)[..., nope:], angles)
            return torch.cat((key[..., :nope] + d.transpose(1, 2)[..., :nope], rope), dim=-1)

        return edit

    try:
        with torch.no_grad():
            base = model(IDS).logits
            expected = _with_key_edit(model, 1, lambda key, angles: key + delta.transpose(1, 2))
            got = hm.run_with_hooks(IDS, fwd_hooks=[("blocks.1.attn.hook_rot_k", lambda t, hook: t + delta)])
            assert (expected - base).abs().max() > 1e-2
            assert torch.equal(got, expected)
            for d in (delta, both):
                expected = _with_key_edit(model, 1, rotated_key_edit(d))
                got = hm.run_with_hooks(IDS, fwd_hooks=[("blocks.1.attn.hook_k", lambda t, hook, d=d: t + d)])
                assert (expected - base).abs().max() > 1e-2
                assert torch.equal(got, expected)
            patterns: list[Tensor] = []
            with hm.hooks(
                fwd_hooks=[
                    ("blocks.1.attn.hook_k", lambda t, hook: t + both),
                    ("blocks.1.attn.hook_pattern", lambda t, hook: patterns.append(t)),
                ]
            ):
                torch.testing.assert_close(hm(IDS).logits, expected, rtol=1e-5, atol=1e-5)
            _, cache = hm.run_with_cache(IDS, names_filter="blocks.1.attn.hook_pattern")
            assert (patterns[0] - cache["blocks.1.attn.hook_pattern"]).abs().max() > 1e-3
            assert torch.equal(hm(IDS).logits, base)
            assert model.config._attn_implementation == implementation
    finally:
        handle.remove()
    hm.unwrap()


def _generate_greedily(hm: HookedModel, steps: int) -> list[tuple[Tensor, Tensor]]:
    """``(the last position's logits with the cache, those of one pass over the whole sequence)`` at each of
    ``steps`` greedy steps after the prompt ``IDS``."""
    ids, pairs = IDS, []
    out = hm.hf_model(ids, use_cache=True)
    for _ in range(steps):
        ids = torch.cat((ids, out.logits[:, -1:].argmax(-1)), dim=1)
        out = hm.hf_model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        pairs.append((out.logits[:, -1], hm.hf_model(ids, use_cache=False).logits[:, -1]))
    return pairs


@pytest.mark.skipif(CACHES_LATENTS, reason="transformers 5 caches the latents (the refusal is tested instead)")
def test_an_edit_of_one_heads_rope_columns_is_kept_in_the_cache_of_per_head_keys() -> None:
    """Transformers 4 caches the per-head keys after rotary: an edit of one head's rope columns of ``hook_rot_k``
    during cached generation is stored there, so every step's logits are those of one pass over the whole sequence
    with the same edit at every position (and not those without it)."""
    model = _model(16, True)
    hm = _generic(model)
    nope = form_of(hm.wiring, 1).nope  # type: ignore[union-attr]

    def edit(t: Tensor, hook: Any) -> Tensor:
        t = t.clone()
        t[:, :, 2, nope:] = t[:, :, 2, nope:] * 3 - 0.5
        return t

    with torch.no_grad():
        plain = _generate_greedily(hm, 3)
        with hm.hooks(fwd_hooks=[("blocks.1.attn.hook_rot_k", edit)]):
            edited = _generate_greedily(hm, 3)
    for (cached, one_pass), (unedited, _) in zip(edited, plain):
        torch.testing.assert_close(cached, one_pass, rtol=1e-5, atol=1e-5)
        assert (cached - unedited).abs().max() > 1e-3
    hm.unwrap()


@pytest.mark.skipif(not CACHES_LATENTS, reason="transformers 4 caches the per-head keys (the edit is served)")
def test_an_edit_of_the_keys_during_cached_generation_is_refused_where_the_latents_are_cached() -> None:
    """Transformers 5 caches the latents and decompresses the earlier positions again at every step, where the edit
    would be lost: an edit of ``hook_k``/``hook_rot_k`` in a step after the first is refused by name."""
    model = _model(16, True)
    hm = _generic(model)
    for point in ("blocks.1.attn.hook_k", "blocks.1.attn.hook_rot_k"):
        with torch.no_grad(), hm.hooks(fwd_hooks=[(point, lambda t, hook: t * 2)]):
            out = hm.hf_model(IDS, use_cache=True)
            with pytest.raises(HookReturnError, match="cached generation"):
                hm.hf_model(IDS[:, :1], past_key_values=out.past_key_values, use_cache=True)
    hm.unwrap()
