"""Helpers of the branch-point tests (:mod:`lensadapters.adapters.generic.parallel`): tiny seeded models of a
``model_type``, plain-PyTorch records of HF modules' inputs and outputs, and the same edits made by plain hooks doing
the layer's own sums (the independent reference the served points are compared with)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

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


def wrapped(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, HookedModel]]:
    """A fixture's body: ``model`` and it wrapped by the generic adapter, unwrapped after (``yield from``)."""
    hm = wrap_generic(model)
    yield model, hm
    hm.unwrap()


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
    forward_with(model, handles)
    return seen


def forward_with(model: torch.nn.Module, handles: list) -> None:
    """One plain forward of ``model`` over :func:`input_ids` with the hooks whose ``handles`` are given, then
    removed."""
    try:
        with torch.no_grad():
            model(input_ids())
    finally:
        for h in handles:
            h.remove()


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


def block_points(hm: Any, i: int) -> set[str]:
    """The points ``hm`` serves in block ``i``, without the ``blocks.<i>.`` prefix."""
    prefix = f"blocks.{i}."
    return {n[len(prefix) :] for n in hm.hook_names if n.startswith(prefix)}


def record_heads(
    model: torch.nn.Module, attn: torch.nn.Module, more: dict[str, tuple[torch.nn.Module, str]] | None = None
) -> dict[str, Tensor]:
    """:func:`record` of an attention's ``q_proj``/``k_proj``/``v_proj`` outputs and ``o_proj``'s input, keyed by the
    points they are (``attn.hook_q``, ``attn.hook_k``, ``attn.hook_v``, ``attn.hook_z``), each split into its heads
    (``[b, p, heads, d_head]``, the config's query and key-value heads), and of the ``more`` modules as they are."""
    sites = {
        "attn.hook_q": (attn.q_proj, "out"),
        "attn.hook_k": (attn.k_proj, "out"),
        "attn.hook_v": (attn.v_proj, "out"),
        "attn.hook_z": (attn.o_proj, "in"),
    }
    seen = record(model, {**sites, **(more or {})})
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    for name, width in (("attn.hook_q", heads), ("attn.hook_k", kv), ("attn.hook_v", kv), ("attn.hook_z", heads)):
        seen[name] = seen[name].unflatten(-1, (width, -1))
    return seen


def per_head_weight(projection: torch.nn.Module, heads: int) -> Tensor:
    """A query/key/value projection's weight as TransformerLens' ``W_Q``: ``[heads, d_model, d_head]``."""
    return projection.weight.T.unflatten(-1, (heads, -1)).transpose(0, 1)


def attention_weights(
    hm: HookedModel, model: torch.nn.Module, i: int, attn: torch.nn.Module, o_scale: float = 1.0
) -> Tensor:
    """Asserts that block ``i``'s ``W_Q``/``W_K``/``W_V`` are the HF projections' weights per head and its ``W_O``
    ``o_proj``'s times ``o_scale`` (the branch's constant), bit for bit; returns that ``W_O``."""
    from lensadapters.weights import o_weights, qkv_weights

    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    (W_Q, _), (W_K, _), (W_V, _) = qkv_weights(hm.wiring, i)
    W_O, _ = o_weights(hm.wiring, i)
    assert torch.equal(W_Q, per_head_weight(attn.q_proj, heads))
    assert torch.equal(W_K, per_head_weight(attn.k_proj, kv))
    assert torch.equal(W_V, per_head_weight(attn.v_proj, kv))
    assert torch.equal(W_O.flatten(0, 1), attn.o_proj.weight.T * o_scale)
    return W_O


def sum_edits(
    layer: torch.nn.Module,
    reader: torch.nn.Module,
    before: dict[str, tuple[torch.nn.Module, float]],
    after: list[torch.nn.Module],
    after_scale: float,
) -> dict[str, Callable[[Tensor], Callable[[], list]]]:
    """For each contribution of a layer that adds its branches itself, the edit adding ``d`` there by plain hooks
    doing the layer's sums (:func:`sum_edit`), ``install = edits[point](d)``: the points of ``before`` (their modules
    and multipliers, in the order the layer adds them), then ``hook_resid_mid`` and ``hook_mlp_out``."""
    parts = list(before.values())
    kinds = {name: f"before{k}" for k, name in enumerate(before)}
    kinds.update(hook_resid_mid="mid", hook_mlp_out="after")
    return {
        name: lambda d, kind=kind: sum_edit(layer, reader, parts, after, after_scale, kind, d)
        for name, kind in kinds.items()
    }


def _plain_site(
    model: torch.nn.Module, at: tuple[torch.nn.Module, str], install: Callable[[Tensor], Callable[[], list]] | None
) -> tuple[Tensor, Callable[[Tensor], Callable[[], list]]]:
    """The value at the input or output of the module ``at`` names, and ``install`` (none: adding ``d`` there)."""
    module, side = at
    like = record(model, {"x": (module, side)})["x"]
    if install is None:
        install = (lambda d: add_to_output(module, d)) if side == "out" else (lambda d: add_to_input(module, d))
    return like, install


def plain_edit_error(
    hm: HookedModel,
    model: torch.nn.Module,
    name: str,
    at: tuple[torch.nn.Module, str],
    seed: int,
    install: Callable[[Tensor], Callable[[], list]] | None = None,
    scaled: bool = True,
) -> float:
    """:func:`edit_error` of an edit of the served point ``name`` against plain hooks making it: a seeded delta shaped
    like the input (``"in"``) or output (``"out"``) of the module ``at`` names (times that value's largest magnitude
    where ``scaled``), added there (``install`` none) or by ``install(d)``."""
    like, install = _plain_site(model, at, install)
    d = seeded_delta(like, seed) * float(like.abs().max()) if scaled else seeded_delta(like, seed)
    return edit_error(hm, model, name, d, install(d))


def plain_gradient_error(
    hm: HookedModel,
    model: torch.nn.Module,
    name: str,
    at: tuple[torch.nn.Module, str],
    install: Callable[[Tensor], Callable[[], list]] | None = None,
) -> float:
    """The relative difference of :func:`served_and_plain_gradients` at the served point ``name`` and at the input or
    output of the module ``at`` names (or by ``install(d)``'s plain hooks)."""
    like, install = _plain_site(model, at, install)
    served, direct = served_and_plain_gradients(hm, model, name, like, lambda d: install(d)())
    return relative_error(served, direct)


def gradients_through_edit(
    hm: HookedModel, reference: torch.nn.Module, name: str, make: Callable, d0: Tensor
) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """The gradients of a loss of the logits with respect to an edit ``d0`` added at the served point ``name``:
    through ``hm``'s point and through the plain hooks ``make(d)()`` installs on ``reference`` (asserted non-zero:
    the edit reaches the loss), and the loss through ``hm`` as a function of the edit."""

    def loss(logits: Tensor) -> Tensor:
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9)).to(logits.dtype)
        return (logits * weights).sum() + logits.pow(2).sum() / logits.numel()

    def through_hm(d: Tensor) -> Tensor:
        with hm.hooks([(name, lambda t, hook: t + d.reshape(t.shape))]):
            return loss(hm(input_ids(), use_cache=False).logits)

    def through_plain(d: Tensor) -> Tensor:
        handles = make(d)()
        try:
            return loss(reference(input_ids(), use_cache=False).logits)
        finally:
            for h in handles:
                h.remove()

    grads = []
    for through in (through_hm, through_plain):
        d = d0.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(through(d), d)
        grads.append(grad)
    assert bool(grads[1].abs().max() > 0), name  # the edit reaches the loss
    return grads[0], grads[1], through_hm


def assert_cached_edit_is_a_full_pass(hm: HookedModel, point: str) -> None:
    """Generation with ``point`` times 1.5 (the model's cache on) gives each step the logits of one forward over the
    generated tokens with the same edit (:func:`check_edited_generation`), which changes them."""
    from lensadapters.testing.contract_support import check_edited_generation
    from lensadapters.testing.strategies import Inputs

    ids = input_ids()
    one_pass, unedited, _ = check_edited_generation(
        hm,
        Inputs(ids, torch.ones_like(ids), [0]),
        point,
        lambda t, hook: t * 1.5,
        atol=lambda logits: 1e-4 * float(logits.abs().max()) + 1e-5,
    )
    assert not torch.allclose(one_pass, unedited), point


def assert_verified_but_scan(hm: HookedModel, block: int, points: Any = None, points_per_pass: Any = None) -> None:
    """Every one of ``points`` of block ``block`` (default: each it serves, in ``hook_names``' order) passes the
    independent check (:func:`check_points`: value and edit), but the selective scan's (:data:`SCAN_POINTS`: by the
    last part of the name; tests/test_generic_scan*.py check them)."""
    from lensadapters.adapters.generic.scan import SCAN_POINTS
    from lensadapters.adapters.generic.verify import check_points

    prefix = f"blocks.{block}."
    names = [n for n in hm.hook_names if n.startswith(prefix)] if points is None else [prefix + p for p in points]
    names = [n for n in names if n.split(".")[-1] not in SCAN_POINTS]
    assert check_points(hm.wiring, input_ids(), names, points_per_pass=points_per_pass) == dict.fromkeys(names)
