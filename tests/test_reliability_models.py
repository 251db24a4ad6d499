"""No silent wrong results, crashes or leaks on real (tiny) models: modules replaced after wrapping, inputs_embeds,
fully masked attention rows, in-place edits under autograd, garbage collection, saving and copying.

Models are built from transformers' config classes and wrapped through the installed plugins.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig

from lensadapters import HookedModel
from lensadapters.guard import ModuleReplacedError, site_modules
from lensadapters.hf import size_fields
from lensadapters.testing import assert_close, reinit


def _build(config: Any, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    reinit(model, seed)
    return model.eval()


CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=32),
    "gpt_neox": lambda: GPTNeoXConfig(
        **size_fields(hidden=16, layers=2, heads=2, d_mlp=32, vocab=32, positions=32), rotary_pct=0.5
    ),
    "llama": lambda: LlamaConfig(
        **size_fields(hidden=16, d_mlp=24, layers=2, heads=4, kv_heads=2, vocab=32, positions=32)
    ),
}


def _model(arch: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    return _build(CONFIGS[arch](), attn, seed)


def _wrap(model: Any) -> HookedModel:
    try:
        return HookedModel.wrap(model)
    except Exception as exc:  # pragma: no cover - a test environment without that plugin
        pytest.skip(f"cannot wrap {type(model).__name__}: {exc}")


def _ids(seed: int, batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 32, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- modules replaced after wrapping -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@given(data=st.data())
@settings(max_examples=6, deadline=None)
def test_a_module_replaced_after_wrapping_refuses_exactly_the_hooks_that_depend_on_it(
    arch: str, data: st.DataObject
) -> None:
    """Replace one module a hook point's site hooks (by a copy, as surgery or an adapter library would): a hook on
    that point raises naming the module, before the forward; a hook on a point that does not depend on it runs."""
    model = _model(arch)
    hm = _wrap(model)
    wiring = hm.wiring
    point = data.draw(
        st.sampled_from([n for n in hm.hook_names if not n.endswith(("pattern", "scores"))]), label="point"
    )
    sites = [site for site in wiring.sites if point in [p.name for p in site.points]]
    modules = [m for site in sites for m in site_modules(site) if m is not model and wiring.guard.path_of(m)]
    assume_modules = [m for m in modules if wiring.guard.path_of(m).count(".") >= 1]
    if not assume_modules:
        hm.unwrap()
        return
    victim = data.draw(st.sampled_from(assume_modules), label="module")
    path = wiring.guard.path_of(victim)
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    setattr(parent, name, copy.deepcopy(victim))
    ids = _ids(0)
    forwards: list[int] = []
    counter = model.register_forward_pre_hook(lambda module, args: forwards.append(1), prepend=False)
    with pytest.raises(
        ModuleReplacedError, match=f"module '{path}' of the wrapped .* was replaced after HookedModel.wrap"
    ):
        hm.run_with_hooks(ids, fwd_hooks=[(point, lambda t, hook: None)])
    counter.remove()

    def depends(name: str) -> bool:  # a site of the point hooks the victim or a module inside it
        return any(
            child is victim
            for s in wiring.sites
            if name in [p.name for p in s.points]
            for _, _, child in wiring.guard.links_of(s)
        )

    independent = [n for n in hm.hook_names if not depends(n) and not n.endswith(("pattern", "scores"))]
    if not independent:
        hm.unwrap()
        return
    other = data.draw(st.sampled_from(independent), label="independent point")
    seen: list[int] = []
    with torch.no_grad():
        hm.run_with_hooks(ids, fwd_hooks=[(other, lambda t, hook: seen.append(1))])
    assert seen, f"{other} no longer fires although nothing it depends on was replaced"
    hm.unwrap()
    assert not hm.wiring.installed


def test_a_plugin_added_sites_module_is_guarded_too() -> None:
    """A site a plugin adds (here a toy cross-cutting plugin's, on the MLP's down projection) is watched as well."""
    import types

    from lensadapters import Registry, hookimpl
    from lensadapters.registry import get_registry
    from lensadapters.sites import OutputSite

    @hookimpl
    def lensadapters_extra_sites(arch, hooked):  # noqa: ANN001, ANN202
        module = hooked.block_modules[0].get_submodule(hooked.mlp_layouts[0].out)
        point = hooked.new_point("blocks.0.mlp.hook_extra", after="blocks.0.mlp.hook_post")
        return [OutputSite(module, point)]

    plugin = types.ModuleType("extra")
    plugin.lensadapters_extra_sites = lensadapters_extra_sites
    registry = Registry()
    owner = get_registry().owners("llama")
    if not owner:
        pytest.skip("needs the llama plugin")
    registry.register(get_registry().infos[owner[0]].plugin, owner[0])
    registry.register(plugin, "extra")
    model = _model("llama")
    hm = HookedModel.wrap(model, registry=registry)
    model.model.layers[0].mlp.down_proj = copy.deepcopy(model.model.layers[0].mlp.down_proj)
    with pytest.raises(ModuleReplacedError, match="model.layers.0.mlp.down_proj"):
        hm.run_with_hooks(_ids(0), fwd_hooks=[("blocks.0.mlp.hook_extra", lambda t, hook: None)])
    hm.run_with_hooks(_ids(0), fwd_hooks=[("blocks.1.mlp.hook_post", lambda t, hook: None)])
    hm.unwrap()


# --- inputs_embeds ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@given(seed=st.integers(0, 1000), scale=st.floats(0.0, 3.0), in_place=st.booleans())
@settings(max_examples=6, deadline=None)
def test_hook_embed_fires_on_given_inputs_embeds(arch: str, seed: int, scale: float, in_place: bool) -> None:
    """With ``inputs_embeds`` the embedding module does not run: ``hook_embed`` reads the given embeddings, an edit
    is exactly an edit of them (the caller's tensor untouched), and ``hook_pos_embed`` keeps its batch."""
    model = _model(arch, seed=seed)
    hm = _wrap(model)
    ids = _ids(seed)
    embeds = model.get_input_embeddings()(ids).detach()
    given_copy = embeds.clone()
    seen: dict[str, torch.Tensor] = {}

    def edit(t: torch.Tensor, hook: Any) -> Any:
        seen["embed"] = t.clone()
        if in_place:
            t.mul_(scale)
            return None
        return t * scale

    with torch.no_grad():
        expected = model(inputs_embeds=embeds * scale).logits
        logits = hm.run_with_hooks(inputs_embeds=embeds, fwd_hooks=[("hook_embed", edit)])
        _, cache = hm.run_with_cache(inputs_embeds=embeds)
        _, from_ids = hm.run_with_cache(ids)
    assert torch.equal(seen["embed"], embeds)
    assert torch.equal(embeds, given_copy), "the hook edited the caller's tensor"
    assert_close(logits, expected, "edited hook_embed == edited inputs_embeds", atol=1e-5)
    for name in from_ids:
        assert name in cache, f"{name} missing from the cache of an inputs_embeds call"
        assert cache[name].shape == from_ids[name].shape, name
    assert torch.equal(cache["hook_embed"], from_ids["hook_embed"])
    hm.unwrap()


# --- fully masked attention rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@given(seed=st.integers(0, 1000), pads=st.lists(st.integers(0, 5), min_size=2, max_size=3))
@settings(max_examples=5, deadline=None)
def test_caching_patterns_never_changes_the_logits_with_fully_masked_rows(
    arch: str, attn: str, seed: int, pads: list[int]
) -> None:
    """Left padding leaves the padding queries nothing to attend to: explicit attention gives those rows what the
    configured implementation gives them, so every logit (padding positions included) is HF's."""
    model = _model(arch, attn, seed)
    hm = _wrap(model)
    length = 6
    ids = _ids(seed, len(pads), length)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, output_attentions=attn == "eager")
        logits, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: n.endswith("pattern"))
        edited = hm.run_with_hooks(
            ids, attention_mask=mask, fwd_hooks=[(lambda n: n.endswith("attn_scores"), lambda t, hook: None)]
        )
    assert_close(logits, reference.logits, f"{attn}: logits with patterns cached", atol=1e-5)
    assert_close(edited, reference.logits, f"{attn}: logits with a score hook that may edit", atol=1e-5)
    if attn == "eager":
        for layer, hf_pattern in enumerate(reference.attentions):
            assert_close(
                cache["pattern", layer], hf_pattern, f"layer {layer} pattern, padding rows included", atol=1e-6
            )
    hm.unwrap()


# --- in-place edits under autograd ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@given(data=st.data())
@settings(max_examples=8, deadline=None)
def test_in_place_edits_work_with_autograd_at_every_point(arch: str, data: st.DataObject) -> None:
    """An in-place edit is the same edit as returning a new tensor, forward and backward, at any hook point (fused
    QKV views, softmax and activation outputs that backward needs included)."""
    model = _model(arch, "eager")
    hm = _wrap(model)
    point = data.draw(st.sampled_from([n for n in hm.hook_names if n != "hook_pos_embed"]), label="point")
    factor = data.draw(st.sampled_from([0.5, 2.0, -1.0]), label="factor")  # 0 would divide by a zero scale
    ids = _ids(1)

    def in_place(t: torch.Tensor, hook: Any) -> None:
        t[..., :1].mul_(factor)

    def returned(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[..., :1] *= factor
        return t

    results = []
    for fn in (in_place, returned):
        model.zero_grad()
        logits = hm.run_with_hooks(ids, fwd_hooks=[(point, fn)])
        logits.float().pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logits.detach(), grads))
    (a, grads_a), (b, grads_b) = results
    assert torch.equal(a, b), f"{point}: in-place edit and returned edit differ"
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        assert_close(ga, gb, f"{point}: gradients", atol=1e-6)
    hm.unwrap()


# --- leaks ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("state", ["fresh", "ran", "permanent_hooks", "patterns_hooked"])
def test_a_wrapped_model_is_garbage_once_dropped(arch: str, state: str) -> None:
    model = _model(arch)
    hm = _wrap(model)
    if state != "fresh":
        hm.run_with_cache(_ids(0))
    if state == "permanent_hooks":
        hm.add_hook("blocks.0.hook_resid_post", lambda t, hook: t * 2, is_permanent=True)
        hm(_ids(0))
    if state == "patterns_hooked":
        hm.add_hook("blocks.1.attn.hook_pattern", lambda t, hook: None)
        hm(_ids(0))
    model_ref, wrapper_ref = weakref.ref(model), weakref.ref(hm)
    del model, hm
    gc.collect()
    assert model_ref() is None, "the model outlived its last reference"
    assert wrapper_ref() is None, "the wrapper outlived its last reference"


def test_no_attention_mask_is_kept_after_a_call(monkeypatch) -> None:
    """Everything derived from an attention mask for explicit attention dies with the call (nothing module-global
    keeps a mask or a tensor made from it), after unwrap and after the model is deleted alike."""
    from lensadapters.hooks import explicit_attention as attention

    made: list[weakref.ref] = []
    original = attention._allowed_and_bias_info

    def watching(mask, *args):  # noqa: ANN001, ANN202
        out = original(mask, *args)
        made.extend(weakref.ref(t) for t in (mask, *out) if isinstance(t, torch.Tensor))
        return out

    monkeypatch.setattr(attention, "_allowed_and_bias_info", watching)
    model = _model("llama", "eager")
    hm = _wrap(model)
    ids = _ids(0)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: n.endswith("pattern"))
    del mask
    gc.collect()
    assert made, "explicit attention did not run"
    assert all(ref() is None for ref in made), "a mask (or a tensor derived from it) is still referenced"
    assert not attention._MASK_INFOS
    hm.unwrap()


# --- saving and copying ---------------------------------------------------------------------------------------


def _hooked_states(hm: HookedModel) -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("a permanent hook", lambda: hm.add_hook("blocks.0.hook_resid_post", lambda t, hook: t + 1, is_permanent=True)),
        ("a pattern hook", lambda: hm.add_hook("blocks.1.attn.hook_pattern", lambda t, hook: t * 0.5)),
        ("hooks of every kind", lambda: hm.add_hook(lambda n: True, lambda t, hook: None)),
    ]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("which", [0, 1, 2])
def test_saving_and_copying_a_hooked_model_gives_the_users_model(arch: str, which: int, tmp_path: Path) -> None:
    model = _model(arch)
    ids = _ids(3)
    with torch.no_grad():
        plain_logits = model(ids).logits
    model.save_pretrained(tmp_path / "plain")
    hm = _wrap(model)
    label, attach = _hooked_states(hm)[which]
    attach()
    with torch.no_grad():
        hooked_logits = hm(ids).logits
    model.save_pretrained(tmp_path / "hooked")
    assert _files(tmp_path / "hooked") == _files(tmp_path / "plain"), f"save_pretrained with {label} differs"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = {
        "deepcopy": copy.deepcopy(model),
        "pickle": pickle.loads(pickle.dumps(model)),
        "torch.save": torch.load(buffer, weights_only=False),
    }
    for how, copied in copies.items():
        assert copied.config._attn_implementation == "sdpa" and type(copied.config._attn_implementation) is str
        disable = copied.generation_config.disable_compile
        assert disable is None or disable is False, f"{how}: disable_compile is {disable!r}"
        with torch.no_grad():
            assert torch.equal(copied(ids).logits, plain_logits), f"{how} of a model with {label} is not the model"
        again = HookedModel.wrap(copied)
        assert again is not hm
        again.unwrap()
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, hooked_logits), "copying changed the hooked model"
    hm.unwrap()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain_logits)
    model.save_pretrained(tmp_path / "after")
    assert _files(tmp_path / "after") == _files(tmp_path / "plain")


def test_copies_of_a_model_whose_attention_a_plugin_overrides_compute_the_plain_model() -> None:
    """A pattern backend that overrides a method of one attention module (the GPT-J example's ``_attn``): copies
    and pickles of the hooked model get the class's own method back, bound to the copied module."""
    from transformers import GPTJConfig

    model = _build(GPTJConfig(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=32, rotary_dim=4), "eager")
    ids = _ids(5)
    with torch.no_grad():
        plain = model(ids).logits
    hm = _wrap(model)
    hm.add_hook("blocks.0.attn.hook_pattern", lambda t, hook: t * 0.5)
    with torch.no_grad():
        hooked = hm(ids).logits
        assert not torch.equal(hooked, plain)
        for how, copied in (("deepcopy", copy.deepcopy(model)), ("pickle", pickle.loads(pickle.dumps(model)))):
            assert torch.equal(copied(ids).logits, plain), f"{how} of the hooked model is not the plain model"
        assert torch.equal(hm(ids).logits, hooked)
    hm.unwrap()
