"""``as_hooked_transformer``: a HookedModel handed to tools that check ``isinstance(model, HookedTransformer)``."""

from __future__ import annotations

from functools import reduce
from typing import Any

import pytest
import torch
from torch import nn

from lensadapters import HookedModel, HookPoint
from lensadapters.testing.tiny_models import tiny

tl = pytest.importorskip("transformer_lens")

from lensadapters.integrations.transformer_lens import as_hooked_transformer, hooked_model_of  # noqa: E402


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 1]])


def test_view_passes_isinstance_and_delegates_without_copying() -> None:
    hm = HookedModel.wrap(tiny("llama"))
    view = as_hooked_transformer(hm)
    assert isinstance(view, tl.HookedTransformer) and isinstance(view, tl.hook_points.HookedRootModule)
    assert isinstance(view, nn.Module) and hooked_model_of(view) is hm
    # no weights: the view's parameters are the Hugging Face model's own tensors, and it has no modules of its own
    assert [p for p in view.parameters()] == [p for p in hm.hf_model.parameters()]
    assert view.__dict__["_modules"] == {} and view.__dict__["_parameters"] == {}
    assert view.cfg is hm.cfg and view.hook_dict == hm.hook_dict and view.tokenizer is hm.tokenizer
    assert view.blocks[1].attn.hook_z is hm.hook_dict["blocks.1.attn.hook_z"]
    ids = _ids()
    with torch.no_grad():
        logits, cache = view.run_with_cache(ids)
        hm_logits, hm_cache = hm.run_with_cache(ids)
        assert torch.equal(logits, hm_logits) and list(cache) == list(hm_cache)
        assert all(torch.equal(cache[k], hm_cache[k]) for k in hm_cache)
        assert torch.equal(view(ids), hm(ids, return_type="logits"))  # calling it is TransformerLens' forward
        assert torch.equal(view(ids, stop_at_layer=1), hm(ids, stop_at_layer=1))

        def edit(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
            return t * 0.5

        edited = view.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_post", edit)])
        assert torch.equal(edited, hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_post", edit)]))
        assert not torch.equal(edited, logits)
        view.add_hook("blocks.0.hook_resid_post", edit)  # hooks added through the view are hm's
        assert hm.has_hooks and torch.equal(hm(ids, return_type="logits"), edited)
        view.reset_hooks()
        assert not hm.has_hooks
    hm.unwrap()


def test_view_attributes_set_and_modules_replaced_act_on_the_hooked_model() -> None:
    hm = HookedModel.wrap(tiny("llama"))
    view = as_hooked_transformer(hm)
    view.default_prepend_bos = False
    assert hm.default_prepend_bos is False and view.cfg.default_prepend_bos is False
    name = "blocks.1.hook_resid_pre"
    seen: list[torch.Tensor] = []

    class Recorder(nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return self.inner(x)

    parent = reduce(getattr, [view, *name.split(".")[:-1]])  # auto-circuit's set_module_by_name
    setattr(parent, name.rsplit(".", 1)[1], Recorder(hm.hook_dict[name]))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(_ids(), names_filter=name)
    assert len(seen) == 1 and torch.equal(seen[0], cache[name])
    hm.hook_dict[name].replace(None)

    class Holder(nn.Module):  # sae-dashboard's TransformerLensWrapper keeps the model as a submodule
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

    holder = Holder(view).to("cpu")
    assert holder.model is view and isinstance(holder.model, tl.HookedTransformer)
    with pytest.raises(AttributeError, match="runs none of TransformerLens' own code"):
        view.load_and_process_state_dict  # noqa: B018 - a HookedTransformer method the HookedModel lacks
    hm.unwrap()


def test_view_of_a_subclass_and_refusals() -> None:
    hm = HookedModel.wrap(tiny("llama"))
    sae_lens = pytest.importorskip("sae_lens")
    view = as_hooked_transformer(hm, base=sae_lens.HookedSAETransformer)
    assert isinstance(view, sae_lens.HookedSAETransformer) and isinstance(view, tl.HookedTransformer)
    assert type(as_hooked_transformer(hm, base=sae_lens.HookedSAETransformer)) is type(view)
    with pytest.raises(TypeError, match="subclass of it"):
        as_hooked_transformer(hm, base=nn.Module)
    with pytest.raises(TypeError, match="takes a lensadapters HookedModel"):
        as_hooked_transformer(nn.Linear(2, 2))
    hm.unwrap()
