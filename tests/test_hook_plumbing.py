"""Hook plumbing: what an interrupted forward, a gradient-checkpointed backward and the gradient of a score edit
leave behind."""

from __future__ import annotations

import gc
import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lensadapters import HookedModel
from lensadapters.testing import reinit


def _llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    reinit(model, seed)
    return model.eval()


def _gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=40, n_positions=16))
    reinit(model, seed)
    return model.eval()


MODELS = {"llama": _llama, "gpt2": _gpt2}
IDS = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit])
@pytest.mark.parametrize("how", ["run_with_hooks", "run_with_cache", "hooks block"])
def test_a_base_exception_in_a_hooked_forward_leaves_no_frame_and_no_hooks(error: type, how: str) -> None:
    """PyTorch runs ``always_call`` forward hooks (which close the forward's frame) for ``Exception`` only: a
    ``KeyboardInterrupt`` must not leave the frame open and the sites installed."""
    model = _llama()
    baseline = hook_count(model)
    hm = HookedModel.wrap(model)

    def interrupt(t: torch.Tensor, hook: Any) -> None:
        raise error()

    hooks = [("blocks.1.attn.hook_pattern", interrupt), ("blocks.0.hook_resid_post", lambda t, hook: t * 1.0)]
    with torch.no_grad(), pytest.raises(error):
        if how == "run_with_hooks":
            hm.run_with_hooks(IDS, fwd_hooks=hooks)
        elif how == "run_with_cache":
            with hm.hooks(hooks[:1]):
                hm.run_with_cache(IDS)
        else:
            with hm.hooks(hooks):
                hm.model(IDS)  # the Hugging Face model itself, inside a hooks() block
    assert hm.wiring.forward_state.open_frames == 0, "the interrupted forward's frame is still open"
    assert not hm.has_hooks
    assert hook_count(model) == baseline, "the interrupted forward left PyTorch hooks on the model"
    with torch.no_grad():  # and the model works as before
        _, cache = hm.run_with_cache(IDS, names_filter="blocks.0.hook_resid_post")
    assert hook_count(model) == baseline
    hm.unwrap()


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("keep_loss", [True, False])
def test_gradient_checkpointing_backward_leaves_no_hooks(arch: str, reentrant: bool, keep_loss: bool) -> None:
    """After ``run_with_hooks`` + ``backward()`` under gradient checkpointing (training mode), the hooks the
    recomputation needed go once the backward has freed the graph, even while the caller keeps the loss: no
    PyTorch hook is left on any module (pay only for what you hook). With ``retain_graph=True`` they stay until
    the last backward."""
    model = MODELS[arch](1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    baseline = hook_count(model)
    hm = HookedModel.wrap(model)
    edits = [("blocks.0.hook_resid_mid", lambda t, hook: t * 1.5), ("blocks.1.mlp.hook_post", lambda t, hook: -t)]
    loss = hm.run_with_hooks(IDS, fwd_hooks=edits).float().pow(2).mean()
    assert hook_count(model) > baseline, "the recomputation's sites must stay until backward"
    loss.backward(retain_graph=True)
    assert hook_count(model) > baseline, "a retained graph may be recomputed again: its sites stay"
    loss.backward()
    if not keep_loss:
        del loss
        gc.collect()
    assert hook_count(model) == baseline, "hooks left installed after the graph was freed"
    assert not hm.has_hooks
    hm.unwrap()


@pytest.mark.parametrize(
    "arch, impl, dtype",
    [("llama", "sdpa", torch.float32), ("gpt2", "sdpa", torch.float32), ("gpt2", "eager", torch.float64)],
)  # (transformers' own eager Llama in float64 spreads nan from padding rows: no reference there)
def test_the_gradient_of_a_score_edit_is_finite_under_left_padding(arch: str, impl: str, dtype: torch.dtype) -> None:
    """A padding query's row of scores is all ``-inf``: its softmax is nan, and so was the backward of every score
    of the batch through ``hook_attn_scores`` (an edit ``x + p * c`` had a nan derivative). Under eager attention in
    float64 the model's own mask overflows to ``-inf`` for such rows too (the row as eager attention fills it)."""
    model = MODELS[arch](2).to(dtype)
    model.set_attn_implementation(impl)
    hm = HookedModel.wrap(model)
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0
    p = torch.zeros((), requires_grad=True)
    c = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(0), dtype=dtype)
    logits = hm.run_with_hooks(
        IDS, attention_mask=mask, fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda t, hook: t + p * c)]
    )
    logits[mask.bool()].sum().backward()
    assert p.grad is not None and torch.isfinite(p.grad), p.grad
    hm.unwrap()


def test_a_generator_as_names_filter_is_read_once_and_cached() -> None:
    hm = HookedModel.wrap(_gpt2())
    wanted = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_pattern"]
    with torch.no_grad():
        _, cache = hm.run_with_cache(IDS, names_filter=(name for name in wanted))
        assert sorted(cache) == sorted(wanted)
        seen: list[str] = []
        hm.run_with_hooks(IDS, fwd_hooks=[((n for n in wanted), lambda t, hook: seen.append(hook.name))])
    assert seen == wanted
    hm.unwrap()


def test_a_hook_returning_a_meta_tensor_is_refused_naming_the_point() -> None:
    from lensadapters.errors import HookReturnError

    hm = HookedModel.wrap(_gpt2())
    with torch.no_grad(), pytest.raises(HookReturnError, match=r"blocks\.0\.hook_resid_post.*meta tensor"):
        hm.run_with_hooks(IDS, fwd_hooks=[("blocks.0.hook_resid_post", lambda t, hook: t.to("meta"))])
    assert not hm.has_hooks
    hm.unwrap()


def test_a_block_point_asked_of_the_cache_without_a_layer_says_a_layer_is_needed() -> None:
    hm = HookedModel.wrap(_gpt2())
    with torch.no_grad():
        _, cache = hm.run_with_cache(IDS)
    for key in ("pattern", "resid_pre", ("z",)):
        short = key if isinstance(key, str) else key[0]
        with pytest.raises(KeyError, match=re.escape(f"cache[{short!r}, 0]")):
            cache[key]
    with pytest.raises(KeyError, match="not in the cache"):  # an unknown name is still just unknown
        cache["no_such_point"]
    assert torch.equal(cache["pattern", 0], cache["blocks.0.attn.hook_pattern"])
    hm.unwrap()


def test_plugins_lists_the_plugins_that_failed_to_load_with_why(capsys, monkeypatch) -> None:
    import json
    import sys
    import types
    from importlib import metadata

    from lensadapters import registry as registry_module
    from lensadapters.cli import main

    broken = types.ModuleType("lensadapters_broken_example")

    def missing(name: str) -> Any:
        raise ImportError("lensadapters_broken_example needs somelib>=2")

    broken.__getattr__ = missing  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "lensadapters_broken_example", broken)
    entry = metadata.EntryPoint(name="broken_example", value="lensadapters_broken_example:plugin", group="lensadapters")
    monkeypatch.setattr(registry_module, "_entry_points", lambda: [entry])
    registry = registry_module.Registry()
    with pytest.warns(registry_module.PluginLoadWarning, match="broken_example"):
        registry.load_entry_points()
    monkeypatch.setattr(registry_module, "_DEFAULT", registry)
    assert main(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    listed = [row for row in rows if row and row[0] == "broken_example"]
    assert listed and "failed" in listed[0], rows
    assert main(["plugins", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = [row for row in out["plugins"] if row["name"] == "broken_example"]
    assert row["kind"] == "failed" and "needs somelib>=2" in row["error"], row


class _ZeroingPlugin:
    """A cross-cutting plugin that answers for plain ``nn.Linear`` layers (and ``W_Q``) without declaring them."""

    @staticmethod
    def lensadapters_linear_weight(module: torch.nn.Module, read: Any) -> Any:
        from lensadapters import LinearWeight

        if isinstance(module, torch.nn.Linear):
            return LinearWeight(torch.zeros_like(module.weight.T), None)
        return None

    @staticmethod
    def lensadapters_weight(arch: Any, hooked: Any, name: str) -> Any:
        return (
            torch.zeros(hooked.cfg.n_layers, hooked.cfg.n_heads, hooked.cfg.d_model, hooked.cfg.d_head)
            if (name == "W_Q")
            else None
        )


def _zeroing_plugin(layers: Any = None) -> Any:
    import types

    from lensadapters import hookimpl

    plugin = types.ModuleType("zeroing_example")
    plugin.lensadapters_linear_weight = hookimpl(_ZeroingPlugin.lensadapters_linear_weight)  # type: ignore[attr-defined]
    plugin.lensadapters_weight = hookimpl(_ZeroingPlugin.lensadapters_weight)  # type: ignore[attr-defined]
    if layers is not None:
        plugin.LENSADAPTERS_LAYERS = layers  # type: ignore[attr-defined]
    return plugin


def test_a_cross_cutting_plugin_supplies_weights_only_for_the_layers_it_declares() -> None:
    """A cross-cutting plugin answering ``lensadapters_linear_weight`` for plain ``nn.Linear`` layers (and
    ``lensadapters_weight`` for ``W_Q``) without declaring them in ``LENSADAPTERS_LAYERS`` is warned about by name
    and not used: the weights are the core's. Declaring the layers makes its answers count."""
    from lensadapters.adapters.layer_claims import UndeclaredLayerWarning
    from lensadapters.testing import registry_for

    model = _llama()
    reference = HookedModel.wrap(model, registry=registry_for("llama"))
    expected_q, expected_o = reference.W_Q.detach().clone(), reference.W_O.detach().clone()
    reference.unwrap()
    registry = registry_for("llama")
    registry.register(_zeroing_plugin(), "zeroing_example")
    hm = HookedModel.wrap(model, registry=registry)
    with pytest.warns(UndeclaredLayerWarning, match="zeroing_example") as record:
        W_Q, W_O = hm.W_Q, hm.W_O
    assert torch.equal(W_Q, expected_q) and torch.equal(W_O, expected_o), "an undeclared plugin's weights were used"
    messages = [str(w.message) for w in record if issubclass(w.category, UndeclaredLayerWarning)]
    assert any("answered lensadapters_weight" in m for m in messages), messages
    assert any("answered lensadapters_linear_weight" in m for m in messages), messages
    hm.unwrap()
    declared = registry_for("llama")
    declared.register(_zeroing_plugin(("torch.nn.modules.linear.Linear",)), "zeroing_example")
    hm = HookedModel.wrap(model, registry=declared)
    assert not hm.W_O.any(), "a declared layer's weights come from the plugin that declares it"
    hm.unwrap()


def test_a_malformed_layer_declaration_is_refused_at_registration() -> None:
    from lensadapters.errors import PluginValidationError
    from lensadapters.registry import Registry

    with pytest.raises(PluginValidationError, match="LENSADAPTERS_LAYERS"):
        Registry().register(_zeroing_plugin("torch.nn."), "zeroing_example")
