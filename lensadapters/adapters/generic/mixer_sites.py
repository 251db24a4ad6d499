"""The sites of the mixer form (:mod:`.mixer`): a token mixer's internal points (``<mixer>.hook_<child>``, a
convolution's output as the model uses it), its layers' pre-norms, ``hook_resid_mid`` and dense MLP points, built from
the form a layer was given at wrap time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import Site, first_input, first_output, replace_first_input, replace_first_output

Tensor = torch.Tensor


@dataclass(frozen=True)
class Internal:
    """One mixer-internal point: ``name`` (relative to ``blocks.{i}.``), the module's path relative to the layer,
    whether it is the module's input (the output projection's) and whether it is a convolution's output."""

    name: str
    path: str
    input: bool = False
    conv: bool = False


def _conv_positions(conv: nn.Conv1d, length: int) -> Optional[int]:
    """How many input positions a stride-1 convolution's output of ``length`` positions stems from (its padding
    adds the rest), ``None`` for another convolution."""
    if conv.stride != (1,) or not isinstance(conv.padding, tuple):
        return None
    return length - 2 * conv.padding[0] + conv.dilation[0] * (conv.kernel_size[0] - 1)


def _conv_view(conv: nn.Conv1d) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]:
    """A convolution's output ``[b, c, p + pad]`` as ``[b, p, c]`` (its first ``p`` positions), and a delta back."""

    def view(t: Tensor) -> Tensor:
        return t[..., : _conv_positions(conv, t.shape[-1])].transpose(1, 2)

    def unview(d: Tensor, t: Tensor) -> Tensor:
        full = torch.zeros_like(t)
        full[..., : d.shape[1]] = d.transpose(1, 2).to(t.dtype)
        return full

    return view, unview


class InternalsSite(Site):
    """The internal points of one token mixer: each module's output (or the output projection's input) through
    ``HookPoint.apply``; a hooked point whose module did not run while its mixer ran raises (the model computed that
    value without calling the module: cached decoding, a fused kernel). Which points fired is each forward's own
    (``state``'s site values: another thread's forward, or one a hook runs inside it, has its own)."""

    def __init__(
        self, mixer: nn.Module, layer: nn.Module, points: list[tuple[Internal, HookPoint]], state: ForwardState
    ) -> None:
        self.mixer, self.layer, self.entries, self.state = mixer, layer, points, state
        self.points = tuple(p for _, p in points)

    @property
    def fired(self) -> set[str]:
        """The points that fired in this forward's run of the mixer."""
        values = self.state.site_values(self)
        fired = values.get("fired")
        if fired is None:
            fired = values["fired"] = set()
        return fired

    def install(self) -> list[Any]:
        handles = [
            self.mixer.register_forward_pre_hook(self._enter, with_kwargs=True),
            self.mixer.register_forward_hook(self._exit),
        ]
        for internal, point in self.entries:
            module = self.layer.get_submodule(internal.path)
            if internal.input:
                handles.append(module.register_forward_pre_hook(self._input(internal, point), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(self._output(internal, point), with_kwargs=True))
        return handles

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.fired.clear()

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        missing = [p.name for i, p in self.entries if p.has_live_hooks() and i.name not in self.fired]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)}: the model computed this forward pass's value without calling the module the "
                f"point reads (it uses the module's weights directly here: cached decoding or a fused kernel), so "
                f"the hook would see nothing. Remove the hook for this call, or run without a cache (use_cache=False)"
            )

    def _input(self, internal: Internal, point: HookPoint) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if internal.name in self.fired:
                return None
            self.fired.add(internal.name)
            edited, changed = point.apply(first_input(args, kwargs))
            return replace_first_input(args, kwargs, edited) if changed else None

        return hook

    def _output(self, internal: Internal, point: HookPoint) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if internal.name in self.fired:
                return None
            self.fired.add(internal.name)
            y = first_output(output)
            if not internal.conv:
                edited, changed = point.apply(y)
                return replace_first_output(output, edited) if changed else None
            assert isinstance(module, nn.Conv1d)
            view, unview = _conv_view(module)
            value = view(y)
            edited, changed = point.apply(value)
            if not changed:
                return None
            return replace_first_output(output, y + unview(edited - value, y))

        return hook

    def keep(self, failed: dict[str, str]) -> bool:
        """Drop the entries whose point failed verification; whether any is left."""
        self.entries = [(i, p) for i, p in self.entries if p.name not in failed]
        self.points = tuple(p for _, p in self.entries)
        return bool(self.entries)


def layer_sites(hooked: Any, i: int, layer: nn.Module, block: Any, points: dict[str, HookPoint]) -> list[Site]:
    """The sites of a mixer-form layer's points beyond its branches (``points``: the layer's, by relative name)."""
    from lensadapters.hooks.sites import NormSite

    form: Any = block.mixer  # the layer's MixerLayer (.mixer)
    sites: list[Site] = []
    if form.internals:
        entries = [(p, points[p.name]) for p in form.internals if p.name in points]
        sites.append(InternalsSite(layer.get_submodule(block.attn), layer, entries, hooked.forward_state))
    for role, path, _ in form.norms:
        norm = layer.get_submodule(path)
        hooked.register_norm(f"blocks.{i}.{role}", norm)
        scale, normalized = points[f"{role}.hook_scale"], points[f"{role}.hook_normalized"]
        sites.append(NormSite(norm, _spec_of(hooked, norm), scale, normalized))
    if form.sum is not None and form.mid is not None:  # the layer's own sums (.parallel): its branch points
        owned = {name: points[name] for name in SUM_POINTS if name in points}
        if owned:
            state = hooked.forward_state
            ln1 = next((layer.get_submodule(path) for role, path, _ in form.norms if role == "ln1"), None)
            mid = layer.get_submodule(form.mid)
            sites.append(SumSite(layer, mid, form.sum, form.contributions, owned, state, ln1))
    elif form.mid is not None and "hook_resid_mid" in points:
        add = layer.get_submodule(form.mid_add) if form.mid_add is not None else None
        reader = layer.get_submodule(form.mid)
        sites.append(ResidMidSite(layer, reader, points["hook_resid_mid"], hooked.forward_state, add))
    if form.shared is not None and form.moe is None:  # the shared MLP beside routed experts (.shared_expert)
        from lensadapters.adapters.generic.shared_expert import sibling_sites

        prefix = "mlp."
        owned = {name[len(prefix) :]: p for name, p in points.items() if name.startswith(prefix + "shared_expert.")}
        sites += sibling_sites(layer, form.shared, owned)
    if form.mlp is not None:
        mlp = form.mlp
        for name, path in (("mlp.hook_pre", mlp.pre), ("mlp.hook_pre_linear", mlp.pre_linear)):
            if name in points and path is not None:
                if name == "mlp.hook_pre" and mlp.pre_scale != 1.0:  # the activation's input (MLPLayout.pre_scale)
                    from lensadapters.hooks.sites import OutputSite

                    sites.append(OutputSite(layer.get_submodule(path), points[name], scale=mlp.pre_scale))
                    continue
                sites.append(_ModuleOutput(layer.get_submodule(path), points[name]))
        if "mlp.hook_post" in points:
            sites.append(_ModuleOutput(layer.get_submodule(mlp.out), points["mlp.hook_post"], output=False))
    if form.moe is not None:
        sites += _moe_sites(hooked, i, layer, block, form, points)
    return sites


def _moe_sites(
    hooked: Any, i: int, layer: nn.Module, block: Any, form: Any, points: dict[str, HookPoint]
) -> list[Site]:
    """The core's :class:`~lensadapters.moe.MoESite` of a mixer-form layer's mixture of experts (its routing and
    per-expert points this layer serves, :func:`.mixer.moe_points`; the others stand-ins never hooked, and those the
    wrap-time verification refuses become stand-ins one by one, :meth:`~lensadapters.moe.MoESite.keep`), and its
    shared expert's points."""
    from lensadapters.adapters.generic.shared_expert import shared_sites
    from lensadapters.adapters.moe import MoESite, is_expert_point, moe_point_names

    sites: list[Site] = []
    names = moe_point_names(form.moe)
    for n in names:  # the per-expert points: computed only while hooked, not cached by default
        if n in points:
            points[n].costly = is_expert_point(n)
    if any(n in points for n in names):
        given = {n: points[n] if n in points else HookPoint(f"blocks.{i}.{n}", lambda p: None) for n in names}
        sites.append(MoESite(hooked, i, form.moe, given, mlp_path=block.mlp))
    if form.shared is not None:
        pre = "mlp."
        shared = {n[len(pre) :]: p for n, p in points.items() if n.startswith(f"{pre}shared_expert.")}
        if shared:
            sites += shared_sites(hooked, i, layer, form.shared, shared)
    return sites


def _spec_of(hooked: Any, norm: nn.Module) -> Callable[[], Any]:
    return lambda: hooked.norm_spec(norm)


class _ModuleOutput(Site):
    """A module's output (or first input) as one point: what the model continues with."""

    def __init__(self, module: nn.Module, point: HookPoint, output: bool = True) -> None:
        self.module, self.point, self.output = module, point, output
        self.points = (point,)

    def install(self) -> list[Any]:
        if self.output:
            return [self.module.register_forward_hook(self._on_output)]
        return [self.module.register_forward_pre_hook(self._on_input, with_kwargs=True)]

    def _on_output(self, module: nn.Module, args: tuple, output: Any) -> Any:
        edited, changed = self.point.apply(first_output(output))
        return replace_first_output(output, edited) if changed else None

    def _on_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        edited, changed = self.point.apply(first_input(args, kwargs))
        return replace_first_input(args, kwargs, edited) if changed else None


class ResidMidSite(Site):
    """``hook_resid_mid`` of a mixer-form layer: ``resid_pre + mixer_out``, the input of the module the MLP branch
    reads it with (``ln2``, or the MLP); the layer adds its own copy of it to the MLP's output, so an edit is also
    added to the layer's output (completing it before anything reads it), exactly what the layer computes from the
    edited value. The edit's difference is each forward's own (``state``'s site values: another thread's forward,
    or one a hook runs inside it, has its own).

    While the layer trains with gradient checkpointing, and given ``add`` (the MLP child whose output the layer adds
    to ``resid_mid``), the difference is added to that child's output instead: transformers 5.x runs a layer's own
    forward hooks outside the checkpointed function (a reentrant checkpoint's first forward runs without gradients,
    and only the layer's inside is recomputed with them), so the layer's own ``resid_mid + mlp_out`` carries it and
    the recomputation recomputes it with gradients. Otherwise the layer's output gets it, as before."""

    def __init__(
        self,
        layer: nn.Module,
        reader: nn.Module,
        point: HookPoint,
        state: ForwardState,
        add: Optional[nn.Module] = None,
    ) -> None:
        self.layer, self.reader, self.point, self.state, self.add = layer, reader, point, state, add
        self.points = (point,)

    def _carried(self) -> bool:
        """Whether the difference goes into ``add``'s output (the layer trains with gradient checkpointing)."""
        layer: Any = self.layer
        return self.add is not None and bool(layer.training and getattr(layer, "gradient_checkpointing", False))

    @property
    def delta(self) -> list[Tensor]:
        """This forward's ``edited - resid_mid`` (empty: no edit to add to the layer's output)."""
        values = self.state.site_values(self)
        delta = values.get("delta")
        if delta is None:
            delta = values["delta"] = []
        return delta

    def install(self) -> list[Any]:
        from lensadapters.hooks.sites import completes_output

        handles = [
            self.layer.register_forward_pre_hook(lambda m, a: self.delta.clear()),
            self.reader.register_forward_pre_hook(self._on_input, with_kwargs=True),
            completes_output(self.layer, self._on_layer_output),
        ]
        if self.add is not None:
            handles.append(self.add.register_forward_hook(self._on_add_output))
        return handles

    def _on_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        x = first_input(args, kwargs)
        self.state.site_values(self).pop("carry", None)  # never a leftover of a forward that raised
        edited, changed = self.point.apply(x, protect=True)
        if not changed:
            return None
        if self._carried():  # into the layer's own resid_mid + mlp_out (recomputed by a checkpoint)
            self.state.site_values(self)["carry"] = edited - x
        else:
            self.delta[:] = [edited - x]
        return replace_first_input(args, kwargs, edited)

    def _on_add_output(self, module: nn.Module, args: tuple, output: Any) -> Any:
        carry = self.state.site_values(self).pop("carry", None)
        if carry is None:
            return None
        y = first_output(output)
        return replace_first_output(output, y + carry.reshape(y.shape).to(y.dtype))

    def _on_layer_output(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self.delta:
            return None
        y = first_output(output)
        return replace_first_output(output, y + self.delta.pop().to(y.dtype))


#: the branch points a layer's :class:`SumSite` serves, in the order they fire
SUM_POINTS = ("hook_attn_out", "hook_mixer_out", "hook_resid_mid", "hook_mlp_out")


class _LayerSum:
    """What a layer whose branches :class:`SumSite` serves adds, as it adds it (:mod:`.parallel`): ``split`` the
    layer's :class:`.parallel.Split`, ``reader`` the norm reading its middle. Each forward pass records the layer's
    input, the outputs before the middle (scaled: their contributions), the middle the reader gets and the outputs
    after it; :meth:`output` is the layer's output from those. With ``forward_state`` the records are each
    forward's own (its site values: another thread's forward, or one a hook runs inside it, has its own).

    ``entry``: the layer's pre-norm, whose input is the layer's input (``ln1``). While the layer trains with gradient
    checkpointing (:meth:`carried`), every record starts at ``entry`` and a replacement of the layer's output is
    carried into the last MLP module's output instead (:meth:`hooks`): transformers 5.x checkpoints a layer's
    ``forward`` and runs the layer's own forward hooks outside it, once, so the recomputation in the backward pass
    runs only the hooks on the layer's modules, and a reentrant checkpoint's first forward runs without gradients
    (the layer's own hooks would rebuild its output from values without a graph); transformers 4.x checkpoints the
    layer's ``__call__``, its hooks included, where this is the same."""

    def __init__(
        self,
        layer: nn.Module,
        reader: nn.Module,
        split: Any,
        forward_state: Optional[ForwardState] = None,
        entry: Optional[nn.Module] = None,
    ) -> None:
        self.layer, self.reader, self.split, self.entry = layer, reader, split, entry
        self.before = [layer.get_submodule(n) for n in split.before]
        self.after = [layer.get_submodule(n) for n in split.after]
        self.forward_state = forward_state
        self._state: dict[str, Any] = {}

    @property
    def state(self) -> dict[str, Any]:
        """This forward's records (the object's own without ``forward_state``)."""
        return self._state if self.forward_state is None else self.forward_state.site_values(self)

    @property
    def modules(self) -> list[nn.Module]:
        return [self.layer, self.reader, *self.before, *self.after]

    def checkpointed(self) -> bool:
        """Whether the layer trains with gradient checkpointing."""
        layer: Any = self.layer
        return bool(layer.training and getattr(layer, "gradient_checkpointing", False))

    def carried(self) -> bool:
        """Whether this forward's records start at ``entry`` and the output's replacement is carried into the last
        MLP module's output (the layer trains with gradient checkpointing and has an ``entry``)."""
        return self.entry is not None and self.checkpointed()

    def hooks(
        self,
        on_before: Callable[[int, Tensor], None],
        on_reader: Callable[[Tensor], Optional[Tensor]],
        on_output: Callable[[Tensor], Optional[Tensor]],
    ) -> list[Any]:
        """Plain PyTorch hooks: ``on_before(k, contribution)`` as the ``k``-th module before the middle returns,
        ``on_reader(middle)`` (a replacement for the reader's input, or ``None``), ``on_output(after)`` with the
        contribution after the middle (a replacement for the layer's output, or ``None``). While :meth:`carried`,
        the replacement's difference from the layer's own output (``read + after``, exactly: the split) enters the
        last MLP module's output divided by ``after_scale`` (inside the checkpointed function, so the recomputation
        recomputes it with gradients; its value the replacement's up to rounding)."""
        from lensadapters.adapters.generic.parallel import after_contribution, scale
        from lensadapters.hooks.sites import completes_output

        split = self.split

        def start(args: tuple, kwargs: dict) -> None:
            state = self.state
            state.clear()
            state["x"], state["after"] = first_input(args, kwargs), []

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.carried():
                start(args, kwargs)

        def enter_inside(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.carried():
                start(args, kwargs)

        def before(k: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                if "x" in self.state:
                    on_before(k, scale(first_output(output), split.before_scales[k]))

            return hook

        def reader(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            state = self.state
            if "x" not in state or "mid" in state:
                return None
            read = first_input(args, kwargs)
            new = on_reader(read)
            state["mid"], state["read"] = read if new is None else new, read
            return None if new is None else replace_first_input(args, kwargs, new)

        def after(module: nn.Module, args: tuple, output: Any) -> Any:
            state = self.state
            if "mid" not in state:
                return None
            state["after"].append(first_output(output))
            if len(state["after"]) != len(self.after) or not self.carried():
                return None
            y = first_output(output)  # the last MLP module's: carry the replacement's difference into it
            contribution = after_contribution(state["after"], split)
            new = on_output(contribution)
            own = state["read"] + contribution  # the layer's own output (exactly: the split)
            state.clear()
            if new is None:
                return None
            difference = new.to(own.dtype) - own
            if split.after_scale != 1.0:
                difference = difference / split.after_scale
            return replace_first_output(output, y + difference.reshape(y.shape).to(y.dtype))

        def out(module: nn.Module, args: tuple, output: Any) -> Any:
            state = self.state
            if "mid" not in state or len(state["after"]) != len(self.after):
                return None
            y = first_output(output)
            new = on_output(after_contribution(state["after"], split))
            state.clear()
            return None if new is None else replace_first_output(output, new.to(y.dtype))

        handles = [self.layer.register_forward_pre_hook(enter, with_kwargs=True)]
        if self.entry is not None:
            handles.append(self.entry.register_forward_pre_hook(enter_inside, with_kwargs=True))
        handles += [m.register_forward_hook(before(k)) for k, m in enumerate(self.before)]
        handles.append(self.reader.register_forward_pre_hook(reader, with_kwargs=True))
        handles += [m.register_forward_hook(after) for m in self.after]
        handles.append(completes_output(self.layer, out))
        return handles

    def middle(self, contributions: list[Tensor]) -> Tensor:
        from lensadapters.adapters.generic.parallel import middle

        return middle(self.state["x"], contributions, self.split)


class SumSite(Site):
    """The branch points of a layer that adds scaled outputs, or an MLP of two modules as one sum (:mod:`.parallel`):
    ``hook_attn_out`` and ``hook_mixer_out`` the contributions before its middle (each module's output times its
    constant), ``hook_resid_mid`` the middle its norm reads, ``hook_mlp_out`` the contribution after it, each read
    where the layer adds it. An edit of a contribution before the middle gives the norm the middle recomputed from the
    edited contributions (as the layer adds them); an edit there or after it gives the layer's output as the middle
    the norm read plus the contribution after it: exactly what the layer computes with the edited values (the
    modules' own outputs are never changed, so no edit is divided back by a constant). What a forward records is
    its own (``state``'s site values: another thread's forward, or one a hook runs inside it, has its own).

    While the layer trains with gradient checkpointing the edits are made inside the layer, from its pre-norm
    ``entry`` on, and the output's difference carried into the last MLP module's output (:class:`_LayerSum`), so the
    recomputation makes them again with gradients: exact values up to rounding there, bitwise otherwise."""

    def __init__(
        self,
        layer: nn.Module,
        reader: nn.Module,
        split: Any,
        contributions: tuple[str, ...],
        points: dict[str, Any],
        state: ForwardState,
        entry: Optional[nn.Module] = None,
    ) -> None:
        self.sum = _LayerSum(layer, reader, split, state, entry)
        self.before_points: list[Optional[HookPoint]] = [points.get(name) for name in contributions]
        self.mid_point, self.after_point = points.get("hook_resid_mid"), points.get("hook_mlp_out")
        self.points = tuple(p for p in [*self.before_points, self.mid_point, self.after_point] if p is not None)
        self.state = state

    def _values(self) -> dict[str, Any]:
        """This forward's ``"values"`` (the contributions before the middle, by their place in the split),
        ``"changed"`` (one of them edited) and ``"mid_changed"`` (the middle edited or recomputed)."""
        values = self.state.site_values(self)
        if "values" not in values:
            values.update(values={}, changed=False, mid_changed=False)
        return values

    def install(self) -> list[Any]:
        return self.sum.hooks(self._before, self._reader, self._output)

    def _before(self, k: int, contribution: Tensor) -> None:
        record, point = self._values(), self.before_points[k]
        if point is not None:
            contribution, changed = point.apply(contribution, protect=True)
            record["changed"] |= changed
        record["values"][k] = contribution

    def _reader(self, mid: Tensor) -> Optional[Tensor]:
        record = self._values()
        values = record["values"]
        changed = record["changed"] and len(values) == len(self.before_points)
        if changed:
            mid = self.sum.middle([values[k] for k in range(len(self.before_points))])
        if self.mid_point is not None:
            mid, edited = self.mid_point.apply(mid, protect=True)
            changed |= edited
        record.update(values={}, changed=False, mid_changed=changed)
        return mid if changed else None

    def _output(self, after: Tensor) -> Optional[Tensor]:
        record = self._values()
        changed = record["mid_changed"]
        if self.after_point is not None:
            after, edited = self.after_point.apply(after, protect=True)
            changed |= edited
        record["mid_changed"] = False
        if changed and self.sum.checkpointed() and not self.sum.carried():
            raise RuntimeError(
                f"{', '.join(p.name for p in self.points)}: an edit here needs the layer's pre-norm (ln1) to carry "
                f"it through gradient checkpointing, and this layer has none the probe found, so its gradients "
                f"would be wrong. Disable gradient checkpointing (model.gradient_checkpointing_disable()) or run "
                f"the model in eval mode"
            )
        return self.sum.state["mid"] + after if changed else None


class SumReference:
    """The plain-PyTorch reference of a :class:`SumSite` point (``Reference("hooks")``): the layer's own sums read
    and edited with plain hooks on its modules, the same rule as the site's, for the verification."""

    def __init__(self, layer: nn.Module, reader: nn.Module, split: Any, point: str, before: list[str]) -> None:
        self.sum = _LayerSum(layer, reader, split)
        self.point, self.before_names = point, before

    @property
    def modules(self) -> list[nn.Module]:
        return self.sum.modules

    def install(self, edit: Optional[Callable[[Tensor], Tensor]], seen: list[Tensor]) -> list[Any]:
        values: dict[int, Tensor] = {}

        def on_before(k: int, contribution: Tensor) -> None:
            if self.before_names[k] == self.point:
                seen.append(contribution.detach().clone())
                contribution = edit(contribution) if edit is not None else contribution
            values[k] = contribution

        def on_reader(mid: Tensor) -> Optional[Tensor]:
            edited = self.point in self.before_names and edit is not None and len(values) == len(self.before_names)
            new = self.sum.middle([values[k] for k in range(len(values))]) if edited else None
            values.clear()
            if self.point == "hook_resid_mid":
                seen.append(mid.detach().clone())
                new = edit(mid) if edit is not None else None
            return new

        def on_output(after: Tensor) -> Optional[Tensor]:
            if self.point == "hook_mlp_out":
                seen.append(after.detach().clone())
                after = edit(after) if edit is not None else after
            return self.sum.state["mid"] + after if edit is not None else None

        return self.sum.hooks(on_before, on_reader, on_output)
