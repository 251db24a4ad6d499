"""Helpers of the branch-point tests (:mod:`lensadapters.adapters.generic.parallel`): tiny seeded models of a
``model_type``, plain-PyTorch records of HF modules' inputs and outputs, and the same edits made by plain hooks doing
the layer's own sums (the independent reference the served points are compared with)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel, Registry
from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.testing.every_model_type import input_ids, shrink_config

Tensor = torch.Tensor


def tiny_model(model_type: str, **config: Any) -> torch.nn.Module:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this transformers")
    c = shrink_config(AutoConfig.for_model(model_type))
    for key, value in config.items():
        if key == "layer_types" and transformers.__version__.startswith("4."):  # 4.x's names of the kinds
            value = [{"linear_attention": "mamba"}.get(v, "attention") for v in value]
        setattr(c, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(c, torch_dtype=torch.float32).eval()
    for p in model.parameters():  # weights of one scale (the default init leaves some near zero)
        p.data.normal_(0, 0.2) if p.dim() >= 2 else None
    return model


def wrap_generic(model: torch.nn.Module) -> HookedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        return HookedModel.wrap(model, registry=Registry())


def first_tensor(value: Any) -> Tensor:
    return value[0] if isinstance(value, tuple) else value


def record(model: torch.nn.Module, modules: dict[str, tuple[torch.nn.Module, str]]) -> dict[str, Tensor]:
    """Each module's input (``"in"``) or output (``"out"``) in one plain forward of ``model``."""
    seen: dict[str, Tensor] = {}
    handles = []
    for key, (module, side) in modules.items():
        if side == "in":
            handles.append(module.register_forward_pre_hook(lambda m, a, k=key: seen.__setitem__(k, a[0].clone())))
        else:
            handles.append(
                module.register_forward_hook(lambda m, a, o, k=key: seen.__setitem__(k, first_tensor(o).clone()))
            )
    with torch.no_grad():
        model(input_ids())
    for h in handles:
        h.remove()
    return seen


def logits_with(model: torch.nn.Module, install: Callable[[], list]) -> Tensor:
    handles = install()
    try:
        with torch.no_grad():
            return model(input_ids()).logits
    finally:
        for h in handles:
            h.remove()


def relative_error(got: Tensor, want: Tensor) -> float:
    """The largest difference, relative to the reference's largest magnitude."""
    return float((got - want).detach().abs().max() / want.detach().abs().max())


def seeded_delta(like: Tensor, seed: int) -> Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)


def add_to_output(module: torch.nn.Module, d: Tensor) -> Callable[[], list]:
    def hook(m: Any, a: Any, o: Any) -> Any:
        return (o[0] + d, *o[1:]) if isinstance(o, tuple) else o + d

    return lambda: [module.register_forward_hook(hook)]


def add_to_input(module: torch.nn.Module, d: Tensor) -> Callable[[], list]:
    return lambda: [module.register_forward_pre_hook(lambda m, a: (a[0] + d, *a[1:]))]


def resid_mid_edit(layer: torch.nn.Module, ln2: torch.nn.Module, mlp: list, d: Tensor) -> Callable[[], list]:
    """The model computing ``resid_mid + d``: what the norm reads and what the layer adds the MLP's output to."""
    state: dict[str, Tensor] = {}

    def pre(m: Any, a: Any) -> Any:
        state["mid"] = a[0] + d
        return (state["mid"], *a[1:])

    def mlp_out(m: Any, a: Any, o: Any) -> None:
        o = first_tensor(o)
        state["mlp"] = o if "mlp" not in state else state["mlp"] + o  # the layer's sum of its MLP modules

    def out(m: Any, a: Any, o: Any) -> Any:
        new = state["mid"] + state["mlp"]
        state.clear()
        return (new, *o[1:]) if isinstance(o, tuple) else new

    def install() -> list:
        return [ln2.register_forward_pre_hook(pre), layer.register_forward_hook(out)] + [
            m.register_forward_hook(mlp_out) for m in mlp
        ]

    return install


def edit_error(hm: HookedModel, reference: torch.nn.Module, name: str, d: Tensor, install: Callable) -> float:
    edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(name, lambda t, hook: t + d.reshape(t.shape))])
    expected = logits_with(reference, install)
    unchanged = logits_with(reference, lambda: [])
    assert not torch.equal(expected, unchanged), name  # the edit reaches the logits
    return float((edited.detach() - expected).abs().max())


def sum_edit(
    layer: torch.nn.Module,
    reader: torch.nn.Module,
    before: list[tuple[torch.nn.Module, float]],
    after: list[torch.nn.Module],
    after_scale: float,
    point: str,
    d: Tensor,
) -> Callable[[], list]:
    """The layer computing with one of its contributions edited (``d`` added), by plain hooks on its HF modules: the
    layer's own formula, ``mid = x + (o_0 * c_0 + o_1 * c_1)`` (the modules ``before`` with their multipliers, in the
    order it adds them), ``out = mid + (a_0 + a_1) * after_scale``; ``point`` is ``"before0"``, ``"before1"``,
    ``"mid"`` or ``"after"``. The norm ``reader`` gets the edited middle, the layer returns it plus the contribution
    after it."""
    state: dict[str, Any] = {}

    def times(t: Tensor, c: float) -> Tensor:
        return t * c if c != 1.0 else t

    def enter(m: Any, a: Any) -> None:
        state.clear()
        state.update(x=a[0], before=[], after=[])

    def on_before(k: int) -> Callable:
        def hook(m: Any, a: Any, o: Any) -> None:
            v = times(first_tensor(o), before[k][1])
            state["before"].append(v + d if point == f"before{k}" else v)

        return hook

    def on_reader(m: Any, a: Any) -> Any:
        parts = state["before"]
        mid = a[0]
        if point.startswith("before"):
            mid = state["x"] + (parts[0] + parts[1] if len(parts) == 2 else parts[0])
        if point == "mid":
            mid = mid + d
        state["mid"] = mid
        return (mid, *a[1:])

    def on_after(m: Any, a: Any, o: Any) -> None:
        state["after"].append(first_tensor(o))

    def out(m: Any, a: Any, o: Any) -> Any:
        parts = state["after"]
        total = times(parts[0] + parts[1] if len(parts) == 2 else parts[0], after_scale)
        new = state["mid"] + (total + d if point == "after" else total)
        return (new, *o[1:]) if isinstance(o, tuple) else new

    def install() -> list:
        handles = [layer.register_forward_pre_hook(enter), reader.register_forward_pre_hook(on_reader)]
        handles += [module.register_forward_hook(on_before(k)) for k, (module, _) in enumerate(before)]
        handles += [module.register_forward_hook(on_after) for module in after]
        return handles + [layer.register_forward_hook(out)]

    return install


def served_and_plain_gradients(
    hm: Any, model: torch.nn.Module, point: str, like: Tensor, plain: Callable[[Tensor], list]
) -> tuple[Tensor, Tensor]:
    """The gradients of ``mean(logits ** 2)`` with respect to a zero delta shaped ``like``, added at the served
    ``point`` and by plain hooks on the HF modules (``plain(delta)`` installs them and returns their handles), each
    checked present and the plain one non-zero; the model's own gradients cleared after."""
    from lensadapters.testing.every_model_type import input_ids

    served = torch.zeros_like(like, requires_grad=True)
    logits = hm.run_with_hooks(input_ids(), fwd_hooks=[(point, lambda t, hook: t + served.reshape(t.shape))])
    logits.float().pow(2).mean().backward()
    direct = torch.zeros_like(like, requires_grad=True)
    handles = plain(direct)
    try:
        model(input_ids()).logits.float().pow(2).mean().backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    assert direct.grad is not None and served.grad is not None and direct.grad.abs().max() > 0
    return served.grad, direct.grad


def edit_gradients(model_type: str, config: dict, point: str, checkpointing: Any) -> dict[str, Any]:
    """The gradients of every parameter and of a leaf ``delta`` added at ``point`` (``[b, p, d_model]``, per head
    for ``attn.hook_result``) of ``sum(logits ** 2)``, the model in train mode with gradient checkpointing
    (``checkpointing``: whether reentrant; ``None``: none)."""
    from lensadapters.testing.every_model_type import input_ids

    model: Any = tiny_model(model_type, **config)
    hm: Any = wrap_generic(model)
    assert point in hm.hook_dict, point
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    ids = input_ids(1)
    heads = (int(model.config.num_attention_heads),) if point.endswith("hook_result") else ()
    g = torch.Generator().manual_seed(2)
    delta = 0.3 * torch.randn(1, ids.shape[1], *heads, int(model.config.hidden_size), generator=g)
    delta.requires_grad_(True)
    try:
        logits = hm.run_with_hooks(ids, use_cache=False, fwd_hooks=[(point, lambda t, hook: t + delta)])
        getattr(logits, "logits", logits).square().sum().backward()
    finally:
        hm.unwrap()
    return {"delta": delta.grad} | {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_checkpointed_gradients_match(model_type: str, config: dict, point: str, reentrant: bool) -> None:
    """Every gradient of :func:`edit_gradients` under checkpointing within 1e-5 of the largest of the unchecked
    run's, none missing."""
    unchecked = edit_gradients(model_type, config, point, None)
    checked = edit_gradients(model_type, config, point, reentrant)
    assert unchecked["delta"] is not None and unchecked["delta"].abs().sum() > 0
    assert sorted(checked) == sorted(unchecked)
    top = max(g.abs().max().item() for g in unchecked.values())
    worst = max((checked[n] - g).abs().max().item() for n, g in unchecked.items()) / top
    assert worst < 1e-5, f"{model_type} {point}: {worst:.3g} of the largest gradient ({top:.3g})"
