"""TransformerLens' HookedRootModule surface as its clients use it (sae-dashboard, auto-circuit, sae-bench): hook
point contexts, ``mod_dict``/``hook_points()``, TransformerLens' hook-removal signatures, the ``cfg`` fields and
``set_use_*`` switches they read, and hook points as modules a client replaces or hooks."""

from __future__ import annotations

from functools import reduce
from typing import Any

import pytest
import torch
from torch import nn

from lensadapters import HookedModel, HookPoint
from lensadapters.testing.tiny_models import tiny

ARCH = "llama"
POINT = "blocks.1.hook_resid_pre"


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 5, 9, 3, 7]])


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


# --- item 1: the HookedRootModule surface ------------------------------------------------------------------------


def test_ctx_is_per_point_and_reset_hooks_clears_it() -> None:
    hm = HookedModel.wrap(tiny(ARCH))
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]

    def store(t: torch.Tensor, hook: HookPoint) -> None:  # sae-dashboard's hook_fn_store_act
        hook.ctx["activation"] = t

    with torch.no_grad():
        _, cache = hm.run_with_cache(_ids(), names_filter=names)
        hm.run_with_hooks(_ids(), fwd_hooks=[(n, store) for n in names])
    for name in names:
        assert torch.equal(hm.hook_dict[name].ctx.pop("activation"), cache[name])
    assert hm.hook_dict["blocks.0.hook_resid_pre"].ctx == {}
    hm.hook_dict[names[0]].ctx["x"] = 1
    hm.reset_hooks(clear_contexts=False)
    assert hm.hook_dict[names[0]].ctx == {"x": 1}
    hm.reset_hooks()  # clear_contexts=True by default, as TransformerLens
    assert all(p.ctx == {} for p in hm.hook_points())
    hm.hook_dict[names[0]].ctx["x"] = 1
    hm.hook_dict[names[0]].clear_context()
    assert hm.hook_dict[names[0]].ctx == {}
    hm.unwrap()


def test_mod_dict_hook_points_perma_hooks_and_removal_by_direction() -> None:
    hm = HookedModel.wrap(tiny(ARCH))
    assert list(hm.mod_dict) == hm.hook_names and list(hm.hook_points()) == list(hm.hook_dict.values())
    seen: list[str] = []
    hm.add_perma_hook("blocks.0.hook_resid_pre", lambda t, hook: seen.append("perma"))
    hm.hook_dict["blocks.0.hook_mlp_out"].add_perma_hook(lambda t, hook: seen.append("point perma"))
    hm.add_hook("blocks.0.hook_resid_post", lambda t, hook: seen.append("fwd"))
    hm.add_hook("blocks.0.hook_resid_post", lambda g, hook: seen.append("bwd"), dir="bwd")
    hm.reset_hooks(direction="fwd")  # TransformerLens' signature: only forward hooks go
    fwd = [e for p in hm.hook_points() for e in p.fwd_hooks]
    bwd = [e for p in hm.hook_points() for e in p.bwd_hooks]
    assert len(fwd) == 2 and all(e.permanent for e in fwd) and len(bwd) == 1
    hm.remove_all_hook_fns(direction="bwd")
    assert not any(p.bwd_hooks for p in hm.hook_points())
    hm.remove_all_hook_fns()  # permanent ones stay
    with torch.no_grad():
        hm(_ids())
    assert seen == ["perma", "point perma"]
    hm.remove_all_hook_fns(including_permanent=True)
    assert not hm.has_hooks
    with pytest.raises(ValueError, match="direction"):
        hm.remove_all_hook_fns("sideways")
    hm.unwrap()


def test_cfg_reports_what_is_served_and_set_use_switches_are_no_ops() -> None:
    hm = HookedModel.wrap(tiny(ARCH), tokenizer=None)
    cfg = hm.cfg
    names = hm.hook_names
    assert cfg.use_attn_result == any(n.endswith(".attn.hook_result") for n in names) is True
    assert cfg.use_split_qkv_input is True and "blocks.0.hook_q_input" in names
    assert cfg.use_hook_mlp_in is True and "blocks.0.hook_mlp_in" in names
    assert cfg.use_attn_in is any(n.endswith(".hook_attn_in") for n in names)  # not served: False
    assert cfg.attn_only is False and cfg.parallel_attn_mlp is False
    assert cfg.positional_embedding_type == "rotary"
    assert cfg.original_architecture == type(hm.hf_model).__name__
    assert cfg.model_name == type(hm.hf_model).__name__  # a model built from a config has no name_or_path
    hm.hf_model.config.name_or_path = "org/some-model"
    assert cfg.model_name == "some-model"
    assert cfg.default_prepend_bos is True and cfg.tokenizer_prepends_bos is None
    hm.default_prepend_bos = False
    assert cfg.default_prepend_bos is False
    before = hm.run_with_cache(_ids())[1]
    for switch in ("set_use_attn_result", "set_use_split_qkv_input", "set_use_attn_in", "set_use_hook_mlp_in"):
        getattr(hm, switch)(True)
        getattr(hm, switch)(False)
    cfg.use_attn_result = True  # auto-circuit's loaders set these on cfg
    cfg.use_split_qkv_input = True
    assert cfg.use_attn_result is True
    with pytest.raises(AttributeError):
        cfg.n_layers = 3  # the rest of cfg stays frozen
    after = hm.run_with_cache(_ids())[1]
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    hm.unwrap()


# --- item 2: hook points as modules a client replaces or hooks ------------------------------------------------------


def _module_by_name(model: Any, name: str) -> Any:  # as auto-circuit's utils.misc
    return reduce(getattr, [model, *name.split(".")])


def _set_module_by_name(model: Any, name: str, module: Any) -> None:
    parent = reduce(getattr, [model, *name.split(".")[:-1]]) if "." in name else model
    setattr(parent, name.split(".")[-1], module)


class PatchWrapper(nn.Module):
    """A minimal replica of auto-circuit's PatchWrapperImpl: edits its input, calls the wrapped hook point, and
    records and edits what it returns."""

    def __init__(self, module: Any, delta: torch.Tensor) -> None:
        super().__init__()
        self.module = module
        self.delta = nn.Parameter(delta)
        self.seen: list[torch.Tensor] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        arg_0 = args[0].clone()
        arg_0 += self.delta
        out = self.module(arg_0, *args[1:], **kwargs)
        self.seen.append(out.detach())
        return out * 2


@pytest.mark.parametrize("name", [POINT, "blocks.0.attn.hook_z", "hook_embed"])
def test_replaced_hook_point_runs_the_clients_module(name: str) -> None:
    hm = HookedModel.wrap(tiny(ARCH))
    modules_before = [(n, id(m)) for n, m in hm.hf_model.named_modules()]
    ids = _ids()
    with torch.no_grad():
        clean = hm(ids).logits
    original = _module_by_name(hm, name)
    assert original is hm.hook_dict[name]
    shape = hm.run_with_cache(ids, names_filter=name)[1][name].shape[2:]
    delta = torch.randn(shape)

    def plain(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        return (t + delta) * 2

    with torch.no_grad():
        expected = _logits(hm.run_with_hooks(ids, fwd_hooks=[(name, plain)]))

    wrapper = PatchWrapper(original, delta.clone())
    _set_module_by_name(hm, name, wrapper)
    assert _module_by_name(hm, name) is wrapper and hm.hook_dict[name] is original  # as TransformerLens' hook_dict
    inner: list[torch.Tensor] = []
    hm.add_hook(name, lambda t, hook: inner.append(t.detach()))  # a hook on the original point sees the wrapper's input
    outer: list[torch.Tensor] = []
    handle = wrapper.register_forward_hook(lambda mod, inp, out: outer.append(out.detach()))
    with torch.no_grad():
        torch.testing.assert_close(hm(ids).logits, expected, rtol=0, atol=0)
    assert len(inner) == len(wrapper.seen) == len(outer) == 1
    torch.testing.assert_close(outer[0], wrapper.seen[0] * 2, rtol=0, atol=0)
    torch.testing.assert_close(inner[0], wrapper.seen[0], rtol=0, atol=0)
    handle.remove()
    hm.reset_hooks()
    assert _module_by_name(hm, name) is wrapper  # reset_hooks leaves a replaced module, as on TransformerLens
    assert [(n, id(m)) for n, m in hm.hf_model.named_modules()] == modules_before  # nothing inserted into the model
    _set_module_by_name(hm, name, wrapper.module)  # auto-circuit's unwrapping puts the original back
    assert not hm.has_hooks
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, clean)
    hm.unwrap()


def test_replacement_gradient_equals_plain_hook_gradient() -> None:
    hm = HookedModel.wrap(tiny(ARCH))
    ids = _ids()
    shape = hm.run_with_cache(ids, names_filter=POINT)[1][POINT].shape[2:]
    delta = torch.randn(shape, requires_grad=True)
    loss = _logits(hm.run_with_hooks(ids, fwd_hooks=[(POINT, lambda t, hook: (t + delta) * 2)])).square().sum()
    (expected,) = torch.autograd.grad(loss, delta)
    wrapper = PatchWrapper(hm.hook_dict[POINT], delta.detach().clone())
    _set_module_by_name(hm, POINT, wrapper)
    hm(ids).logits.square().sum().backward()
    torch.testing.assert_close(wrapper.delta.grad, expected)
    hm.hook_dict[POINT].replace(None)
    hm.unwrap()


def test_register_forward_hook_on_a_hook_point() -> None:
    hm = HookedModel.wrap(tiny(ARCH))
    ids = _ids()
    point = hm.blocks[1].hook_resid_pre
    calls: list[Any] = []

    def torch_hook(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        calls.append((module, args[0] is out))
        return out + 1

    with torch.no_grad():
        expected = _logits(hm.run_with_hooks(ids, fwd_hooks=[(POINT, lambda t, hook: t + 1)]))
        handle = point.register_forward_hook(torch_hook)
        hm.reset_hooks(including_permanent=True)  # PyTorch hooks are removed by their handle only
        assert torch.equal(hm(ids).logits, expected) and calls == [(point, True)]
        handle.remove()
        assert not hm.has_hooks
    hm.unwrap()


def test_replacing_something_that_is_no_hook_point() -> None:
    hm = HookedModel.wrap(tiny(ARCH))
    with pytest.raises(AttributeError, match="only hook points"):
        hm.blocks[0].attn.not_a_point = nn.Identity()
    with pytest.raises(TypeError, match="replaced by a module"):
        hm.blocks[0].hook_resid_pre = 3
    assert getattr(hm.blocks, "0").hook_resid_pre is hm.hook_dict["blocks.0.hook_resid_pre"]
    hm.unwrap()


def test_unwrap_with_a_replaced_point_and_a_torch_hook_leaves_the_model_bare() -> None:
    model = tiny(ARCH)
    ids = _ids()
    with torch.no_grad():
        clean = model(ids).logits
    hm = HookedModel.wrap(model)
    hm.blocks[0].hook_resid_post = PatchWrapper(hm.hook_dict["blocks.0.hook_resid_post"], torch.ones(()))
    hm.hook_dict["blocks.1.hook_resid_pre"].register_forward_hook(lambda mod, inp, out: out * 3)
    with torch.no_grad():
        assert not torch.equal(hm(ids).logits, clean)
    assert hm.unwrap() is model
    assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, clean)
