"""GPT-J: the contract suite (every generic property), plus GPT-J's own quirks.

The same contract on LoRA-adapted and 8-bit models runs wherever a cross-cutting plugin with a contract
variant is installed: its test matrix finds ``GPTJContract`` through this plugin's entry point and
``LENSADAPTERS_CONTRACT`` (``lensadapters check gptj --lora`` runs it too).

Architecture-specific properties checked here:
* ``hook_rot_q``/``hook_rot_k`` equal an independent interleaved-pairs RoPE reference (complex
  multiplication in float64 on dims ``(2i, 2i+1)``) of ``hook_q``/``hook_k``, and ``hook_rot_k`` is
  bitwise the key the model stores in its KV cache (left padding, positions as ``generate`` passes them).
* A ``hook_rot_k`` edit is stored in the KV cache.
* The pattern backend's instance override of ``_attn`` exists only on hooked layers, only while hooked,
  never on the class or on another model, and is refused where it cannot work.
* The shared norm: no ``ln2``/``hook_mlp_in``/``hook_resid_mid``; an ``ln1`` edit reaches both branches.
* The plugin is found through its entry point.
"""

from __future__ import annotations

import contextlib

import lensadapters_gptj
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_gptj.contract import GPTJContract, gptj_configs
from torch import nn
from transformers import AutoModelForCausalLM, GPTJConfig
from transformers.models.gptj import modeling_gptj as hf

from lensadapters import HookedModel, LensAdaptersError, Registry, UnsupportedModelError
from lensadapters.adapters.hf import without_dropout
from lensadapters.testing import reference_rope, rope_inv_freq, seeded_model

_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


class TestGPTJ(GPTJContract):
    """The generic contract (an ``AdapterContract`` subclass shipped with the plugin, so that
    ``lensadapters check gptj`` runs the very same suite)."""


# --- helpers ---------------------------------------------------------------------------------------------


def make_model(config: GPTJConfig, seed: int = 0) -> nn.Module:
    """Eager attention: GPT-J's default up to transformers 5.23 (5.24 defaults to sdpa)."""
    return seeded_model(config, seed, attn_implementation="eager")


def small_config(**overrides) -> GPTJConfig:
    tokens = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"), 0)
    kw = dict(n_layer=2, n_head=4, n_embd=32, rotary_dim=4, n_positions=32, vocab_size=64, **tokens)
    return without_dropout(GPTJConfig, **{**kw, **overrides})


def registry() -> Registry:
    reg = Registry()
    reg.register(lensadapters_gptj, "gptj")
    return reg


@contextlib.contextmanager
def wrapped(model: nn.Module):
    hm = HookedModel.wrap(model, registry=registry())
    try:
        yield hm
    finally:
        hm.unwrap()


def left_padded(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, vocab, (3, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids, mask


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """What ``generate`` passes: positions counted from each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


# --- rotary ------------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(config=gptj_configs(), seed=st.integers(0, 1000))
def test_rotary_matches_interleaved_reference_and_kv_cache(config, seed):
    model = make_model(config, seed)
    ids, mask = left_padded(config.vocab_size, seed)
    positions = generate_positions(mask)
    r = config.rotary_dim if config.rotary_dim is not None else config.n_embd // config.n_head
    with wrapped(model) as hm, torch.no_grad():
        store = {}

        def keep(t, hook):
            store[hook.name] = t.clone()

        with hm.hooks([(lambda n: n.endswith(("hook_q", "hook_k", "hook_rot_q", "hook_rot_k")), keep)]):
            out = hm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for layer in range(config.n_layer):
            pre = f"blocks.{layer}.attn."
            for name in ("q", "k"):
                expected = reference_rope(store[pre + f"hook_{name}"], positions, rope_inv_freq(r), interleaved=True)
                got = store[pre + f"hook_rot_{name}"]
                assert torch.allclose(got.double(), expected, atol=1e-4, rtol=1e-4), (layer, name)
            cached_keys = _cached_keys(out.past_key_values, layer)  # [b, h, p, d]
            assert torch.equal(store[pre + "hook_rot_k"], cached_keys.transpose(1, 2)), layer


def _cached_keys(past, layer: int) -> torch.Tensor:
    if hasattr(past, "layers"):  # transformers 5.x
        return past.layers[layer].keys
    return past.key_cache[layer]  # transformers 4.57


def test_rot_k_edit_is_stored_in_the_kv_cache_and_used_by_later_steps():
    config = small_config(rotary_dim=8)  # full rotary (d_head = 8)
    model = make_model(config)
    ids, mask = left_padded(config.vocab_size)
    positions = generate_positions(mask)

    def zero_head(t, hook):
        t = t.clone()
        t[:, :, 1] = 0
        return t

    with wrapped(model) as hm, torch.no_grad():
        edited = hm.run_with_hooks  # noqa: F841 - readability below
        with hm.hooks([("blocks.0.attn.hook_rot_k", zero_head)]):
            out = hm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        keys = _cached_keys(out.past_key_values, 0)
        assert keys[:, 1].abs().max().item() < 1e-5, "the edited (zeroed) key head was not cached"
        assert keys[:, 0].abs().max().item() > 1e-2
        # a next step with the edited cache differs from one with the model's own cache
        step = torch.randint(1, config.vocab_size, (3, 1), generator=torch.Generator().manual_seed(5))
        step_mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        step_pos = positions[:, -1:] + 1
        with_edit = hm(
            input_ids=step, attention_mask=step_mask, position_ids=step_pos, past_key_values=out.past_key_values
        ).logits
        clean = hm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        without = hm(
            input_ids=step, attention_mask=step_mask, position_ids=step_pos, past_key_values=clean.past_key_values
        ).logits
        assert (with_edit - without).abs().max().item() > 1e-4


# --- the pattern backend's scope -----------------------------------------------------------------------------


def test_patterns_are_served_in_either_layout():
    """transformers 5.24 moved GPT-J's attention onto the attention interface: its ``_attn`` override would never be
    called and the pattern hooks would silently never fire. Whichever layout, pattern and scores are cached."""
    model = seeded_model(GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32, vocab_size=64), 0)
    model.set_attn_implementation("eager")
    hm = HookedModel.wrap(model, registry=registry())
    _, cache = hm.run_with_cache(torch.tensor([[3, 5, 7, 9]]), names_filter=lambda n: "pattern" in n or "scores" in n)
    assert sorted(cache.keys()) == sorted(n for n in hm.hook_names if "pattern" in n or "scores" in n)
    pattern = cache["blocks.1.attn.hook_pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-6) and torch.all(pattern.triu(1) == 0)


@pytest.mark.skipif(lensadapters_gptj._own_attention(), reason="transformers <= 5.23: GPT-J has no sdpa attention")
def test_sdpa_patterns_from_524_equal_eager_attentions_and_edits_act_as_in_eager():
    """From transformers 5.24 a GPT-J built with its defaults runs sdpa attention through the attention interface:
    its patterns are served (they were refused: the plugin declared eager only) and equal what the same weights
    return as attentions under eager; a pattern edit gives the logits the same edit gives under eager; without hooks
    the forward is the sdpa model's own, bitwise."""
    config = small_config()
    model = seeded_model(config, 0)
    assert model.config._attn_implementation == "sdpa"
    ids, mask = left_padded(config.vocab_size)
    valid = mask.bool()

    def uniform(p, hook):
        return (p > 0).to(p.dtype) / (p > 0).sum(-1, keepdim=True).clamp(min=1)

    edit = [("blocks.0.attn.hook_pattern", uniform)]
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        with wrapped(model) as hm:
            _, cache = hm.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=lambda n: "pattern" in n)
            sdpa_edited = hm.run_with_hooks(input_ids=ids, attention_mask=mask, fwd_hooks=edit)
            assert model.config._attn_implementation == "sdpa"
            assert torch.equal(hm(input_ids=ids, attention_mask=mask).logits, own)
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        with wrapped(model) as hm:
            eager_edited = hm.run_with_hooks(input_ids=ids, attention_mask=mask, fwd_hooks=edit)
    for layer in range(config.n_layer):
        ours, theirs = cache["pattern", layer], eager.attentions[layer]
        rows = valid[:, None, :, None].expand_as(ours)
        assert torch.allclose(ours[rows], theirs[rows], atol=1e-6)
    assert torch.allclose(sdpa_edited[valid], eager_edited[valid], atol=1e-5)
    assert (sdpa_edited - own)[valid].abs().max().item() > 1e-4


@pytest.mark.skipif(
    not lensadapters_gptj._own_attention(), reason="transformers >= 5.24: GPT-J has no _attn to override"
)
def test_attn_override_is_scoped_to_hooked_layers_and_undone():
    config = small_config()
    model, other = make_model(config), make_model(config, seed=1)
    ids, mask = left_padded(config.vocab_size)
    class_attn = hf.GPTJAttention.__dict__["_attn"]
    attn = [block.attn for block in model.transformer.h]
    with torch.no_grad():
        reference = other(input_ids=ids, attention_mask=mask).logits
        with wrapped(model) as hm:
            hm.run_with_cache(
                input_ids=ids, attention_mask=mask, names_filter=lambda n: "pattern" not in n and "scores" not in n
            )
            assert not any("_attn" in vars(a) for a in attn), "no pattern hook, yet _attn was overridden"
            seen = {}

            def check(t, hook):
                seen["inside"] = ["_attn" in vars(a) for a in attn]
                return None

            with hm.hooks([("blocks.1.attn.hook_pattern", check)]):
                assert ["_attn" in vars(a) for a in attn] == [False, True]
                hm(input_ids=ids, attention_mask=mask)
                # the class and another GPT-J instance are untouched
                assert hf.GPTJAttention.__dict__["_attn"] is class_attn
                assert not any("_attn" in vars(b.attn) for b in other.transformer.h)
                assert torch.equal(other(input_ids=ids, attention_mask=mask).logits, reference)
            assert seen["inside"] == [False, True]
            assert not any("_attn" in vars(a) for a in attn)
            hm.add_hook("blocks.0.attn.hook_attn_scores", lambda t, hook: None, is_permanent=True)
            assert "_attn" in vars(attn[0])
        assert not any("_attn" in vars(a) for a in attn), "unwrap left the override behind"


def test_pattern_edit_and_reading_match_hf_attentions():
    """A read-only pattern hook sees what HF returns as attentions; a uniform pattern changes the output."""
    config = small_config()
    model = make_model(config)
    ids, mask = left_padded(config.vocab_size)
    valid = mask.bool()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        with wrapped(model) as hm:
            _, cache = hm.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=lambda n: "pattern" in n)
            for layer in range(config.n_layer):
                ours, theirs = cache["pattern", layer], reference.attentions[layer]
                rows = valid[:, None, :, None].expand_as(ours)
                assert torch.allclose(ours[rows], theirs[rows], atol=1e-6)
            logits = hm.run_with_hooks(
                input_ids=ids,
                attention_mask=mask,
                fwd_hooks=[
                    (
                        "blocks.0.attn.hook_pattern",
                        lambda p, hook: (p > 0).to(p.dtype) / (p > 0).sum(-1, keepdim=True).clamp(min=1),
                    )
                ],
            )
            assert (logits - reference.logits)[valid].abs().max().item() > 1e-4


@pytest.mark.skipif(
    not lensadapters_gptj._own_attention(), reason="transformers >= 5.24: GPT-J has no _attn to override"
)
def test_pattern_hooks_need_eager_attention():
    """A GPT-J attention whose forward is not GPTJAttention's (flash-attention 2) cannot serve patterns."""

    class OtherAttention(hf.GPTJAttention):
        def forward(self, *args, **kwargs):  # computes attention some other way, never calling _attn
            return super().forward(*args, **kwargs)

    config = small_config(n_layer=1)
    model = make_model(config)
    block = model.transformer.h[0]
    replacement = OtherAttention(config, layer_idx=0)
    replacement.load_state_dict(block.attn.state_dict())
    block.attn = replacement  # the test builds its own unusual model; lensadapters never does this
    ids, mask = left_padded(config.vocab_size)
    with wrapped(model) as hm:
        hm.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=lambda n: "hook_z" in n)  # fine
        with pytest.raises(UnsupportedModelError, match="attn_implementation='eager'"):
            with hm.hooks([("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
                pass
        assert "_attn" not in vars(replacement)


@pytest.mark.skipif(
    not lensadapters_gptj._own_attention(), reason="transformers >= 5.24: GPT-J has no _attn to override"
)
def test_an_existing_instance_override_is_not_clobbered():
    config = small_config(n_layer=1)
    model = make_model(config)
    attn = model.transformer.h[0].attn
    theirs = attn._attn
    attn._attn = theirs  # someone else's per-instance override
    with wrapped(model) as hm:
        with pytest.raises(LensAdaptersError, match="already has an instance attribute '_attn'"):
            with hm.hooks([("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
                pass
    assert vars(attn)["_attn"] is theirs


# --- the shared norm ------------------------------------------------------------------------------------------


def test_shared_norm_points_and_edits():
    config = small_config()
    model = make_model(config)
    ids, mask = left_padded(config.vocab_size)
    valid = mask.bool()
    with wrapped(model) as hm, torch.no_grad():
        names = hm.hook_names
        for i in range(config.n_layer):
            for absent in ("hook_resid_mid", "hook_mlp_in", "ln2.hook_scale", "ln2.hook_normalized"):
                assert f"blocks.{i}.{absent}" not in names
        assert hm.cfg.parallel_attn_mlp and hm.cfg.rotary_dim == 4 and hm.cfg.extra["rotary_adjacent_pairs"]
        watch = ["blocks.0.hook_attn_out", "blocks.0.hook_mlp_out", "blocks.0.ln1.hook_normalized"]
        _, base = hm.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=watch)
        # the MLP reads ln_1's output
        mlp = model.transformer.h[0].mlp
        assert torch.allclose(base["mlp_out", 0], mlp(base["blocks.0.ln1.hook_normalized"]), atol=1e-5)
        with hm.hooks([("blocks.0.ln1.hook_normalized", lambda t, hook: t * 1.5)]):
            _, edited = hm.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=watch)
        for name in ("attn_out", "mlp_out"):
            assert (edited[name, 0] - base[name, 0])[valid].abs().max().item() > 1e-4, f"ln1 edit missed {name}"


# --- discovery --------------------------------------------------------------------------------------------------


def test_found_through_its_entry_point():
    reg = Registry()
    reg.load_entry_points()
    info = reg.infos.get("gptj")
    assert info is not None, f"the gptj entry point was not loaded: {reg.failures}"
    assert info.distribution == "lensadapters-gptj" and info.source == "entry point"
    assert info.plugin is lensadapters_gptj
    model = make_model(small_config(n_layer=1))
    hm = HookedModel.wrap(model, registry=reg)
    try:
        assert hm.arch.name == "gptj"
    finally:
        hm.unwrap()


def test_listed_by_the_cli_and_checked_with_its_declared_contract(monkeypatch, capsys):
    import json

    import lensadapters.registry as registry_module
    from lensadapters import cli
    from lensadapters.check import contract_class

    monkeypatch.setattr(registry_module, "_DEFAULT", None)  # a fresh, autoloaded registry
    monkeypatch.delenv(registry_module.DISABLE_AUTOLOAD_ENV, raising=False)
    assert cli.main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["gptj"]["distribution"] == "lensadapters-gptj"
    assert rows["gptj"]["architectures"][0]["model_types"] == ["gptj"]
    contract_class.cache_clear()
    assert contract_class("gptj") is GPTJContract and issubclass(TestGPTJ, GPTJContract)
    contract_class.cache_clear()


@pytest.mark.skipif(_TRANSFORMERS_5, reason="transformers 5 requires an int rotary_dim")
def test_rotary_dim_none_with_several_heads_is_refused():
    """transformers 4.57 builds an n_embd-wide sin/cos table for rotary_dim=None, which only fits one head."""
    model = AutoModelForCausalLM.from_config(small_config(rotary_dim=None))
    with pytest.raises(UnsupportedModelError, match="set rotary_dim=d_head"):
        HookedModel.wrap(model, registry=registry())
