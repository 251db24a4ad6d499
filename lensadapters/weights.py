"""Weight accessors in TransformerLens shapes, computed from the live parameters on every access.

The functions take the plugin-facing ``hooked`` object (:class:`lensadapters.protocol.Hooked`) and read
weights only through it (``hooked.read_linear``), so LoRA deltas, quantized and offloaded storage are seen
through their plugins. :class:`WeightAccessors` is the ``hm.W_Q``... surface of ``HookedModel``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from .errors import WeightUnavailableError
from .offload import live_parameters
from .specs import FusedGateUp, FusedQKV, LinearWeight

if TYPE_CHECKING:  # pragma: no cover
    from .protocol import Hooked

Tensor = torch.Tensor


def read_linear(hm: "Hooked", module: nn.Module) -> LinearWeight:
    """The effective ``[d_in, d_out]`` weight and bias of ``module``, through every plugin.

    A plugin that cannot read a module raises ``WeightUnavailableError``; the module's path in the model
    is put in front of its message here. ``hm`` is the plugin-facing ``hooked`` object or a ``HookedModel``.
    """
    hm = getattr(hm, "wiring", hm)
    try:
        with live_parameters(module):  # an offloaded module's weights are loaded for the read
            result = hm.plugin_hooks.lensadapters_linear_weight(module=module, read=lambda m: read_linear(hm, m))
    except WeightUnavailableError as exc:
        if getattr(exc, "module_name", None) is None:  # the innermost module named, once
            exc.module_name = hm.module_name(module)
            exc.args = (f"{exc.module_name}: {exc.args[0] if exc.args else ''}",) + exc.args[1:]
        raise
    if result is None:
        raise WeightUnavailableError(
            f"lensadapters cannot read the weight of {hm.module_name(module)} ({type(module).__module__}."
            f"{type(module).__name__}): no installed plugin knows this storage format. Install the plugin for "
            f"it (8-bit: `pip install lensadapters[bnb]`) or implement `lensadapters_linear_weight`.")
    return result


def _bias(b: Optional[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    return b if b is not None else torch.zeros(shape, dtype=like.dtype, device=like.device)


def qkv_weight(hm: "Hooked", layer: int, which: int) -> tuple[Tensor, Tensor]:
    """``(W, b)`` of the queries (``which=0``), keys (1) or values (2) of one layer: W as ``[heads, d_model, d_head]``.

    Separate projections are read one by one: ``W_Q`` never reads (or fails on) ``k_proj``.
    """
    layout = hm.qkv_layouts[layer]
    block = hm.block_modules[layer]
    if isinstance(layout, FusedQKV):
        lw = hm.read_linear(block.get_submodule(layout.module))
        W = layout.split(lw.W)[which]
        b = layout.split(lw.b)[which] if lw.b is not None else None
    else:
        lw = hm.read_linear(block.get_submodule((layout.q, layout.k, layout.v)[which]))
        W = lw.W.unflatten(-1, (-1, hm.cfg.d_head))
        b = None if lw.b is None else lw.b.unflatten(-1, (-1, hm.cfg.d_head))
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


def o_weights(hm: "Hooked", layer: int) -> tuple[Tensor, Tensor]:
    lw = hm.read_linear(hm.block_modules[layer].get_submodule(hm.block_layouts[layer].o_proj))
    W = lw.W.unflatten(0, (hm.cfg.n_heads, -1))  # [h, d_head, d_model]
    return W, _bias(lw.b, (W.shape[-1],), W)


def mlp_weights(hm: "Hooked", layer: int, role: str) -> tuple[Tensor, Tensor]:
    """``role`` is ``in``, ``gate`` or ``out``; TransformerLens' W_in is the "up" projection of a gated MLP.

    A fused gate/up projection (``FusedGateUp``) is read once and split with the layout's ``split``.
    """
    layout = hm.mlp_layouts[layer]
    if isinstance(layout, FusedGateUp) and role in ("in", "gate"):
        lw = hm.read_linear(hm.block_modules[layer].get_submodule(layout.module))
        part = 0 if role == "gate" else 1
        W = layout.split(lw.W)[part]
        b = layout.split(lw.b)[part] if lw.b is not None else None
        return W, _bias(b, (W.shape[-1],), W)
    if role == "in":
        path = layout.pre_linear or layout.pre
    elif role == "gate":
        if layout.pre_linear is None:
            raise AttributeError("W_gate exists only for gated MLPs (cfg.gated_mlp)")
        path = layout.pre
    else:
        path = layout.out
    lw = hm.read_linear(hm.block_modules[layer].get_submodule(path))
    return lw.W, _bias(lw.b, (lw.W.shape[-1],), lw.W)


def _stack(hooked: "Hooked", fn: Callable[[int], Tensor]) -> Tensor:
    return torch.stack([fn(i) for i in range(hooked.cfg.n_layers)])


def _accessor(name: str, compute: Callable[["Hooked"], Tensor], doc: str) -> Any:
    def get(self: "WeightAccessors") -> Tensor:
        return self._weight(name, lambda: compute(self.wiring))

    get.__doc__ = doc
    return property(get)


class WeightAccessors:
    """``W_E``, ``W_Q``... in TransformerLens shapes, read from the live parameters on every access.

    A plugin's ``lensadapters_weight(arch, hooked, name)`` may override any of the names in
    :data:`WEIGHT_NAMES` (the first non-``None`` answer wins); otherwise the value is computed from the
    layouts. ``W_K``/``W_V``/``b_K``/``b_V`` are the key/value-head tensors (``_W_K``...) repeated to the query heads.
    """

    wiring: "Hooked"

    def _weight(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        w = self.wiring
        override = w.plugin_hooks.lensadapters_weight(arch=w.arch, hooked=w, name=name)
        return override if override is not None else compute()

    @property
    def W_E(self) -> Tensor:
        """Token embeddings ``[d_vocab, d_model]`` (times ``ModelLayout.embed_scale``: ``hook_embed == W_E[tokens]``)."""
        def compute() -> Tensor:
            with live_parameters(self.wiring.hf_model.get_submodule(self.wiring.layout.embed)) as embed:
                return embed.weight

        W = self._weight("W_E", compute)
        scale = self.wiring.layout.embed_scale
        return W if scale == 1.0 else W * torch.tensor(scale, dtype=W.dtype, device=W.device)

    @property
    def W_pos(self) -> Tensor:
        """Learned position embeddings ``[n_ctx, d_model]`` (without an offset's rows)."""
        def compute() -> Tensor:
            layout = self.wiring.layout
            if not layout.pos_embed:
                raise AttributeError(f"{self.wiring.arch.name} has no learned position embeddings (W_pos)")
            with live_parameters(self.wiring.hf_model.get_submodule(layout.pos_embed)) as pos_embed:
                return pos_embed.weight[layout.pos_embed_offset:]

        return self._weight("W_pos", compute)

    def _unembed(self) -> nn.Module:
        w = self.wiring
        if w.layout.unembed is None:
            raise AttributeError(f"this {type(w.hf_model).__name__} has no unembedding (language-model head): "
                                 f"W_U and b_U exist only for *ForCausalLM models")
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
    W_O = _accessor("W_O", lambda h: _stack(h, lambda i: o_weights(h, i)[0]),
                    "Output projection ``[n_layers, n_heads, d_head, d_model]``.")
    b_O = _accessor("b_O", lambda h: _stack(h, lambda i: o_weights(h, i)[1]), "Output bias ``[n_layers, d_model]``.")
    W_in = _accessor("W_in", lambda h: _stack(h, lambda i: mlp_weights(h, i, "in")[0]),
                     "MLP input (the up projection of a gated MLP) ``[n_layers, d_model, d_mlp]``.")
    b_in = _accessor("b_in", lambda h: _stack(h, lambda i: mlp_weights(h, i, "in")[1]), "``[n_layers, d_mlp]``.")
    W_gate = _accessor("W_gate", lambda h: _stack(h, lambda i: mlp_weights(h, i, "gate")[0]),
                       "Gate projection of a gated MLP ``[n_layers, d_model, d_mlp]``.")
    b_gate = _accessor("b_gate", lambda h: _stack(h, lambda i: mlp_weights(h, i, "gate")[1]), "``[n_layers, d_mlp]``.")
    W_out = _accessor("W_out", lambda h: _stack(h, lambda i: mlp_weights(h, i, "out")[0]),
                      "MLP output (down) projection ``[n_layers, d_mlp, d_model]``.")
    b_out = _accessor("b_out", lambda h: _stack(h, lambda i: mlp_weights(h, i, "out")[1]), "``[n_layers, d_model]``.")

    @property
    def W_K(self) -> Tensor:
        """Keys repeated to the query heads ``[n_layers, n_heads, d_model, d_head]`` (``_W_K``: key/value heads)."""
        return repeat_kv(self._W_K, self.wiring.cfg.n_heads)

    @property
    def b_K(self) -> Tensor:
        return repeat_kv(self._b_K, self.wiring.cfg.n_heads)

    @property
    def W_V(self) -> Tensor:
        """Values repeated to the query heads ``[n_layers, n_heads, d_model, d_head]`` (``_W_V``: key/value heads)."""
        return repeat_kv(self._W_V, self.wiring.cfg.n_heads)

    @property
    def b_V(self) -> Tensor:
        return repeat_kv(self._b_V, self.wiring.cfg.n_heads)


#: the accessor names ``lensadapters_weight`` may override
WEIGHT_NAMES = ("W_E", "W_pos", "W_U", "b_U", "W_Q", "b_Q", "_W_K", "_b_K", "_W_V", "_b_V", "W_O", "b_O", "W_in",
                "b_in", "W_gate", "b_gate", "W_out", "b_out")
