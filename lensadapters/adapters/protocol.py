"""What a plugin may use of a wrapped model: the ``hooked`` object its hook implementations receive.

``lensadapters_extra_sites(arch, hooked)``, ``lensadapters_attn_pattern(arch, hooked)`` and
``lensadapters_weight(arch, hooked, name)`` are given an object with exactly the members of :class:`Hooked`
(the core's :class:`lensadapters.wiring.Wiring`). Everything else on it is the core's own and may change
between releases; a plugin that needs more asks for it here.

The three things a plugin does with it:

* **Read the description** the plugins produced: ``cfg``, ``layout``, ``block_modules`` with their
  ``block_layouts``/``qkv_layouts``/``mlp_layouts``, ``attention_modules``.
* **Read weights** of the live model through every plugin (``read_linear``: LoRA deltas, quantized and offloaded
  storage) and norms (``norm_spec``).
* **Add hook points and sites** while the model is wrapped (inside ``lensadapters_extra_sites`` only):
  ``new_point(name, after=..., before=...)`` creates a point (``hook_names`` lists points in the order they fire:
  place a new point after the point that fires just before it), ``claim_point(name)`` takes over a point the core
  would serve (the core then builds nothing for it), ``register_norm(prefix, module)`` makes a plugin's own norm
  points known to ``norm_module`` (the core's ``NormSite`` does this itself), ``declare_projection_parts(parts)``
  says which points show the parts of a projection's output (a cross-cutting plugin wrapping that projection,
  LoRA, reads ``projection_parts`` to split its own contribution alike). The sites a plugin returns follow
  :class:`lensadapters.sites.Site`; state shared between sites within one forward pass goes in
  ``forward_state`` (a :class:`lensadapters.sites.ForwardState`, cleared after every call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, runtime_checkable

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.hooks.hook_point import HookPoint
    from lensadapters.hooks.sites import ForwardState
    from lensadapters.hooks.specs import (
        Architecture,
        BlockLayout,
        HookedConfig,
        LinearWeight,
        MLPLayouts,
        ModelLayout,
        NormSpec,
        ProjectionParts,
        QKVLayout,
    )

__all__ = ["Hooked"]


@runtime_checkable
class Hooked(Protocol):
    """The plugin-facing view of one wrapped model (see the module docstring)."""

    # the object that was wrapped (a ``PeftModel`` stays one) and the Hugging Face model inside it
    @property
    def model(self) -> Any: ...

    @property
    def hf_model(self) -> nn.Module: ...

    # the architecture the selected plugin declared, and ``hm.cfg``
    @property
    def arch(self) -> "Architecture": ...

    @property
    def cfg(self) -> "HookedConfig": ...

    # the description (paths relative to ``hf_model`` and to each block module)
    @property
    def layout(self) -> "ModelLayout": ...

    @property
    def block_modules(self) -> Sequence[nn.Module]: ...

    # ``None`` for an opaque block (``lensadapters_block`` returned ``None``: no core points, no layouts)
    @property
    def block_layouts(self) -> Sequence[Optional["BlockLayout"]]: ...

    @property
    def qkv_layouts(self) -> Sequence[Optional["QKVLayout"]]: ...

    @property
    def mlp_layouts(self) -> Sequence[Optional["MLPLayouts"]]: ...  # MLPLayout, FusedGateUp or MoELayout

    @property
    def attention_modules(self) -> Sequence[Optional[nn.Module]]: ...

    # values sites share within one forward pass
    @property
    def forward_state(self) -> "ForwardState": ...

    # adapter-hook callers over the selected architecture plugin, the cross-cutting plugins and the core
    # (``plugin_hooks.lensadapters_attn_scores(...)``), for a plugin's pattern backend
    @property
    def plugin_hooks(self) -> Any: ...

    @property
    def hook_names(self) -> list[str]:
        """Every hook point, in the order the points fire."""

    @property
    def hook_dict(self) -> dict[str, "HookPoint"]:
        """Every hook point by name."""

    @property
    def has_hooks(self) -> bool:
        """Whether any point has a hook attached; constant time (for a site's per-forward checks)."""

    def point(self, name: str) -> "HookPoint":
        """The point ``name``; ``UnknownHookError`` if there is none."""

    def new_point(self, name: str, after: Optional[str] = None, before: Optional[str] = None) -> "HookPoint":
        """Create a point, placed in ``hook_names`` after (or before) an existing one."""

    def claim_point(self, name: str) -> "HookPoint":
        """Serve a point the core created instead of the core (during ``lensadapters_extra_sites`` only)."""

    def declare_projection_parts(self, parts: "ProjectionParts") -> None:
        """Declare that the points ``parts.points`` (which exist) show the parts of ``parts.module``'s output, so
        that a plugin wrapping that projection splits its own contribution the same way (during
        ``lensadapters_extra_sites`` only; a plugin reading the declarations implements that hook ``trylast``)."""

    @property
    def projection_parts(self) -> Sequence["ProjectionParts"]:
        """The projections whose output is split into parts' points, as declared so far."""

    def register_norm(self, prefix: str, module: nn.Module) -> None:
        """Record the norm module behind ``{prefix}.hook_scale``/``hook_normalized``."""

    def norm_module(self, prefix: str) -> nn.Module:
        """The norm module behind ``{prefix}.hook_scale``."""

    def norm_spec(self, module: nn.Module) -> "NormSpec":
        """How a norm module normalizes, with its live weights (through every plugin)."""

    def read_linear(self, module: nn.Module) -> "LinearWeight":
        """The effective ``[d_in, d_out]`` weight and bias of a linear-like module, through every plugin."""

    def module_name(self, module: nn.Module) -> str:
        """The module's qualified name in ``hf_model`` (for error messages)."""

    def attention_implementation(self) -> str:
        """The attention implementation the model is configured with (``"sdpa"``, ``"eager"``...)."""
