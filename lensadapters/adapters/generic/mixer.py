"""The mixer form: decoder layers whose token mixer is not softmax attention (state-space layers, linear attention,
short convolutions, recurrences), alone or beside softmax-attention layers (hybrids). Nothing here names an
architecture; every rule is read from the probe forward pass (:mod:`.probe`) and one further forward pass
(:func:`probe_mixers`).

* **Branches**: where the generic adapter finds no attention module and MLP module whose outputs the layer adds to
  its input (:func:`.identify._block`), the layer's *branches* are its direct children with matrix parameters (norms
  have none), each run exactly once. With two, the layer's output must be exactly its input plus both outputs: the
  first to run is the token mixer, whose output is ``hook_attn_out`` (as a plugin serves a hybrid's linear-attention
  layer), the second the MLP (``hook_mlp_out``). With one (a layer that is a mixer alone, or an MLP alone), the
  output must be the input plus that child's output, and the child is the *token mixer* (``hook_attn_out``) where it
  calls transformers' attention interface or where its output at a later position changes (beyond rounding) when
  only the first position of its input changes (the further forward pass re-runs it on that edited input), else the MLP
  (``hook_mlp_out``): an MLP reads each position alone. With three (two token mixers in parallel before the MLP, or
  a token mixer before an MLP of two modules the layer adds): :mod:`.parallel`.
* **Mixer internals**: in a token mixer that neither calls the attention interface nor is named as softmax attention
  (a class name ending in ``Attention``, transformers' convention, :mod:`.identify`), each direct child that is a
  linear or a 1-D convolution module, run exactly once per mixer call (counted in the further forward pass), is a
  point named after the module attributes, ``<mixer>.hook_<child>`` (Mamba: ``mixer.hook_in_proj``,
  ``mixer.hook_x_proj``): the module's output as the model continues with it. A convolution's output
  ``[b, channels, p + padding]`` is shown as the model uses it, ``[b, p, channels]`` (the first ``p`` positions: the
  causal convolution's; an edit goes back there). The child whose output is the mixer's output (the output
  projection) is served by its input instead, ``<mixer>.hook_<child>_input`` ``[b, p, d_inner]``, TransformerLens'
  ``hook_z`` of the mixer (its output is ``hook_attn_out`` already). Each is verified when the model is wrapped (its
  value and an edit, against plain PyTorch hooks on the same module: :mod:`.verify`); one that fails is not served.
  A model may compute a child's work from its weights without calling it in some forward passes (cached decoding, a
  fused kernel): a hook on such a point then raises an error naming it, never reads nothing silently.
* **Norms, ``hook_resid_mid`` and MLP points** of every layer of the mixer form, and of every layer with branches of a
  model that has one (a hybrid's attention layers too): ``ln1``/``ln2.hook_scale`` and
  ``hook_normalized`` where a norm child reads the layer's input (``ln1``) or ``resid_pre + mixer_out`` (``ln2``)
  and its output is the mixer's (the MLP's) input, LayerNorm or RMSNorm with its own weight and ``eps``;
  ``hook_resid_mid`` where ``ln2`` (or the MLP) reads ``resid_pre + mixer_out`` (an edit also reaches the layer's
  output, which adds its own copy of it); ``mlp.hook_pre`` (``hook_pre_linear``) and ``mlp.hook_post`` where the
  dense description reads the MLP (:func:`.describe._describe_mlp`: gate and up projections' outputs, the down
  projection's input); and the model's ``ln_final.hook_scale`` (:mod:`.plugin`). Verified at wrap time with the
  internals.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.mixer_sites import (  # noqa: F401  (their old import path)
    SUM_POINTS,
    Internal,
    InternalsSite,
    SumReference,
    _conv_positions,
    _conv_view,
)
from lensadapters.adapters.generic.probe import Recording, _close
from lensadapters.adapters.generic.references import Reference
from lensadapters.adapters.generic.shared_expert import shared_point_names, shared_reference
from lensadapters.hooks.sites import Site, first_input, first_output, replace_first_input

Tensor = torch.Tensor


@dataclass
class LayerMixing:
    """What :func:`probe_mixers` saw of one layer: which branch children mix positions, and how often each
    linear or convolution child of a branch child ran (by path relative to the layer)."""

    mixes: dict[str, bool]
    calls: dict[str, int]


@dataclass(frozen=True)
class MixerLayer:
    """The points of one layer of the mixer form beyond its branches (paths relative to the layer): the token
    mixer's internals, the pre-norms ``(role, path, NormBehaviour)``, ``hook_resid_mid`` (at ``mid``: the module
    reading ``resid_pre + mixer_out``, where the MLP branch reads it), and the MLP's ``MLPLayout`` where the dense
    description (:func:`.describe._describe_mlp`) reads it. ``mid_add``: the MLP child whose output the layer adds
    to ``resid_mid`` as its output (checked on the probe: the layer's output is ``resid_mid`` plus that child's
    output), where an edit's difference is carried while the layer trains with gradient checkpointing."""

    internals: tuple[Internal, ...] = ()
    norms: tuple[tuple[str, str, Any], ...] = ()
    mid: Optional[str] = None
    mlp: Optional[Any] = None
    #: the layer's :class:`.parallel.Split` where its branch points are the contributions its own sums compute
    #: (:class:`.mixer_sites.SumSite`, reading the middle at ``mid``), and the point of each module before the middle
    sum: Optional[Any] = None
    contributions: tuple[str, ...] = ()
    mid_add: Optional[str] = None
    #: an MLP of two modules summed (routed experts and a shared MLP beside them, ``moe`` None): the shared MLP as a
    #: shared expert (:class:`.shared_expert.SharedExpert`, paths relative to the layer), its points
    #: ``mlp.shared_expert.*``; with ``moe``: the MoE's own shared expert where it is described
    #: the MLP's :class:`~lensadapters.moe.MoELayout` where it is a mixture of experts the generic description reads
    #: (:func:`.moe.describe_moe`): its routing points with a plain reference (:data:`MOE_POINTS`), served by the
    #: core's :class:`~lensadapters.moe.MoESite`
    moe: Optional[Any] = None
    shared: Optional[Any] = None
    #: why the layer's MLP, a mixture of experts, has no ``mlp.*`` point (the MoE description refused it)
    moe_why: Optional[str] = None

    def before(self, slot: str, inside: bool = False) -> list[str]:
        """The points firing before the mixer (``"attn"``) or MLP (``"mlp"``) runs (``inside``: while it runs, before
        its output), in order."""
        norms = {role: [f"{role}.hook_scale", f"{role}.hook_normalized"] for role, _, _ in self.norms}
        if slot == "attn":
            return [p.name for p in self.internals] if inside else norms.get("ln1", [])
        if not inside:
            return []
        mlp = [] if self.mlp is None else ["mlp.hook_pre"] + (["mlp.hook_pre_linear"] if self.mlp.pre_linear else [])
        mlp += ["mlp.hook_post"] * bool(mlp)
        shared = shared_point_names(self.shared) if self.shared is not None else []
        if self.moe is not None:
            before = self.shared is not None and self.shared.before_router
            moe = moe_points(self.moe)
            mlp = [*shared, *moe] if before else [*moe, *shared]
        else:  # a shared MLP beside routed experts the form does not describe
            mlp += shared
        return ["hook_resid_mid"] * (self.mid is not None) + norms.get("ln2", []) + mlp

    def checked(self) -> list[str]:
        """Every point of the layer the mixer form serves (checked at wrap time), the branches' too."""
        return [*self.before("attn"), *self.before("attn", True), *self.before("mlp", True)]


#: the routing points of a mixture of experts of the mixer form with a plain PyTorch reference wherever the experts are
#: fused (the router's logits and the weights the experts module is called with), in the order they fire; the others
#: (:func:`moe_points`) have one where the router returns the routing (:func:`.moe_references.routed_reference`)
MOE_POINTS = ("mlp.hook_router_logits", "mlp.hook_routing_weights")


def moe_points(moe: Any) -> list[str]:
    """Every point of a mixer-form layer's mixture of experts, in the order they fire (the core's
    :func:`~lensadapters.moe.moe_point_names`: the routing points, then each expert's); each is served only where
    the wrap-time verification checked it against its reference (:func:`reference`), the others are reported."""
    from lensadapters.adapters.moe import moe_point_names

    return moe_point_names(moe)


#: why a layer of three branch children with no exact sum before its middle has no hook_attn_out (:mod:`.parallel`)
SCALED = (
    "no sum of the outputs of the layer's modules before its middle is what it adds to the residual (it scales "
    "them, a branch multiplier, or one of them is no branch: a norm with matrix parameters)"
)

#: each wrapped model's layers of the mixer form, by index: what :func:`reference` checks their points against
FORMS: "weakref.WeakKeyDictionary[nn.Module, dict[int, MixerLayer]]" = weakref.WeakKeyDictionary()


def _has_matrix(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def _is_unit(module: nn.Module) -> bool:
    """A linear module or a 1-D convolution (a mixer-internal point's module)."""
    weight = getattr(module, "weight", None)
    linear = isinstance(module, nn.Linear) or (
        isinstance(weight, Tensor) and weight.dim() == 2 and "Linear" in type(module).__name__
    )
    return linear or isinstance(module, nn.Conv1d)


def _branch_children(layer: nn.Module) -> list[str]:
    return [name for name, child in layer.named_children() if _has_matrix(child)]


def probe_mixers(model: nn.Module, layers: list[nn.Module], rec: Recording) -> dict[int, LayerMixing]:
    """One forward pass on the probe's tokens: for each layer with no attention-interface call, whether each
    branch child's output at positions after the first changes when the first position of its input changes (the
    child re-run on that edited input), and how many times each linear or convolution child of a branch child runs.
    Empty when every layer calls the attention interface, or when the pass fails (nothing is then served by the
    mixer form)."""
    wanted = [i for i in range(len(layers)) if not any(c.layer == i for c in rec.calls)]
    if not wanted or rec.input_ids is None:
        return {}
    out = {i: LayerMixing({}, {}) for i in wanted}
    handles: list[Any] = []
    busy: list[bool] = []

    def on_branch(i: int, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if busy:
                return
            x, y = first_input(args, kwargs), first_output(output)
            if not isinstance(x, Tensor) or not isinstance(y, Tensor) or x.dim() != 3 or y.dim() != 3:
                return
            if x.shape[1] < 2 or y.shape[:2] != x.shape[:2]:
                return
            edited = x.clone()
            edited[:, 0] = edited[:, 0] + x[:, 0].abs().mean() + 1.0
            busy.append(True)
            try:
                a, k = replace_first_input(args, kwargs, edited)
                again = first_output(module(*a, **k))
            finally:
                busy.clear()
            # beyond rounding: an MLP of experts may group the tokens differently once one token's routing changes
            out[i].mixes[name] = not _close(again[:, 1:], y[:, 1:])

        return hook

    def on_unit(i: int, path: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not busy:
                out[i].calls[path] = out[i].calls.get(path, 0) + 1

        return hook

    try:
        for i in wanted:
            for name in _branch_children(layers[i]):
                child = layers[i].get_submodule(name)
                handles.append(child.register_forward_hook(on_branch(i, name), with_kwargs=True))
                for sub, unit in child.named_children():
                    if _is_unit(unit):
                        handles.append(unit.register_forward_hook(on_unit(i, f"{name}.{sub}")))
        ids = rec.input_ids
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, return_dict=True)
    except Exception:  # the model does not run this way: no layer is served by the mixer form
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return out


def branches(
    i: int, layer: nn.Module, rec: Recording, mixing: Optional[LayerMixing], attention: Optional[str], sums: Callable
) -> Optional[tuple[Optional[str], Optional[str]]]:
    """``(mixer, mlp)``: the children whose outputs are ``hook_attn_out`` and ``hook_mlp_out`` (either may be
    ``None``), by the module docstring's rules; ``None`` where the layer is not of the mixer form. ``attention``: the
    child holding the module the layer calls the attention interface with; ``sums(x, parts, y)``: whether
    ``y == x + sum(parts)`` (:func:`.identify._sums_to_output`)."""
    names = _branch_children(layer)
    records = [rec.children.get((i, n)) for n in names]
    x, y = rec.layer_in.get(i), rec.layer_out.get(i)
    if len(names) == 3:  # parallel mixers, or an MLP of two modules (.parallel)
        from lensadapters.adapters.generic import parallel

        found = _split(i, layer, rec)
        if found is None:
            return None
        pair = parallel.branches(found, attention)
        if pair is None or len(found.before) == 2 or pair[0] is None or pair[0] == attention:
            return pair
        return pair if mixing is not None and mixing.mixes.get(pair[0]) else None
    if not 1 <= len(names) <= 2 or x is None or y is None or any(r is None or r.calls != 1 for r in records):
        return None
    first = {n: k for k, e in enumerate(rec.events) for n in names if e[:3] == ("child", i, n)}
    order = sorted(names, key=lambda n: first.get(n, -1))
    if not sums(x.value, [r.value for r in records if r is not None], y.value):
        scaled = _split(i, layer, rec) if len(order) == 2 else None  # added times constants (.parallel)
        if scaled is None or not scaled.summed:
            return None
        first_, second = scaled.before[0], scaled.after[0]
        return (first_, second) if attention in (None, first_) else None
    if len(order) == 2:
        return (order[0], order[1]) if attention in (None, order[0]) else None
    only = order[0]
    if only == attention or (mixing is not None and mixing.mixes.get(only)):
        return only, None
    if mixing is None or only not in mixing.mixes:
        return None  # not seen mixing or not: unknown
    return None, only


def _split(i: int, layer: nn.Module, rec: Recording) -> Any:
    """The :class:`.parallel.Split` of a layer with three branch children, or two it adds scaled; ``None`` for any
    other layer."""
    from lensadapters.adapters.generic.parallel import layer_split

    return layer_split(i, layer, rec)


def internals(i: int, layer: nn.Module, mixer: str, rec: Recording, mixing: Optional[LayerMixing]) -> list[Internal]:
    """The internal points of the token mixer ``mixer`` of layer ``i`` (the module docstring's rules), in the order
    their modules returned in the probe."""
    if mixing is None:
        return []
    out_value = rec.children[(i, mixer)].value
    found = []
    for (layer_i, path), (x, y) in rec.inner.items():
        if layer_i != i or "." not in path or path.rsplit(".", 1)[0] != mixer or mixing.calls.get(path) != 1:
            continue
        sub = path.rsplit(".", 1)[1]
        if not sub.isidentifier() or x is None or y is None:
            continue
        unit = layer.get_submodule(path)
        if isinstance(unit, nn.Conv1d):
            if y.dim() == 3 and x.dim() == 3 and _conv_positions(unit, y.shape[-1]) == x.shape[-1]:
                found.append(Internal(f"{mixer}.hook_{sub}", path, conv=True))
        elif _close(y, out_value):
            found.append(Internal(f"{mixer}.hook_{sub}_input", path, input=True))
        else:
            found.append(Internal(f"{mixer}.hook_{sub}", path))
    return found


def pre_norms(
    i: int, layer: nn.Module, rec: Recording, mixer: Optional[str], mlp: Optional[str]
) -> tuple[tuple[str, str, Any], ...]:
    """``(role, path, behaviour)`` of the pre-norms of a layer of the mixer form: ``ln1`` the norm child reading the
    layer's input whose output is the mixer's input, ``ln2`` the one reading ``resid_pre + mixer_out`` (or the
    layer's input where there is no mixer) whose output is the MLP's input; each LayerNorm or RMSNorm of its input
    with its own weight and a readable ``eps`` (:func:`.norms.norm_behaviour`)."""
    from lensadapters.adapters.generic.norms import norm_behaviour

    x = rec.layer_in.get(i)
    if x is None:
        return ()
    resid_pre = x.value
    mixer_in = rec.inner.get((i, mixer), (None, None))[0] if mixer is not None else None
    mlp_in = rec.inner.get((i, mlp), (None, None))[0] if mlp is not None else None
    mid = resid_pre + rec.children[(i, mixer)].value if mixer is not None else resid_pre
    three = _split(i, layer, rec)
    if three is not None:  # the layer's middle adds every branch before it; the MLP's modules read one input
        from lensadapters.adapters.generic.parallel import mid_value

        mid = mid_value(resid_pre, i, rec, three)
        mlp_in = rec.inner.get((i, three.after[0]), (None, None))[0]
        beside = [rec.inner.get((i, n), (None, None))[0] for n in three.before if n != mixer]
        if three.summed and mixer in three.before and beside and beside[0] is not None:
            mixer_in = beside[0]  # ln1 feeds the mixer beside the attention as it is (the attention's input: scaled)
    found: dict[str, tuple[str, str, Any]] = {}
    for name, child in layer.named_children():
        a, b = rec.inner.get((i, name), (None, None))
        if name in (mixer, mlp) or a is None or b is None or _has_matrix(child):
            continue
        for role, reads, feeds in (("ln1", resid_pre, mixer_in), ("ln2", mid, mlp_in)):
            if role in found or feeds is None or not (_close(a, reads) and _close(b, feeds)):
                continue
            behaviour = norm_behaviour(child, a, b)
            if behaviour is not None and behaviour.eps is not None:
                found[role] = (role, name, behaviour)
                break
    return tuple(found[role] for role in ("ln1", "ln2") if role in found)


def layer_form(
    model: Optional[nn.Module],
    i: int,
    layer: nn.Module,
    rec: Recording,
    mixing: Optional[LayerMixing],
    mixer: Optional[str],
    mlp: Optional[str],
    inside: bool = True,
) -> MixerLayer:
    """A mixer-form layer's points beyond its branches (``mixer``: its token mixer; ``inside``: whose internals are
    served, where it does not call the attention interface)."""
    from lensadapters.adapters.generic.describe import NotDescribed, _describe_mlp
    from lensadapters.hooks.specs import MLPLayout, OpaqueMLP

    softmax = mixer is not None and type(layer.get_submodule(mixer)).__name__.endswith("Attention")
    internal = tuple(internals(i, layer, mixer, rec, mixing)) if mixer is not None and inside and not softmax else ()
    found = pre_norms(i, layer, rec, mixer, mlp)
    layout = mid = add = moe = shared = moe_why = None
    if mlp is not None and model is not None:
        try:
            dense = _describe_mlp(model, layer, i, mlp, rec)[0]
        except NotDescribed:
            dense = None
        layout = dense if isinstance(dense, MLPLayout) else None
        if dense is None and mlp is not None:  # a mixture of experts (.moe), the layer adding its output as it is
            from lensadapters.adapters.generic.moe import describe_other_mlp
            from lensadapters.adapters.generic.shared_expert import describe_shared_expert
            from lensadapters.adapters.moe import MoELayout

            other = describe_other_mlp(model, layer, i, mlp, rec, False)
            if isinstance(other, MoELayout):
                moe, shared = other, describe_shared_expert(model, layer, i, other, rec)
            elif isinstance(other, OpaqueMLP):
                moe_why = other.why
        x = rec.layer_in.get(i)
        if mixer is not None and x is not None:
            ln2 = next((path for role, path, _ in found if role == "ln2"), None)
            reads = rec.inner.get((i, ln2 or mlp), (None, None))[0]
            if reads is not None and _close(reads, x.value + rec.children[(i, mixer)].value):
                mid = ln2 or mlp
                out, branch = rec.layer_out.get(i), rec.children.get((i, mlp))
                if out is not None and branch is not None and _close(out.value, reads + branch.value):
                    add = mlp  # the layer's output is resid_mid plus the MLP's output, as it adds them
    three = _split(i, layer, rec)
    if three is not None:  # hook_resid_mid: what ln2 reads, the input plus every branch before the middle
        from lensadapters.adapters.generic.parallel import mid_value

        ln2 = next((path for role, path, _ in found if role == "ln2"), None)
        x = rec.layer_in.get(i)
        reads = rec.inner.get((i, ln2), (None, None))[0] if ln2 is not None else None
        mid = ln2 if reads is not None and x is not None and _close(reads, mid_value(x.value, i, rec, three)) else None
        if three.summed and mid is not None and mixer in three.before:  # the branch points: what the layer adds
            names = tuple("hook_attn_out" if n == mixer else "hook_mixer_out" for n in three.before)
            shared = _shared_mlp(model, i, layer, rec, three, mixer) if model is not None and mixer else None
            return MixerLayer(internal, found, mid, layout, three, names, shared=shared)
        out, branch = rec.layer_out.get(i), rec.children.get((i, three.after[0])) if len(three.after) == 1 else None
        add = None
        if mid is not None and reads is not None and out is not None and branch is not None:
            add = three.after[0] if _close(out.value, reads + branch.value) else None
    return MixerLayer(internal, found, mid, layout, mid_add=add, moe=moe, shared=shared, moe_why=moe_why)


def _shared_mlp(model: nn.Module, i: int, layer: nn.Module, rec: Recording, three: Any, mixer: str) -> Optional[Any]:
    """The shared MLP of a layer whose MLP is two modules it adds as one sum, a mixture of experts and a module the
    dense description reads (:func:`.describe._routed_and_shared`), as a shared expert; ``None`` for another."""
    from lensadapters.adapters.generic.describe import _routed_and_shared
    from lensadapters.adapters.generic.shared_expert import describe_sibling_expert

    pair = _routed_and_shared(model, layer, i, three, mixer, rec)
    return describe_sibling_expert(model, layer, i, pair[1], pair[0], rec) if pair is not None else None


def reference(hooked: Any, layer: nn.Module, i: int, rest: str) -> Optional[Reference]:
    """The plain-PyTorch reference of a point the mixer form serves beyond the branches (:mod:`.references`),
    ``None`` for any other name: a module's output or input, a pre-norm's scale or normalized value, ``hook_resid_mid``
    the input of the module reading it together with the layer's output (an edit reaches the residual too)."""
    from lensadapters.adapters.generic.references import _norm_reference

    form = FORMS.get(hooked.hf_model, {}).get(i)
    if form is None:
        return None
    get = layer.get_submodule
    if form.sum is not None and form.mid is not None and rest in SUM_POINTS:
        spec = SumReference(layer, get(form.mid), form.sum, rest, list(form.contributions))
        return Reference("hooks", layer, spec=spec)
    point = next((p for p in form.internals if p.name == rest), None)
    if point is not None:
        module = get(point.path)
        if point.conv:
            assert isinstance(module, nn.Conv1d)
            return Reference("out", module, *_conv_view(module))
        return Reference("in" if point.input else "out", module)
    for role, path, _ in form.norms:
        if rest.startswith(f"{role}."):
            return _norm_reference(hooked, get(path), rest.split(".")[-1])
    if rest == "hook_resid_mid" and form.mid is not None:
        return Reference("in", get(form.mid), also=Reference("out", layer))
    if form.shared is not None and rest.startswith("mlp.shared_expert."):  # the shared expert's own modules
        from lensadapters.adapters.generic.references import _part, _unflat

        found = shared_reference(form.shared, rest)
        if found is None:
            return None
        side, path, fused, index = found
        if fused is not None:
            return Reference(side, get(path), *_part(fused.split, fused.merge, index))
        if form.moe is not None:  # the MoE's own shared expert: its tokens flattened, as the MoE gives them
            return Reference(side, get(path), unview=_unflat, flat=True)
        return Reference(side, get(path))
    if form.mlp is not None and rest in ("mlp.hook_pre", "mlp.hook_pre_linear"):
        path = form.mlp.pre if rest == "mlp.hook_pre" else form.mlp.pre_linear
        c = form.mlp.pre_scale if rest == "mlp.hook_pre" else 1.0
        if c != 1.0:  # the activation's input (MLPLayout.pre_scale), an edit divided back
            return Reference("out", get(path), lambda t: t * c, lambda d, t: d / c)
        return Reference("out", get(path))
    if form.mlp is not None and rest == "mlp.hook_post":
        return Reference("in", get(form.mlp.out))
    if form.moe is not None and rest in moe_points(form.moe):
        from lensadapters.adapters.generic.moe_references import routed_reference
        from lensadapters.adapters.generic.references import _moe_reference, _unflat

        routed = routed_reference(get, form.moe, rest)
        if routed is not None:  # the routing's further points and the experts' (a router returning the routing)
            spec, flat = routed
            return Reference(
                "hooks", get(form.moe.router), unview=_unflat if flat else (lambda d, t: d), flat=flat, spec=spec
            )
        return _moe_reference(get, form.moe, rest)
    return None


def _checked(block: Any) -> tuple[str, ...]:
    """The points of a mixer-form layer checked at wrap time: what the form adds, and the branches."""
    names = block.mixer.checked() if block.mixer is not None else []
    return tuple(n for n in [*names, "hook_attn_out", "hook_mixer_out", "hook_mlp_out"] if n in block.points)


def _expert_representative(found: Any, name: str) -> Any:
    """The points whose verdict a mixer-form MoE's per-expert point ``name`` (``blocks.{i}.mlp.experts.{e}.*``)
    shares: the same step of the layer's first and last experts (one fused module computes every expert alike, from
    its own slice of the same parameters; the two ends catch a wrong slicing); ``name`` itself for those two and for
    any other point. The check then costs four experts' forward passes, not one per expert (a real model's 64 to
    128), as layers of one class share the first one's verdicts."""
    parts = name.split(".")
    if len(parts) != 6 or parts[2:4] != ["mlp", "experts"] or not parts[4].isdigit() or not parts[1].isdigit():
        return name
    form = found.blocks[int(parts[1])].mixer
    if form is None or form.moe is None:
        return name
    last = form.moe.routing.n_experts - 1
    if int(parts[4]) in (0, last):
        return name
    return tuple(".".join([*parts[:4], str(e), parts[5]]) for e in (0, last))


def _leave_as_probed(model: Any) -> None:
    """One more forward pass at the probe's batch size (one row), with the model's cache: a recurrent layer may keep
    its state in the module, sized by the last batch it ran (transformers 4.x's RecurrentGemma, whose forward without
    a cache then fails on a smaller batch), and the verification's passes are several rows; the model is left as
    the probe left it."""
    from lensadapters.adapters.generic.probe import PROBE_LENGTH

    weight = getattr(model.get_input_embeddings(), "weight", None)
    device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
    ids = torch.zeros(1, PROBE_LENGTH, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    except Exception:  # a model that does not run so: nothing to restore
        pass


def verify_internals(hooked: Any, found: Any, verifying: Any) -> dict[str, str]:
    """Check the mixer-internal points of ``hooked`` (a wiring being built) and the branch points of their layers
    (:func:`.verify.check_points`, on a second wiring of the same model, built, checked and uninstalled; layers of
    one class with the same points share the first one's verdicts), remove those that fail (``found.missing`` says
    why) and return them with why. ``verifying``: the models being verified (their second wiring skips this)."""
    from lensadapters.adapters.generic.recheck import check_second_wiring

    reps: dict[int, int] = {}
    seen: dict[Any, int] = {}
    for i, (layer, block) in enumerate(zip(hooked.block_modules, found.blocks)):
        if block.mixer is not None:
            reps[i] = seen.setdefault((type(layer), _checked(block)), i)
    names = [f"blocks.{i}.{name}" for i in sorted(set(reps.values())) for name in _checked(found.blocks[i])]
    names += [name for name in ("ln_final.hook_scale", "ln_final.hook_normalized") if name in hooked.hook_dict]
    standing = {name: rep for name in names if (rep := _expert_representative(found, name)) != name}
    names = [name for name in names if name not in standing]
    results, _ = check_second_wiring(hooked, verifying, names)
    _leave_as_probed(hooked.hf_model)
    raised = [name for name, why in results.items() if why is not None and "raised" in why]
    if raised:  # a pass raised: again one point per pass, at the probe's batch size (see _leave_as_probed)
        results.update(check_second_wiring(hooked, verifying, raised, points_per_pass=1)[0])
        _leave_as_probed(hooked.hf_model)
    for name, rep in standing.items():  # an expert between the first and the last: their verdict on its step
        whys = [results.get(r, f"{r} (whose verdict it shares) was not checked") for r in rep]
        results[name] = next((f"as {r}: {why}" for r, why in zip(rep, whys) if why is not None), None)
    names += list(standing)
    failed = {name: why for name in names if not name.startswith("blocks.") and (why := results.get(name))}
    for i, rep in reps.items():
        for name in _checked(found.blocks[i]):
            why = results.get(f"blocks.{rep}.{name}")
            if why is not None:
                failed[f"blocks.{i}.{name}"] = why
    for name in failed:
        if name in hooked.hook_dict:
            hooked.claim_point(name)
            hooked.remove_point(name)
    if failed:
        by_reason: dict[str, list[str]] = {}
        for name, why in failed.items():
            by_reason.setdefault(why, []).append(name)
        found.missing["token-mixer points that failed verification"] = "; ".join(
            f"{', '.join(names)}: {why}" for why, names in by_reason.items()
        )
    return failed


def serve_verified_internals(hooked: Any, found: Any, sites: list[Site], verifying: Any) -> list[Site]:
    """``sites`` without the points that fail :func:`verify_internals` (nothing is checked while ``hooked`` is the
    second wiring of a verification: its model is in ``verifying``). The selective-scan points (:mod:`.scan`) are
    the caller's: one call for every layer, described or not."""
    if hooked.hf_model in verifying:
        return sites
    failed = verify_internals(hooked, found, verifying)
    kept: list[Site] = []
    from lensadapters.adapters.moe import MoESite

    for site in sites:
        if isinstance(site, (InternalsSite, MoESite)):  # each point refused on its own, the others served
            if site.keep(failed):
                kept.append(site)
            if isinstance(site, MoESite) and _experts_verified(site):  # its experts' weights: read as verified
                hooked.own_mlp_layouts[site.layer] = site.layout
        elif not any(p.name in failed for p in site.points):
            kept.append(site)
    return kept


def _experts_verified(site: Any) -> bool:
    """Whether every per-expert point of a mixer-form MoE's site passed the wrap-time verification (each expert
    computed from the fused parameters its description names, as the model computes it): the weight readers
    (``mlp_weights``, ``lensadapters.moe.expert_weights``) then read those parameters for the layer."""
    from lensadapters.adapters.moe import moe_point_names

    names = [n for n in moe_point_names(site.layout) if n.startswith("mlp.experts.")]
    served = {p.name for p in site.points}
    return bool(names) and all(f"blocks.{site.layer}.{n}" in served for n in names)


def register(model: nn.Module, found: Any, norms: Any) -> None:
    """Record a model's mixer-form layers (for :func:`reference`), and their pre-norms' behaviours in ``norms``
    (module to :class:`.norms.NormBehaviour`, what the generic adapter's ``lensadapters_norm_scale`` answers)."""
    FORMS[model] = {i: b.mixer for i, b in enumerate(found.blocks) if b.mixer is not None}
    layers = list(model.get_submodule(found.structure.layers).children())
    for i, form in FORMS[model].items():
        for _, path, behaviour in form.norms:
            norms[layers[i].get_submodule(path)] = behaviour
