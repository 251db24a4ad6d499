"""Weight accessors in TransformerLens shapes, computed from the live parameters on every access.

The functions take the plugin-facing ``hooked`` object (:class:`lensadapters.protocol.Hooked`) and read
weights only through it (``hooked.read_linear``), so LoRA deltas, quantized and offloaded storage are seen
through their plugins. :class:`WeightAccessors` is the ``hm.W_Q``... surface of ``HookedModel``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.layer_claims import permitted, warn_undeclared
from lensadapters.adapters.moe import expert_weights_and_biases, is_moe, router_weight
from lensadapters.adapters.moe.experts import moe_layout
from lensadapters.errors import PluginValidationError, WeightUnavailableError
from lensadapters.hooks.distributed import full_tensor, is_dtensor
from lensadapters.hooks.offload import live_parameters
from lensadapters.hooks.specs import FusedGateUp, FusedQKV, LinearWeight, OpaqueMLP

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.adapters.protocol import Hooked

Tensor = torch.Tensor


class WeightSourceWarning(UserWarning):
    """More than one plugin can supply the same weight; the warning says which one is used."""


def read_linear(
    hm: "Hooked", module: nn.Module, expect: tuple[Optional[int], Optional[int]] = (None, None)
) -> LinearWeight:
    """The effective ``[d_in, d_out]`` weight and bias of ``module``, through every plugin.

    A plugin that cannot read a module raises ``WeightUnavailableError``; the module's path in the model
    is put in front of its message here. ``hm`` is the plugin-facing ``hooked`` object or a ``HookedModel``.
    The answer is checked (a ``LinearWeight`` with a 2-D ``W`` matching the module's ``in_features``/``out_features``
    when it declares them), and an error names the plugin that gave a malformed one. The first time a module type
    is read, every plugin is asked: when more than one answers, a ``WeightSourceWarning`` names them all and the
    one whose answer is used. ``expect`` is ``(d_in, d_out)`` as far as the description says (``None``: unknown).
    """
    hm = getattr(hm, "wiring", hm)
    caller = hm.plugin_hooks.lensadapters_linear_weight
    kwargs = {"module": module, "read": lambda m: read_linear(hm, m)}
    try:
        with live_parameters(module):  # an offloaded module's weights are loaded for the read
            result, supplier = _declared_answer(hm, caller, kwargs, [module], hm.module_name(module))
            _warn_if_several_answer(hm, module, caller, kwargs, supplier)
    except WeightUnavailableError as exc:
        if getattr(exc, "module_name", None) is None:  # the innermost module named, once
            exc.module_name = hm.module_name(module)
            exc.args = (f"{exc.module_name}: {exc.args[0] if exc.args else ''}",) + exc.args[1:]
        raise
    if result is None:
        raise WeightUnavailableError(
            f"lensadapters cannot read the weight of {hm.module_name(module)} ({type(module).__module__}."
            f"{type(module).__name__}): no installed plugin knows this storage format. Install the plugin for "
            f"it (8-bit: `pip install lensadapters[bnb]`) or implement `lensadapters_linear_weight`."
        )
    if is_dtensor(result.W) or is_dtensor(result.b):  # a plugin's read of sharded parameters, whole
        result = LinearWeight(full_tensor(result.W), full_tensor(result.b))
    _check_linear(hm, module, result, supplier or "?", expect)
    return result


def _declared_answer(
    hm: Any, caller: Any, kwargs: dict, modules: list[nn.Module], what: str
) -> tuple[Any, Optional[str]]:
    """The first answer of a plugin allowed to supply it (``layer_claims``): a cross-cutting plugin answering for a
    layer it does not declare is warned about and passed over."""
    for impl in caller.implementations():
        if permitted(hm, impl, modules):
            value = caller._call(impl, kwargs)
            if value is not None:
                return value, impl.plugin_name
            continue
        value = caller._call(impl, kwargs)  # (a failure is still reported, naming the plugin)
        if value is not None and modules:
            warn_undeclared(hm, impl, caller.name, what, modules[0])
    return None, None


def _warn_if_several_answer(hm: Any, module: nn.Module, caller: Any, kwargs: dict, supplier: Optional[str]) -> None:
    seen = hm.__dict__.setdefault("_linear_sources_checked", set())
    if type(module) in seen or supplier is None:
        return
    seen.add(type(module))
    with torch.no_grad():  # a probe: nothing recorded (a checkpointed forward must save the same tensors again)
        allowed = {impl.plugin_name for impl in caller.implementations() if permitted(hm, impl, [module])}
        answering = [name for name, _ in caller.answers(tolerate_errors=True, **kwargs) if name in allowed]
    if len(answering) > 1:
        warnings.warn(
            f"{len(answering)} plugins can read the weight of {type(module).__module__}.{type(module).__name__} "
            f"modules such as {hm.module_name(module)}: {', '.join(map(repr, answering))}; the weights (hm.W_Q..., "
            f"attn.hook_result) use {supplier!r}'s. If that is not the right one, uninstall or fix the other",
            WeightSourceWarning,
            stacklevel=5,
        )


def _check_linear(
    hm: Any, module: nn.Module, result: Any, supplier: str, expect: tuple[Optional[int], Optional[int]]
) -> None:
    """A ``LinearWeight`` whose shapes fit the module (named after the plugin that returned it when not)."""
    where = f"plugin {supplier!r} returned from lensadapters_linear_weight for {hm.module_name(module)}"
    if not isinstance(result, LinearWeight) or not isinstance(result.W, Tensor):
        raise PluginValidationError(f"{where} a {type(result).__name__}; return a LinearWeight(W [d_in, d_out], b)")
    W, b = result.W, result.b
    declared = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    expected = tuple(d if isinstance(d, int) else e for d, e in zip(declared, expect))
    if W.dim() != 2 or any(isinstance(n, int) and n != size for n, size in zip(expected, W.shape)):
        shown = ", ".join("?" if n is None else str(n) for n in expected)
        raise PluginValidationError(f"{where} a weight of shape {tuple(W.shape)}; W must be [d_in, d_out] = [{shown}]")
    if b is not None and (not isinstance(b, Tensor) or tuple(b.shape) != (W.shape[1],)):
        shape = tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__
        raise PluginValidationError(
            f"{where} a bias of shape {shape} for a weight of shape {tuple(W.shape)}; the "
            f"bias must be [d_out] = [{W.shape[1]}] or None"
        )


def _bias(b: Optional[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    return b if b is not None else torch.zeros(shape, dtype=like.dtype, device=like.device)


def qkv_weight(hm: "Hooked", layer: int, which: int) -> tuple[Tensor, Tensor]:
    """``(W, b)`` of the queries (``which=0``), keys (1) or values (2) of one layer: W as ``[heads, d_model, d_head]``.

    Separate projections are read one by one: ``W_Q`` never reads (or fails on) ``k_proj``.
    """
    layout = hm.qkv_layouts[layer]
    block = hm.block_modules[layer]
    _require_attention(hm, layer)
    if isinstance(layout, FusedQKV):
        lw = read_linear(hm, block.get_submodule(layout.module), (hm.cfg.d_model, None))
        W = layout.split(lw.W)[which]
        b = layout.split(lw.b)[which] if lw.b is not None else None
    else:
        if which and layout.kv_from is not None:
            raise WeightUnavailableError(
                f"{('W_K', 'W_V')[which - 1]} of layer {layer}: the layer has no key/value projection, it attends "
                f"with layer {layout.kv_from}'s keys and values (key/value sharing across layers); read layer "
                f"{layout.kv_from}'s weights"
            )
        lw = read_linear(hm, block.get_submodule((layout.q, layout.k, layout.v)[which]), (hm.cfg.d_model, None))
        # split by the number of heads: a layer's heads may be wider than cfg.d_head (Gemma 4's full layers)
        heads = hm.cfg.n_heads if which == 0 else layout.kv_heads or hm.cfg.n_key_value_heads or hm.cfg.n_heads
        W = lw.W.unflatten(-1, (heads, -1))
        b = None if lw.b is None else lw.b.unflatten(-1, (heads, -1))
        c = (
            layout.scale(which) if hasattr(layout, "scale") else 1.0
        )  # a constant the attention module multiplies the output by (SeparateQKV.k_scale)
        W, b = _times(W, c), None if b is None else _times(b, c)
    # a constant the block multiplies ln1's output by before the attention reads it (BlockLayout.attn_in_scale): in
    # the weights, not the biases (hook_q = ln1.hook_normalized @ W_Q + b_Q)
    W = _times(W, getattr(hm.block_layouts[layer], "attn_in_scale", 1.0))
    W = W.permute(1, 0, 2)  # [h, d_model, d_head]
    return W, _bias(b, (W.shape[0], W.shape[2]), W)


def qkv_weights(hm: "Hooked", layer: int) -> tuple[tuple[Tensor, Tensor], ...]:
    """``((W_Q, b_Q), (W_K, b_K), (W_V, b_V))`` of one layer."""
    return tuple(qkv_weight(hm, layer, which) for which in range(3))


def stacked(hm: "Hooked", which: int, part: int) -> Tensor:
    return torch.stack([qkv_weight(hm, layer, which)[part] for layer in range(hm.cfg.n_layers)])


def repeat_kv(t: Tensor, n_heads: int) -> Tensor:
    """Repeat key/value heads (dim 1 of ``[layers, hkv, ...]``) to ``n_heads`` as grouped attention does."""
    return t.repeat_interleave(n_heads // t.shape[1], dim=1)


def _require_attention(hm: "Hooked", layer: int) -> None:
    if hm.block_layouts[layer] is None:
        raise WeightUnavailableError(
            f"layer {layer} is not described (a hybrid's token mixer of another kind, served by its own points), so "
            f"it has no W_Q/W_K/W_V/W_O; read the described layers' weights one by one "
            f"(lensadapters.weights.qkv_weights(hm.wiring, layer), o_weights) and the mixer's parameters from "
            f"hm.block_modules[{layer}]"
        )
    if hm.block_layouts[layer] is not None and hm.qkv_layouts[layer] is None:
        raise WeightUnavailableError(
            f"layer {layer} has no softmax attention (its plugin describes its token mixer as another kind), so it "
            f"has no W_Q/W_K/W_V/W_O; read the mixer's parameters from hm.block_modules[{layer}]"
        )


def o_weights(hm: "Hooked", layer: int) -> tuple[Tensor, Tensor]:
    _require_attention(hm, layer)
    lw = read_linear(hm, hm.block_modules[layer].get_submodule(hm.block_layouts[layer].o_proj), (None, hm.cfg.d_model))
    W = lw.W.unflatten(0, (hm.cfg.n_heads, -1))  # [h, d_head, d_model]
    c = hm.block_layouts[layer].attn_scale  # a branch constant is folded in: what the block adds
    return _times(W, c), _times(_bias(lw.b, (W.shape[-1],), W), c)


def _times(t: Tensor, c: float) -> Tensor:
    """A weight times a block's branch constant (``BlockLayout.attn_scale``/``mlp_scale``), as TransformerLens folds
    such constants into the weights; ``t`` itself for 1.0."""
    return t if c == 1.0 else t * c


def mlp_weights(hm: "Hooked", layer: int, role: str, dense: bool = False) -> tuple[Tensor, Tensor]:
    """``role`` is ``in``, ``gate`` or ``out``; TransformerLens' W_in is the "up" projection of a gated MLP.

    A fused gate/up projection (``FusedGateUp``) is read once and split with the layout's ``split``.
    A mixture-of-experts layer gives every expert's weight, ``[n_experts, d_model, d_mlp]`` (``out``:
    ``[n_experts, d_mlp, d_model]``), and its biases ``[n_experts, d]`` (zeros for experts without); with
    ``dense=True``, the weights of the dense MLP it runs beside (``MoELayout.beside``). ``out`` of a block with a
    branch constant (``BlockLayout.mlp_scale``) includes it: ``hook_post @ W_out + b_out`` is ``hook_mlp_out``.
    """
    W, b = _mlp_weights(hm, layer, role, dense)
    block = hm.block_layouts[layer]
    if role != "out" or block is None or block.mlp_scale == 1.0:
        return W, b
    return _times(W, block.mlp_scale), _times(b, block.mlp_scale)  # a branch constant folded in


def _mlp_weights(hm: "Hooked", layer: int, role: str, dense: bool) -> tuple[Tensor, Tensor]:
    layout = hm.mlp_layouts[layer] or moe_layout(hm, layer)
    if layout is None:
        raise WeightUnavailableError(
            f"layer {layer}'s MLP is not described (the block has no description its weights could be read from, or "
            f"no MLP): no W_in/W_gate/W_out"
        )
    if dense:
        if not (is_moe(layout) and layout.beside is not None):
            raise WeightUnavailableError(
                f"layer {layer} has no dense MLP beside experts; read its MLP with mlp_weights(hm, {layer}, {role!r})"
            )
        layout = layout.beside
    if isinstance(layout, OpaqueMLP):
        raise WeightUnavailableError(f"layer {layer}'s MLP is not described ({layout.why}): no W_in/W_gate/W_out")
    if is_moe(layout):
        W, b = expert_weights_and_biases(hm, layer, role)
        return W, b if b is not None else torch.zeros(W.shape[0], W.shape[-1], dtype=W.dtype, device=W.device)
    if isinstance(layout, FusedGateUp) and role in ("in", "gate"):
        lw = hm.read_linear(hm.block_modules[layer].get_submodule(layout.module))
        part = 0 if role == "gate" else 1
        W = layout.split(lw.W)[part]
        b = layout.split(lw.b)[part] if lw.b is not None else None
        return W, _bias(b, (W.shape[-1],), W)
    expect = (None, hm.cfg.d_model) if role == "out" else (hm.cfg.d_model, None)
    lw = read_linear(hm, hm.block_modules[layer].get_submodule(layout.projection(role)), expect)
    W, b = lw.W, _bias(lw.b, (lw.W.shape[-1],), lw.W)
    # the MLP's own constants (MLPLayout.pre_scale/out_scale), folded in as TransformerLens folds constants
    c = {"gate": getattr(layout, "pre_scale", 1.0), "out": getattr(layout, "out_scale", 1.0)}.get(role, 1.0)
    if role == "in" and getattr(layout, "pre_linear", None) is None:  # a plain MLP: W_in is the pre projection
        c = getattr(layout, "pre_scale", 1.0)
    return _times(W, c), _times(b, c)


def _stack(hooked: "Hooked", fn: Callable[[int], Tensor]) -> Tensor:
    return torch.stack([fn(i) for i in range(hooked.cfg.n_layers)])


def _mlp_stack(hooked: "Hooked", role: str, part: int) -> Tensor:
    """One MLP weight of every layer; refused (naming the per-layer reader) when dense and MoE layers mix."""
    if len({moe_layout(hooked, i) is not None for i in range(len(hooked.mlp_layouts))}) > 1:
        raise AttributeError(
            f"this model mixes dense and mixture-of-experts MLP layers, whose weights have different shapes: read "
            f"one layer's with lensadapters.weights.mlp_weights(hm.wiring, layer, {role!r})"
        )
    return _stack(hooked, lambda i: mlp_weights(hooked, i, role)[part])


def _router_stack(hooked: "Hooked") -> Tensor:
    if not all(moe_layout(hooked, i) is not None for i in range(len(hooked.mlp_layouts))):
        raise AttributeError(
            "W_router exists for mixture-of-experts models whose every MLP layer is a MoE; read one "
            "layer's router with lensadapters.moe.router_weight(hm.wiring, layer)"
        )
    return _stack(hooked, lambda i: router_weight(hooked, i))


def _override(w: "Hooked", name: str, compute: Callable[[], Tensor]) -> Optional[Tensor]:
    """A plugin's ``lensadapters_weight`` answer for ``name`` (checked), or ``None`` when no plugin overrides it."""
    caller = w.plugin_hooks.lensadapters_weight
    kwargs = {"arch": w.arch, "hooked": w, "name": name}
    modules = _accessor_layers(w, name)
    override, supplier = _declared_answer(w, caller, kwargs, modules, name)
    if override is None:
        return None
    checked = w.__dict__.setdefault("_weight_sources_checked", set())
    if name not in checked:  # once per name: does more than one plugin answer?
        checked.add(name)
        with torch.no_grad():
            allowed = {impl.plugin_name for impl in caller.implementations() if permitted(w, impl, modules)}
            answering = [n for n, _ in caller.answers(tolerate_errors=True, **kwargs) if n in allowed]
        if len(answering) > 1:
            warnings.warn(
                f"{len(answering)} plugins override {name}: {', '.join(map(repr, answering))}; "
                f"{name} is {supplier!r}'s. If that is not the right one, uninstall or fix the other",
                WeightSourceWarning,
                stacklevel=5,
            )
    if not isinstance(override, Tensor):
        raise PluginValidationError(
            f"plugin {supplier!r} returned a {type(override).__name__} for {name} from "
            f"lensadapters_weight; return a tensor (or None to keep the core's)"
        )
    architecture_plugin = getattr(getattr(w, "plugin", None), "name", None)
    if supplier != architecture_plugin:  # a cross-cutting plugin's override keeps the architecture's shape
        try:
            with torch.no_grad():
                reference = compute()
        except Exception:  # the storage the plugin reads may be unreadable without it
            reference = None
        if reference is not None and reference.shape != override.shape:
            raise PluginValidationError(
                f"plugin {supplier!r} returned {name} of shape {tuple(override.shape)} from lensadapters_weight, "
                f"but this model's {name} has shape {tuple(reference.shape)}"
            )
    return full_tensor(override)


def read_weight(hooked: "Hooked", name: str, compute: Callable[[], Tensor]) -> Tensor:
    """The one reader of the named weights (:data:`WEIGHT_NAMES`): a plugin's ``lensadapters_weight`` override
    when one answers, otherwise ``compute()`` (the value the layouts give). ``hm.W_O``, ``attn.hook_result``,
    the cache's decompositions and the per-head input points all read through it (or :func:`layer_weight`), so
    an override reaches every value derived from that weight."""
    override = _override(hooked, name, compute)
    return full_tensor(compute()) if override is None else override  # a sharded parameter's read, whole


#: one layer of each per-layer weight (``name -> (hooked, layer) -> tensor``), for :func:`layer_weight`
_LAYER_WEIGHTS: dict[str, Callable[[Any, int], Tensor]] = {
    "W_Q": lambda h, i: qkv_weight(h, i, 0)[0],
    "b_Q": lambda h, i: qkv_weight(h, i, 0)[1],
    "_W_K": lambda h, i: qkv_weight(h, i, 1)[0],
    "_b_K": lambda h, i: qkv_weight(h, i, 1)[1],
    "_W_V": lambda h, i: qkv_weight(h, i, 2)[0],
    "_b_V": lambda h, i: qkv_weight(h, i, 2)[1],
    "W_O": lambda h, i: o_weights(h, i)[0],
    "b_O": lambda h, i: o_weights(h, i)[1],
    "W_in": lambda h, i: mlp_weights(h, i, "in")[0],
    "b_in": lambda h, i: mlp_weights(h, i, "in")[1],
    "W_gate": lambda h, i: mlp_weights(h, i, "gate")[0],
    "b_gate": lambda h, i: mlp_weights(h, i, "gate")[1],
    "W_out": lambda h, i: mlp_weights(h, i, "out")[0],
    "b_out": lambda h, i: mlp_weights(h, i, "out")[1],
}


def gated_query_weights(
    hooked: "Hooked", layer: int, q_proj: str = "self_attn.q_proj"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(W_Q, W_gate, b_Q, b_gate)`` of a layer whose query projection ``q_proj`` (relative to the block) holds per
    head the query then an output gate (``view(b, p, h, 2 * d_head)``, as ``plugin_api.query_gate_site`` reads it):
    every head's query and gate rows, ``[heads, d_model, d_head]`` and ``[heads, d_head]`` (zeros without a bias),
    from the live parameters (through every plugin: LoRA deltas, quantized storage)."""
    module = hooked.block_modules[layer].get_submodule(q_proj)
    lw = read_linear(hooked, module, (hooked.cfg.d_model, None))
    heads, d_head = hooked.cfg.n_heads, hooked.cfg.d_head
    W = lw.W.unflatten(-1, (heads, 2, d_head)).permute(2, 1, 0, 3)  # [2, h, d_model, d_head]
    b = torch.zeros(2, heads, d_head, dtype=W.dtype, device=W.device)
    if lw.b is not None:
        b = lw.b.unflatten(-1, (heads, 2, d_head)).transpose(0, 1)
    return W[0], W[1], b[0], b[1]


def gated_query_weight(
    hooked: "Hooked", name: str, softmax_layers: "list[bool]", family: str, reader: str
) -> Optional[Tensor]:
    """A hybrid plugin's answer to ``lensadapters_weight`` for ``W_Q``/``b_Q`` where every softmax-attention layer's
    query projection is gated (:func:`gated_query_weights`): the stacked queries when every layer is one
    (``softmax_layers``), a ``WeightUnavailableError`` naming the other layers and ``reader`` (the plugin's per-layer
    reader, e.g. ``"lensadapters_<plugin>.query_weights"``) otherwise; ``None`` for any other name."""
    if name not in ("W_Q", "b_Q"):
        return None
    others = [i for i, softmax in enumerate(softmax_layers) if not softmax]
    if others:
        raise WeightUnavailableError(
            f"this {family} model has linear-attention layers ({others}), which have no softmax queries: read a "
            f"full-attention layer's {name} with {reader}(hm, layer)"
        )
    part = 0 if name == "W_Q" else 2
    return torch.stack([gated_query_weights(hooked, i)[part] for i in range(len(softmax_layers))])


def stacked_weight(hooked: "Hooked", name: str) -> Tensor:
    """The core's own value of the per-layer weight ``name`` (every layer, stacked), no plugin override asked:
    what an override that rescales the core's value (``lensadapters_weight``) starts from."""
    one = _LAYER_WEIGHTS[name]
    return _stack(hooked, lambda i: one(hooked, i))


def layer_weight(hooked: "Hooked", name: str, layer: int) -> Tensor:
    """Layer ``layer`` of the per-layer weight ``name`` (``"W_O"``: ``[n_heads, d_head, d_model]``), through the
    same override as the whole (:func:`read_weight`): a plugin's ``W_O`` override reaches ``attn.hook_result``.
    Without an override only this layer is read."""
    one = _LAYER_WEIGHTS[name]
    override = _override(hooked, name, lambda: stacked_weight(hooked, name))
    return full_tensor(one(hooked, layer)) if override is None else override[layer]


def _accessor(name: str, compute: Callable[["Hooked"], Tensor], doc: str) -> Any:
    def get(self: "WeightAccessors") -> Tensor:
        return self._weight(name, lambda: compute(self.wiring))

    get.__doc__ = doc
    return property(get)


def _repeated_kv(name: str, doc: str) -> Any:
    """The key/value-head accessor ``name`` repeated to the query heads."""

    def get(self: "WeightAccessors") -> Tensor:
        return repeat_kv(getattr(self, name), self.wiring.cfg.n_heads)

    get.__doc__ = doc
    return property(get)


def _accessor_layers(w: "Hooked", name: str) -> list[nn.Module]:
    """The layers accessor ``name`` reads (``layer_claims``): the embedding, the position table, the unembedding, or
    every layer inside the blocks."""
    path = {"W_E": w.layout.embed, "W_pos": w.layout.pos_embed, "W_U": w.layout.unembed, "b_U": w.layout.unembed}
    if name in path:
        return [w.hf_model.get_submodule(path[name])] if path[name] else []
    return [m for block in w.block_modules for m in block.modules()]


class WeightAccessors:
    """``W_E``, ``W_Q``... in TransformerLens shapes, read from the live parameters on every access.

    A plugin's ``lensadapters_weight(arch, hooked, name)`` may override any of the names in
    :data:`WEIGHT_NAMES` (the first non-``None`` answer wins); otherwise the value is computed from the
    layouts. ``W_K``/``W_V``/``b_K``/``b_V`` are the key/value-head tensors (``_W_K``...) repeated to the query heads.
    """

    wiring: "Hooked"

    def _weight(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        return read_weight(self.wiring, name, compute)

    @property
    def W_E(self) -> Tensor:
        """Token embeddings ``[d_vocab, d_model]`` (times ``ModelLayout.embed_scale``:
        ``hook_embed == W_E[tokens]``)."""

        def compute() -> Tensor:
            with live_parameters(self.wiring.hf_model.get_submodule(self.wiring.layout.embed)) as embed:
                return embed.weight

        W = self._weight("W_E", compute)
        layout = self.wiring.layout
        if layout.embed_scale == 1.0:
            return W
        if layout.embed_scale_after_module and not layout.embed_scale_rounded:  # the model's Python-float product
            return W * layout.embed_scale
        return W * torch.tensor(layout.embed_scale, dtype=W.dtype, device=W.device)

    @property
    def W_pos(self) -> Tensor:
        """Learned position embeddings ``[n_ctx, d_model]`` (without an offset's rows)."""

        def compute() -> Tensor:
            layout = self.wiring.layout
            if not layout.pos_embed:
                raise AttributeError(f"{self.wiring.arch.name} has no learned position embeddings (W_pos)")
            with live_parameters(self.wiring.hf_model.get_submodule(layout.pos_embed)) as pos_embed:
                return pos_embed.weight[layout.pos_embed_offset :]

        return self._weight("W_pos", compute)

    def _unembed(self) -> nn.Module:
        w = self.wiring
        if w.layout.unembed is None:
            raise AttributeError(
                f"this {type(w.hf_model).__name__} has no unembedding (language-model head): "
                f"W_U and b_U exist only for *ForCausalLM models"
            )
        return w.hf_model.get_submodule(w.layout.unembed)

    @property
    def W_U(self) -> Tensor:
        """Unembedding ``[d_model, d_vocab]``."""
        return self._weight("W_U", lambda: self.wiring.read_linear(self._unembed()).W)

    @property
    def b_U(self) -> Tensor:
        """Unembedding bias ``[d_vocab]`` (zeros without one)."""

        def compute() -> Tensor:
            lw = self.wiring.read_linear(self._unembed())
            return lw.b if lw.b is not None else torch.zeros(lw.W.shape[-1], dtype=lw.W.dtype, device=lw.W.device)

        return self._weight("b_U", compute)

    W_Q = _accessor("W_Q", lambda h: stacked(h, 0, 0), "Queries ``[n_layers, n_heads, d_model, d_head]``.")
    b_Q = _accessor("b_Q", lambda h: stacked(h, 0, 1), "Query biases ``[n_layers, n_heads, d_head]``.")
    _W_K = _accessor("_W_K", lambda h: stacked(h, 1, 0), "Keys ``[n_layers, n_key_value_heads, d_model, d_head]``.")
    _b_K = _accessor("_b_K", lambda h: stacked(h, 1, 1), "Key biases ``[n_layers, n_key_value_heads, d_head]``.")
    _W_V = _accessor("_W_V", lambda h: stacked(h, 2, 0), "Values ``[n_layers, n_key_value_heads, d_model, d_head]``.")
    _b_V = _accessor("_b_V", lambda h: stacked(h, 2, 1), "Value biases ``[n_layers, n_key_value_heads, d_head]``.")
    W_O = _accessor(
        "W_O",
        lambda h: _stack(h, lambda i: o_weights(h, i)[0]),
        "Output projection ``[n_layers, n_heads, d_head, d_model]`` (times a block's ``BlockLayout.attn_scale``: "
        "``hook_z @ W_O + b_O`` is ``hook_attn_out``).",
    )
    b_O = _accessor("b_O", lambda h: _stack(h, lambda i: o_weights(h, i)[1]), "Output bias ``[n_layers, d_model]``.")
    W_in = _accessor(
        "W_in",
        lambda h: _mlp_stack(h, "in", 0),
        "MLP input (the up projection of a gated MLP) ``[n_layers, d_model, d_mlp]``; mixture of experts: "
        "``[n_layers, n_experts, d_model, d_mlp]``.",
    )
    b_in = _accessor("b_in", lambda h: _mlp_stack(h, "in", 1), "``[n_layers, d_mlp]``.")
    W_gate = _accessor(
        "W_gate", lambda h: _mlp_stack(h, "gate", 0), "Gate projection of a gated MLP ``[n_layers, d_model, d_mlp]``."
    )
    b_gate = _accessor("b_gate", lambda h: _mlp_stack(h, "gate", 1), "``[n_layers, d_mlp]``.")
    W_out = _accessor(
        "W_out",
        lambda h: _mlp_stack(h, "out", 0),
        "MLP output (down) projection ``[n_layers, d_mlp, d_model]`` (times a block's ``BlockLayout.mlp_scale``).",
    )
    b_out = _accessor("b_out", lambda h: _mlp_stack(h, "out", 1), "``[n_layers, d_model]``.")
    W_router = _accessor(
        "W_router",
        _router_stack,
        "Mixture of experts: the router ``[n_layers, d_model, n_experts]`` (logits = x @ W_router).",
    )

    W_K = _repeated_kv("_W_K", "Keys repeated to the query heads ``[n_layers, n_heads, d_model, d_head]`` (``_W_K``).")
    b_K = _repeated_kv("_b_K", "Key biases repeated to the query heads ``[n_layers, n_heads, d_head]``.")
    W_V = _repeated_kv(
        "_W_V", "Values repeated to the query heads ``[n_layers, n_heads, d_model, d_head]`` (``_W_V``)."
    )
    b_V = _repeated_kv("_b_V", "Value biases repeated to the query heads ``[n_layers, n_heads, d_head]``.")


#: the accessor names ``lensadapters_weight`` may override
WEIGHT_NAMES = (
    "W_E",
    "W_pos",
    "W_U",
    "b_U",
    "W_Q",
    "b_Q",
    "_W_K",
    "_b_K",
    "_W_V",
    "_b_V",
    "W_O",
    "b_O",
    "W_in",
    "b_in",
    "W_gate",
    "b_gate",
    "W_out",
    "b_out",
    "W_router",
)
