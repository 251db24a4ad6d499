"""The references of the verification (:mod:`.verify`): for each hook point, where its value lives in plain PyTorch
(a module's input or output, the model's own eager attention function's query, key, weights, scores or output, a
norm's scale) and how the point's value is viewed from it (heads split, a fused projection's part, the norm's weight
divided out). Kept apart from :mod:`.verify`, which runs the probe passes and judges the points against these.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.gated_z import gated_layers
from lensadapters.adapters.generic.moe_references import list_reference, scaled_input_reference
from lensadapters.adapters.generic.own_attention import OWN_CODE
from lensadapters.adapters.generic.rotated_norm import ROTATED_NORMS
from lensadapters.adapters.generic.shared_expert import shared_expert_reference
from lensadapters.adapters.latent_attention import LatentAttention, LatentQKV, three_d
from lensadapters.adapters.moe import FusedExperts, MoELayout
from lensadapters.hooks.sites import first_input, first_output, replace_first_output
from lensadapters.hooks.sites.qkv import heads_view, rotary_angles
from lensadapters.hooks.specs import FusedGateUp, FusedQKV, MLPLayout, SeparateQKV

Tensor = torch.Tensor


class Unchecked(Exception):
    """No independent reference could be computed for a point (not a wrong value: the point is not verified)."""


#: the attention and MLP children of a model's opaque layers whose outputs the generic adapter serves (it records
#: them here when it identifies a model)
OPAQUE_BRANCHES: "weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[Optional[str], Optional[str]]]]" = (
    weakref.WeakKeyDictionary()
)

#: further references of an opaque layer's points, by model: ``(wiring, layer, i, name)`` to the reference of the
#: point ``blocks.{i}.{name}``, ``None`` for another name (the mixer form's internal points, :mod:`.mixer`)
OPAQUE_REFERENCES: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Optional[Reference]]]" = (
    weakref.WeakKeyDictionary()
)


#: the token mixer a layer runs beside its attention module, whose output is ``hook_mixer_out`` (:mod:`.parallel`), by
#: model and layer
PARALLEL_MIXERS: "weakref.WeakKeyDictionary[nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


#: the module whose output is ``hook_attn_out`` of a described layer where it is not the block's attention module's
#: (``LayerDescription.attn_out``: a projection whose output the attention module adds to the residual itself)
#: each wrapped model's references of the described layers whose own sums serve their branch points
#: (:func:`.described_sums.described_sum_reference`, registered by the generic adapter)
DESCRIBED_SUMS_REFERENCES: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]]" = weakref.WeakKeyDictionary()
DESCRIBED_ATTN_OUT: "weakref.WeakKeyDictionary[nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


@dataclass
class Reference:
    """Where a point's value lives in plain PyTorch. ``kind``: ``"out"``/``"in"`` of ``module`` (``"in"`` with an
    int ``spec``: of that call of the module in the forward pass, counted from 0), ``"attn"`` of the
    attention function of layer ``layer`` (``part``: ``query``, ``key``, ``weights``, ``scores``), ``"scale"``
    of the norm ``module``, or ``"hooks"``: plain hooks of its own on several modules (``spec``: ``.modules`` and
    ``.install(edit, seen)``, as multi-head latent attention's ``hook_k``). ``view`` maps the reference tensor to
    the point's shape, ``unview`` a delta back."""

    kind: str
    module: Optional[nn.Module] = None
    view: Callable[[Tensor], Tensor] = lambda t: t
    unview: Callable[[Tensor, Tensor], Tensor] = lambda delta, t: delta
    also: Optional["Reference"] = None  # a second place an edit reaches (hook_resid_mid: the residual)
    layer: int = -1
    part: str = ""
    spec: Any = None
    flat: bool = False  # the module sees [b * p, ...] where the point shows [b, p, ...]
    after: Optional[nn.Module] = None  # "out"/"scale": only the module's first call after this module ran


#: final norms the model also runs elsewhere in the forward, to the last layer: their points are their first call
#: after it (``ModelLayout.ln_final_after_blocks``; the generic adapter records them here when it serves them)
AFTER_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def _unflat(delta: Tensor, t: Tensor) -> Tensor:
    """A delta in the point's shape ``[b, p, ...]`` as one of a tensor ``t`` the model holds as ``[b * p, ...]``."""
    return delta.reshape(t.shape)


def _heads(n: int) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]:
    return (lambda t: t.unflatten(-1, (n, t.shape[-1] // n))), (lambda d, t: d.flatten(-2))


def _part(
    split: Callable[..., Any], merge: Callable[..., Tensor], index: int
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]:
    """A fused projection's part ``index`` (``split``), and a delta of it as the fused output's (zeros elsewhere)."""

    def view(t: Tensor) -> Tensor:
        return split(t)[index]

    def unview(d: Tensor, t: Tensor) -> Tensor:
        parts = [torch.zeros_like(p) for p in split(t)]
        parts[index] = d
        return merge(*parts)

    return view, unview


def _norm_view(spec: Any) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]:
    """``hook_normalized`` of a norm: its output (LayerNorm) or its output over ``offset + weight`` (RMSNorm)."""
    if spec.kind == "LN" or spec.weight is None:
        return (lambda t: t), (lambda d, t: d)
    w = (spec.weight.detach().float() + spec.weight_offset).to(spec.weight.dtype)
    return (lambda t: t / w), (lambda d, t: d * w)


def reference(hooked: Any, name: str) -> Optional[Reference]:
    """The reference of the point ``name`` of ``hooked`` (a wiring), ``None`` where there is none."""
    model = hooked.hf_model
    if name == "hook_embed":
        layout = hooked.layout
        if layout.embed_scale_in_place and layout.embed_scale != 1.0:  # the module's output times the factor
            c = layout.embed_scale
            scaled = (lambda t: t * torch.tensor(c, dtype=t.dtype)) if layout.embed_scale_rounded else (lambda t: t * c)
            return Reference("out", model.get_submodule(layout.embed), view=scaled, unview=lambda d, t: d / c)
        if layout.embed_scale_after_module and layout.embed_scale != 1.0:
            return Reference("in", hooked.block_modules[0])
        return Reference("out", model.get_submodule(layout.embed))
    if name.startswith("ln_final."):
        try:
            norm = hooked.norm_module("ln_final")
        except Exception:
            return None
        found = _norm_reference(hooked, norm, name.split(".")[-1])
        if found is not None:
            found.after = AFTER_BLOCKS.get(norm)
        return found
    if not name.startswith("blocks."):
        return None
    _, i_text, rest = name.split(".", 2)
    i = int(i_text)
    layer, bl = hooked.block_modules[i], hooked.block_layouts[i]
    if rest == "hook_resid_pre":
        return Reference("in", layer)
    if rest == "hook_mixer_out" and i in PARALLEL_MIXERS.get(model, {}):
        return Reference("out", layer.get_submodule(PARALLEL_MIXERS[model][i]))
    if bl is not None and bl.post_norm and rest in _POST_NORM_POINTS:
        return _post_norm_reference(hooked, i, rest)
    if rest == "hook_resid_post":
        return Reference("out", layer)
    get = layer.get_submodule
    if rest in ("attn.hook_pattern", "attn.hook_attn_scores"):
        part = "weights" if rest.endswith("pattern") else "scores"
        heads = OWN_CODE.get(model, {}).get(i)
        if heads is not None and bl is not None:  # attention in the model's own code: its softmax, read by hand
            return Reference("softmax", layer.get_submodule(bl.attn), layer=i, part=part, spec=heads)
        return Reference("attn", layer=i, part=part)
    if bl is None:  # an opaque block: the generic adapter's own points
        if rest == "attn.hook_z":
            return Reference("attn", layer=i, part="output")
        further = OPAQUE_REFERENCES.get(model)
        internal = further(hooked, layer, i, rest) if further is not None else None
        if internal is not None:  # a token mixer's internal point (the mixer form)
            return internal
        attn, mlp_path = OPAQUE_BRANCHES.get(model, {}).get(i, (None, None))
        path = attn if rest == "hook_attn_out" else mlp_path if rest == "hook_mlp_out" else None
        # a branch module may return [b * p, d] (the point shows [b, p, d]); reshaping is the identity otherwise
        return Reference("out", get(path), unview=_unflat, flat=True) if path is not None else None
    qkv, mlp, cfg = hooked.qkv_layouts[i], hooked.mlp_layouts[i], hooked.cfg
    if bl.more_after_mlp:
        return None  # not what the automatic description produces: no reference here
    if bl.flat_mlp and (rest.startswith(("mlp.", "ln2.")) or rest in ("hook_resid_mid", "hook_mlp_in", "hook_mlp_out")):
        return None  # the MLP sees [b * p, d]: no reference here
    ln2_or_mlp = get(bl.ln2) if bl.ln2 is not None else get(bl.mlp) if bl.mlp is not None else None
    further_sums = DESCRIBED_SUMS_REFERENCES.get(model)  # a mixer beside the attention, added times constants
    summed = further_sums(hooked, i, rest) if further_sums is not None else None
    if summed is not None:
        return summed
    if bl.scaled and ln2_or_mlp is not None and rest in ("hook_attn_out", "hook_mlp_out", "attn.hook_result"):
        return _scaled_reference(layer, bl, ln2_or_mlp, rest, cfg.n_heads)
    if rest == "hook_attn_out" and i in DESCRIBED_ATTN_OUT.get(model, {}):
        return Reference("out", get(DESCRIBED_ATTN_OUT[model][i]))
    if rest == "hook_attn_out":  # what the block adds to the residual
        if bl.ln1_post is None and not bl.o_proj.startswith(bl.attn + "."):  # the projection is outside the module
            return Reference("out", get(bl.o_proj))  # the attention function is called with: its output
        return Reference("out", get(bl.ln1_post if bl.ln1_post is not None else bl.attn))
    if rest == "hook_mlp_out":
        path = bl.ln2_post or bl.mlp or getattr(mlp, "out", None)
        # the module may return [b * p, d] (the point shows [b, p, d]); reshaping is the identity otherwise
        return Reference("out", get(path), unview=_unflat, flat=True) if path is not None else None
    if rest == "hook_resid_mid" and not bl.parallel and ln2_or_mlp is not None:
        return Reference("in", ln2_or_mlp, also=Reference("out", layer))
    if rest == "hook_mlp_in" and ln2_or_mlp is not None:
        return Reference("in", ln2_or_mlp)
    for prefix, path in (("ln1.", bl.ln1), ("ln2.", bl.ln2), ("ln1_post.", bl.ln1_post), ("ln2_post.", bl.ln2_post)):
        if rest.startswith(prefix) and path is not None:
            return _norm_reference(hooked, get(path), rest.split(".")[-1])
    n, kv = cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads
    if rest.startswith(("attn.q_norm.", "attn.k_norm.")) and isinstance(qkv, (SeparateQKV, FusedQKV)):
        norm = qkv.q_norm if rest.startswith("attn.q_norm.") else qkv.k_norm
        if norm is None:
            return None
        return _norm_reference(hooked, get(norm.module), rest.split(".")[-1], norm.layout == "bhpd")
    if isinstance(qkv, LatentQKV) and qkv.latent is not None:  # multi-head latent attention's own points
        ln1 = get(bl.ln1) if bl.ln1 is not None and not bl.post_norm else None
        defined, found = latent_reference(qkv.latent, get, rest, i, get(bl.attn), ln1, bl.attn_in_scale)
        if defined:
            return found
    if rest in ("attn.hook_q", "attn.hook_k", "attn.hook_v"):
        which = rest[-1]
        heads = n if which == "q" else kv
        if isinstance(qkv, SeparateQKV) and not qkv.values_from_keys and qkv.kv_from is None:
            view, unview = _heads(heads)
            c = qkv.scale("qkv".index(which))
            if c != 1.0:  # the projection's output times the attention module's constant, an edit divided back
                return Reference("out", get(getattr(qkv, which)), lambda t: view(t) * c, lambda d, t: unview(d, t) / c)
            return Reference("out", get(getattr(qkv, which)), view, unview)
        if isinstance(qkv, FusedQKV):
            return Reference("out", get(qkv.module), *_part(qkv.split, qkv.merge, "qkv".index(which)))
        return None
    if rest in ("attn.hook_rot_q", "attn.hook_rot_k"):
        part = "query" if rest.endswith("q") else "key"
        after = ROTATED_NORMS.get(model, {}).get(i, {}).get(rest[-1])
        if after is not None:  # the input of the norm the attention module applies to the rotated values
            to_heads, from_heads = heads_view(after.layout, n if rest.endswith("q") else kv)
            return Reference("in", get(after.module), to_heads, lambda d, t: from_heads(d), spec=after.call)
        if i in OWN_CODE.get(model, {}):  # attention in the model's own code: the operand its sdpa call gets
            return Reference("operand", get(bl.attn), layer=i, part=part)
        return Reference("attn", layer=i, part=part)
    if rest == "attn.hook_z" and i in gated_layers(model):  # changed before the projection: the function's output
        return Reference("attn", layer=i, part="output")
    if rest == "attn.hook_z":
        view, unview = _heads(n)
        return Reference("in", get(bl.o_proj), view, unview)
    if rest == "attn.hook_result":
        return Reference("result", get(bl.o_proj), layer=n)
    if rest in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input") and isinstance(qkv, SeparateQKV):
        if qkv.values_from_keys or qkv.kv_from is not None:
            return None
        which = rest[5] if rest != "hook_attn_in" else "qkv"
        norm = get(bl.ln1) if bl.ln1 is not None else None
        modules = [get(getattr(qkv, x)) for x in which]
        # (the constant the block multiplies the norm's output by before the attention reads it: attn_in_scale)
        spec = (norm, modules, bl.attn_in_scale)
        return Reference("head_input", modules[0], layer=n if which in ("q", "qkv") else kv, spec=spec)
    shared = shared_expert_reference(model, i, rest)  # the shared expert's own modules, tokens maybe flattened
    if shared is not None:
        side, module, fused, index = shared
        if fused is not None:  # a part of its fused gate and up projection's output
            return Reference(side, get(module), *_part(fused.split, fused.merge, index))
        return Reference(side, get(module), unview=_unflat, flat=True)
    if isinstance(mlp, MoELayout):
        return _moe_reference(get, mlp, rest)
    if isinstance(mlp, MLPLayout):
        if rest == "mlp.hook_pre" and mlp.pre_scale != 1.0:  # the activation's input, an edit divided back
            c = mlp.pre_scale
            return Reference("out", get(mlp.pre), lambda t: t * c, lambda d, t: d / c)
        if rest == "mlp.hook_pre":
            return Reference("out", get(mlp.pre))
        if rest == "mlp.hook_pre_linear" and mlp.pre_linear is not None:
            return Reference("out", get(mlp.pre_linear))
        if rest == "mlp.hook_post":
            return Reference("in", get(mlp.out))
    if isinstance(mlp, FusedGateUp):
        if rest in ("mlp.hook_pre", "mlp.hook_pre_linear"):
            index = 0 if rest == "mlp.hook_pre" else 1
            return Reference("out", get(mlp.module), *_part(mlp.split, mlp.merge, index))
        if rest == "mlp.hook_post":
            return Reference("in", get(mlp.out))
    return None


def _scaled_reference(layer: nn.Module, bl: Any, reader: nn.Module, rest: str, heads: int) -> Reference:
    """The references of a block with branch constants (``BlockLayout.attn_scale``/``mlp_scale``): its own sums
    ``mid = x + attn_out * c0``, ``out = mid + mlp_out * c1`` read and edited by plain hooks on its modules
    (:class:`.mixer_sites.SumReference`); ``attn.hook_result`` each head's share of the output projection's output
    times ``c0``, an edit added to the attention's contribution where the block adds it."""
    from lensadapters.adapters.generic.mixer_sites import SumReference
    from lensadapters.adapters.generic.parallel import Split

    split = Split((bl.attn,), (bl.mlp,), before_scales=(bl.attn_scale,), after_scale=bl.mlp_scale)
    if rest == "attn.hook_result":
        o_proj = layer.get_submodule(bl.o_proj)
        return Reference("hooks", o_proj, spec=_ScaledResult(layer, reader, split, o_proj, heads))
    return Reference("hooks", layer, spec=SumReference(layer, reader, split, rest, ["hook_attn_out"]))


class _ScaledResult:
    """``attn.hook_result`` of a layer with branch constants, by plain hooks: each head's share of the output
    projection's output (the projection run on that head's input alone, less its bias) times the attention's
    constant; an edit's difference summed over heads added to the attention's contribution (the ``k``-th before the
    middle: one branch, or a token mixer's beside it) where the layer adds it, the middle its norm reads and its
    output recomputed (as :class:`.mixer_sites.SumReference` does)."""

    def __init__(
        self, layer: nn.Module, reader: nn.Module, split: Any, o_proj: nn.Module, heads: int, k: int = 0
    ) -> None:
        from lensadapters.adapters.generic.mixer_sites import _LayerSum

        self.sum, self.o_proj, self.heads, self.k = _LayerSum(layer, reader, split), o_proj, heads, k
        self.c = split.before_scales[k]

    @property
    def modules(self) -> list[nn.Module]:
        return [*self.sum.modules, self.o_proj]

    def install(self, edit: Optional[Callable[[Tensor], Tensor]], seen: list[Tensor]) -> list[Any]:
        from lensadapters.adapters.generic.call_hooks import _once, _per_head
        from lensadapters.hooks.sites.base import first_input

        change: list[Tensor] = []
        values: dict[int, Tensor] = {}

        def on_o_proj(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            x = first_input(args, kwargs)
            per_head = _per_head(module, x.unflatten(-1, (self.heads, x.shape[-1] // self.heads)), self.heads) * self.c
            seen.append(per_head.detach().clone())
            if edit is not None:
                change[:] = [edit(torch.zeros_like(per_head)).sum(-2)]

        def on_before(k: int, contribution: Tensor) -> None:
            if k == self.k and change:
                contribution = contribution + change[0].to(contribution.dtype)
            values[k] = contribution

        def on_reader(mid: Tensor) -> Optional[Tensor]:
            new = (
                self.sum.middle([values[k] for k in sorted(values)])
                if change and len(values) == len(self.sum.before)
                else None
            )
            values.clear()
            return new

        def on_output(after: Tensor) -> Optional[Tensor]:
            return self.sum.state["mid"] + after if change else None

        return [_once(self.o_proj, on_o_proj), *self.sum.hooks(on_before, on_reader, on_output)]


_POST_NORM_POINTS = frozenset(
    {
        "hook_resid_post",
        "hook_normalized_resid_post",
        "hook_resid_mid",
        "hook_mlp_in",
        "hook_attn_out",
        "hook_attn_in",
        "hook_q_input",
        "hook_k_input",
        "hook_v_input",
    }
)


def _post_norm_reference(hooked: Any, i: int, rest: str) -> Optional[Reference]:
    """The references of a post-LN block's points (``mid = ln1(x + attn_out)``, ``out = ln2(mid + mlp_out)``) that
    differ from a pre-norm block's: ``hook_resid_mid`` the input of ``ln1``, ``hook_mlp_in`` the input of the MLP
    (``ln1``'s output, one branch), ``hook_resid_post`` the input of ``ln2`` (with ``resid_post_before_norm``; else
    the block output), ``hook_normalized_resid_post`` the block output, ``hook_attn_out`` the output projection's
    output (what the block adds to ``x``: a dropout after it is the identity in eval mode), and the per-head inputs
    the block input itself (no norm before attention)."""
    layer, bl, qkv, mlp = hooked.block_modules[i], hooked.block_layouts[i], hooked.qkv_layouts[i], hooked.mlp_layouts[i]
    get = layer.get_submodule
    if rest == "hook_resid_post":
        return Reference("in", get(bl.ln2)) if bl.resid_post_before_norm else Reference("out", layer)
    if rest == "hook_normalized_resid_post":
        return Reference("out", layer)
    if rest == "hook_resid_mid":
        return Reference("in", get(bl.ln1))
    if rest == "hook_mlp_in":
        first = bl.mlp or (mlp.module if isinstance(mlp, FusedGateUp) else getattr(mlp, "pre", None))
        return Reference("in", get(first)) if first is not None else None
    if rest == "hook_attn_out":
        return Reference("out", get(bl.o_proj))
    if not isinstance(qkv, SeparateQKV) or qkv.values_from_keys or qkv.kv_from is not None:
        return None
    n, kv = hooked.cfg.n_heads, hooked.cfg.n_key_value_heads or hooked.cfg.n_heads
    which = rest[5] if rest != "hook_attn_in" else "qkv"
    modules = [get(getattr(qkv, x)) for x in which]
    return Reference("head_input", modules[0], layer=n if which in ("q", "qkv") else kv, spec=(None, modules))


def _moe_reference(get: Callable[[str], nn.Module], moe: MoELayout, rest: str) -> Optional[Reference]:
    """``mlp.hook_router_logits``: the router's output (a router returning its logits), or its own product of an
    input moved so that the product moves by the edit (``x + delta @ pinv(W)ᵀ``: a router returning the routing);
    ``mlp.hook_routing_weights``: the weights the fused experts module is called with (a router returning
    ``(scores, logits)``: its scores at the top-k of its logits, an edit scattered into them; a router returning the
    routing grouped by expert: its logits module's output, and its rows' weights put back in top-k order, an edit
    gathered into them in the router's order). No other MoE point has a
    plain PyTorch reference (the fused experts compute every expert in one call), except where the routing weights
    scale the experts' input (:mod:`.moe_references`: the experts' output then has a block per expert)."""
    unflat = _unflat
    scaled = scaled_input_reference(get, moe, rest)
    if scaled is not None:
        spec, flat = scaled
        return Reference("hooks", get(moe.router), unview=unflat if flat else (lambda d, t: d), flat=flat, spec=spec)
    if rest == "mlp.hook_router_logits" and moe.router_output == "grouped" and moe.router_logits:
        return Reference("out", get(moe.router_logits), unview=unflat, flat=True)
    if rest == "mlp.hook_routing_weights" and moe.router_output == "grouped":
        return Reference("grouped_weights", get(moe.router), unview=unflat, flat=True, spec=moe.routing.top_k)
    if rest == "mlp.hook_router_logits":
        kind = "out" if moe.router_output == "logits" else "router_input"
        return Reference(kind, get(moe.router), unview=unflat, flat=True)
    if rest == "mlp.hook_routing_weights" and moe.router_output == "scores_logits":
        return Reference("scores", get(moe.router), unview=unflat, flat=True, spec=moe.routing.top_k)
    if rest == "mlp.hook_routing_weights" and isinstance(moe.experts, FusedExperts):
        return Reference("arg", get(moe.experts.module), unview=unflat, flat=True, spec=2)
    listed = list_reference(get, moe, rest)  # experts in a ModuleList: the routing weights, each expert's steps
    if listed is not None:
        kind, found = listed
        if kind == "hooks":
            return Reference("hooks", get(moe.router), unview=unflat, flat=True, spec=found)
        return Reference(kind, found)
    return None


def _norm_reference(hooked: Any, module: nn.Module, what: str, transposed: bool = False) -> Optional[Reference]:
    """``transposed``: the module sees ``[b, heads, p, d]`` where the point shows ``[b, p, heads, d]``."""
    spec = hooked.norm_spec(module)
    if what == "hook_scale":
        return Reference("scale", module, (lambda t: t.transpose(1, 2)) if transposed else (lambda t: t), spec=spec)
    if what == "hook_normalized":
        view, unview = _norm_view(spec)
        if transposed:
            return Reference(
                "out", module, lambda t: view(t).transpose(1, 2), lambda d, t: unview(d.transpose(1, 2), t)
            )
        return Reference("out", module, view, unview)
    return None


# --- multi-head latent attention (the core's LatentAttention form, :mod:`.latent`) ----------------------------


def latent_reference(
    form: LatentAttention,
    get: Callable[[str], nn.Module],
    rest: str,
    layer: int,
    attention: nn.Module,
    ln1: Optional[nn.Module] = None,
    attn_in_scale: float = 1.0,
) -> tuple[bool, Optional[Reference]]:
    """``(whether the form defines the reference of the point rest, the reference)``: ``hook_q_latent`` and
    ``hook_kv_latent`` the latents' norms' outputs, ``hook_k_rope`` the down-projection's last ``rope`` columns,
    ``hook_v`` the up-projection's last ``v_head_dim`` columns of each head; ``hook_k`` the keys the attention
    function of layer ``layer`` gets, rotary undone (:class:`_LatentAngles`; ``hook_rot_k``: those keys as they
    are, the default); the per-head inputs (:class:`_LatentCopies`): ``hook_q_input``/``hook_v_input`` the norm's
    input once per head, an edit recomputing the query projection's (the up-projection's values') output per head
    from the edited copies, ``hook_k_input`` the same, its edit on the keys the attention function gets (the rope
    key per head); ``hook_attn_in`` has none (it is not served)."""
    if rest in ("hook_q_input", "hook_k_input", "hook_v_input"):
        copies = _LatentCopies(form, get, attention, ln1, attn_in_scale, rest[5])
        if rest == "hook_k_input":
            return True, Reference("attn", layer=layer, part="key", view=copies.view, unview=copies.unview, spec=copies)
        return True, Reference("hooks", get(form.q if rest == "hook_q_input" else form.kv_up), spec=copies)
    if rest == "hook_attn_in":
        return True, None
    if rest == "attn.hook_q_latent" and form.q_norm is not None:
        return True, Reference("out", get(form.q_norm))
    if rest == "attn.hook_kv_latent":
        return True, Reference("out", get(form.kv_norm))
    if rest == "attn.hook_k_rope":
        rank = form.kv_rank

        def rope_part(d: Tensor, t: Tensor) -> Tensor:
            return torch.cat((torch.zeros_like(t[..., :rank]), d.to(t.dtype)), dim=-1)

        return True, Reference("out", get(form.kv_down), lambda t: t[..., rank:], rope_part)
    if rest == "attn.hook_v":
        heads, nope = form.heads, form.nope

        def values(t: Tensor) -> Tensor:
            return three_d(t).unflatten(-1, (heads, -1))[..., nope:]

        def value_part(d: Tensor, t: Tensor) -> Tensor:
            zeros = torch.zeros((*d.shape[:-1], nope), dtype=t.dtype, device=t.device)
            return torch.cat((zeros, d.to(t.dtype)), dim=-1).flatten(-2).reshape(t.shape)

        return True, Reference("out", get(form.kv_up), values, value_part)
    if rest == "attn.hook_k":
        angles = _LatentAngles(form, attention)
        return True, Reference("attn", layer=layer, part="key", view=angles.view, unview=angles.unview, spec=angles)
    return False, None


class _LatentAngles:
    """``hook_k``'s view of the attention function's keys ``[b, p, h, d]``: the rotary angles the attention module is
    called with (recorded by a plain pre-hook), undone on the keys (``view``) and applied to an edit's delta
    (``unview``: rotary is linear, and the identity on the no-rope columns)."""

    def __init__(self, form: LatentAttention, attention: nn.Module) -> None:
        self.form, self.modules = form, (attention,)
        self.angles: list[Any] = []

    def install(self, edit: Optional[Callable[[Tensor], Tensor]], seen: list[Tensor]) -> list[Any]:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.angles[:] = [rotary_angles(kwargs["position_embeddings"])]

        return [self.modules[0].register_forward_pre_hook(record, with_kwargs=True)]

    def view(self, keys: Tensor) -> Tensor:
        assert self.form.rotary is not None
        return self.form.rotary.invert(keys, *self.angles[-1])

    def unview(self, delta: Tensor, keys: Tensor) -> Tensor:
        assert self.form.rotary is not None
        return self.form.rotary.apply(delta.to(keys.dtype), *self.angles[-1])


class _LatentCopies:
    """The plain-PyTorch reference of a latent layer's ``hook_{which}_input`` (``which``: ``q``, ``k`` or ``v``): a
    pre-hook records the attention norm's input ``x`` (the point's value: ``x`` once per head); an edit's copies
    ``x + delta[..., h, :]`` go through the model's own modules (called by ``forward``: no hook of theirs fires),
    and head ``h`` of the result replaces the model's, where its copy changed: of the query projection's output
    (``q``), of the up-projection's value columns (``v``), or of the keys the attention function gets (``k``:
    ``unview``, the up-projection's no-rope key and the down-projection's rope key of each copy, rotated with the
    angles the attention module is called with)."""

    def __init__(
        self,
        form: LatentAttention,
        get: Callable[[str], nn.Module],
        attention: nn.Module,
        ln1: Optional[nn.Module],
        scale: float,
        which: str,
    ) -> None:
        self.form, self.which, self.ln1, self.attention, self.scale = form, which, ln1, attention, scale
        self.q, self.kv_down, self.kv_norm, self.kv_up = (
            get(p) for p in (form.q, form.kv_down, form.kv_norm, form.kv_up)
        )
        latent = form.q_down is not None and form.q_norm is not None
        self.q_down = get(form.q_down) if latent and form.q_down is not None else None
        self.q_norm = get(form.q_norm) if latent and form.q_norm is not None else None
        self.modules = tuple(
            m
            for m in (ln1, attention, self.q, self.q_down, self.q_norm, self.kv_down, self.kv_norm, self.kv_up)
            if m is not None
        )
        self.x: list[Tensor] = []
        self.angles: list[Any] = []

    def _copies(self) -> Tensor:
        x = self.x[-1]
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.form.heads, x.shape[-1])

    def _read(self, copies: Tensor) -> Tensor:
        read = self.ln1.forward(copies) if self.ln1 is not None else copies
        return read * self.scale if self.scale != 1.0 else read

    def _own(self, t: Tensor) -> Tensor:
        """``[..., h (copy), h * f]`` -> ``[..., h, f]``: each copy's own head's slice."""
        heads = self.form.heads
        return t.unflatten(-1, (heads, -1)).diagonal(dim1=-3, dim2=-2).movedim(-1, -2)

    def queries(self, copies: Tensor) -> Tensor:
        read = self._read(copies)
        if self.q_down is not None and self.q_norm is not None:
            read = self.q_norm.forward(self.q_down.forward(read))
        return self._own(self.q.forward(read))

    def keys_values(self, copies: Tensor) -> tuple[Tensor, Tensor]:
        """Each copy's ``[no-rope key | rope key]`` (before rotary) and value."""
        down = self.kv_down.forward(self._read(copies))
        rank, nope = self.form.kv_rank, self.form.nope
        kv = self._own(self.kv_up.forward(self.kv_norm.forward(down[..., :rank])))
        return torch.cat((kv[..., :nope], down[..., rank:]), dim=-1), kv[..., nope:]

    def install(self, edit: Optional[Callable[[Tensor], Tensor]], seen: list[Tensor]) -> list[Any]:
        entry = self.ln1 if self.ln1 is not None else self.attention
        handles = []

        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.x[:] = [first_input(args, kwargs).detach().clone()]
            seen.append(self._copies().clone())

        handles.append(entry.register_forward_pre_hook(record, with_kwargs=True))
        if self.which == "k":

            def angles(module: nn.Module, args: tuple, kwargs: dict) -> None:
                self.angles[:] = [rotary_angles(kwargs["position_embeddings"])]

            handles.append(self.attention.register_forward_pre_hook(angles, with_kwargs=True))
        if edit is None or self.which == "k":
            return handles

        def replace(module: nn.Module, args: tuple, output: Any) -> Any:
            raw = first_output(output)
            copies = self._copies()
            delta = edit(torch.zeros_like(copies))
            changed = (delta != 0).any(-1, keepdim=True)
            heads = self.form.heads
            if self.which == "q":
                new = torch.where(changed, self.queries(copies + delta).to(raw.dtype), raw.unflatten(-1, (heads, -1)))
                return replace_first_output(output, new.flatten(-2))
            out = three_d(raw)  # a model caching the latents runs the up-projection on the latent viewed as one head
            parts = out.unflatten(-1, (heads, -1))
            nope = self.form.nope
            values = torch.where(changed, self.keys_values(copies + delta)[1].to(raw.dtype), parts[..., nope:])
            return replace_first_output(
                output, torch.cat((parts[..., :nope], values), -1).flatten(-2).reshape(raw.shape)
            )

        handles.append(
            self.q.register_forward_hook(replace) if self.which == "q" else self.kv_up.register_forward_hook(replace)
        )
        return handles

    def view(self, keys: Tensor) -> Tensor:
        return self._copies()

    def unview(self, delta: Tensor, keys: Tensor) -> Tensor:
        """The change of the keys ``[b, p, h, d]`` the attention function gets: head ``h``'s rotated key from its
        edited copy, where the copy changed."""
        assert self.form.rotary is not None
        copies = self._copies()
        new = self.form.rotary.apply(self.keys_values(copies + delta.to(copies.dtype))[0], *self.angles[-1])
        changed = (delta != 0).any(-1, keepdim=True)
        return torch.where(changed, new.to(keys.dtype) - keys, torch.zeros_like(keys))
