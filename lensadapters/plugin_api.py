"""Everything a plugin may use, in one public module: ``from lensadapters.plugin_api import ...``.

A third-party plugin needs no other module of the core (``docs/writing-a-plugin.md`` imports only from here and
from :mod:`lensadapters`, :mod:`lensadapters.hf` and :mod:`lensadapters.testing`). Names outside ``__all__`` of
these modules are the core's own and may change between releases.

* **Hooks and the plugin-facing model**: ``hookimpl``, ``HOOKSPEC_VERSION``, :class:`Hooked` (what
  ``lensadapters_extra_sites``/``lensadapters_weight``... receive as ``hooked``), ``ContractVariant``.
* **The description language**: ``Architecture``, ``HookedConfig``, ``ModelLayout``, ``BlockLayout``,
  ``SeparateQKV``/``FusedQKV``, ``MLPLayout``/``FusedGateUp``, ``NormSpec``, ``ProjectionNorm``, ``RotarySpec``,
  ``LinearWeight``; rotary helpers (``rotate_half_spec``, ``apply_rotate_half``...), MoE descriptions
  (``MoELayout``, ``Routing``, ``stored_moe_layout``...).
* **Points, sites and per-forward state**: :class:`HookPoint`, :class:`Site` (``points``, ``wanted``,
  ``signature``, ``install``) and its order rule (``completes_output``/``reads_output``: below), the reusable
  core sites (``InputSite``, ``OutputSite``, ``NormSite``...; a gated DeltaNet's, ``gated_deltanet_site``, with separate
  or fused projections, ``DeltaNetProjections``; a query projection's output gate, ``query_gate_site``; a gated
  shared expert's, ``shared_expert_sites``), ``ForwardState`` (``hooked.forward_state``:
  ``site_values(site)`` is a dict private to one site within one forward pass, cleared after it),
  ``is_recomputing`` (a gradient-checkpoint recomputation is running), ``current_recompute_token`` (the
  ``RecomputeToken`` of the forward whose checkpointed blocks are being recomputed: ``forward_state.frame.token``
  in that forward, so a site can keep by it what the recomputation needs again), the tensor helpers of sites
  (``first_input``, ``replace_first_output``, ``split_heads``...), ``detachable`` (handles made inert in copies)
  and ``InstanceOverride`` (a per-instance method override that copies and pickles turn back into the class's;
  ``override_instance_method`` stores one and returns the handle removing it).
* **Weights**: ``read_linear`` (``[d_in, d_out]`` through every plugin), ``mlp_weights``, ``gated_query_weights``
  (a gated query projection's per-head query and gate rows) and ``gated_query_weight`` (a hybrid's ``W_Q``/``b_Q``
  answer from them, or its refusal naming the linear-attention layers), and the one reader of
  the named weights, ``read_weight``/``layer_weight`` (a ``lensadapters_weight`` override reaches every value
  derived from that weight: ``hm.W_O``, ``attn.hook_result``, the cache's decompositions); ``live_parameters``
  (offloaded modules), ``innermost_layer``/``wrapped_layers`` (adapter wrappers).
* **Own attention**: ``explicit_attention`` (scores, mask, softmax and values written out, through the score and
  pattern points) and ``site_attention`` (it, bound to a pattern site in ``activate(layer, site)``).
* **Errors**: ``UnsupportedModelError``, ``WeightUnavailableError``, ``PluginValidationError``.

**Order of hooks on a shared module.** Several sites may hook one module (a norm whose output a plugin's point
also shows, a projection whose output a per-head input edit completes). The order is a rule, not an accident of
attachment: a forward hook registered with :func:`completes_output` (it writes into the module's output what the
model computes with an edit: a norm's edited output, a folded per-head edit, a recomputed MoE output) runs before
every hook registered with :func:`reads_output` (it shows the output to a point) and before any other forward hook
of the module, whichever point was hooked first. The core's own sites follow the rule; so must a plugin's.
"""

from lensadapters.adapters import hf
from lensadapters.adapters.gated_deltanet import (
    FUSED_PER_KEY_HEAD,
    GATED_DELTANET_POINTS,
    SEPARATE_PROJECTIONS,
    DeltaNetProjections,
    GatedDeltaNetSite,
    gated_deltanet_paths,
    gated_deltanet_point_names,
    gated_deltanet_site,
    split_per_key_head,
)
from lensadapters.adapters.gated_parts import (
    SHARED_EXPERT_POINTS,
    QueryGateSite,
    query_gate_site,
    shared_expert_sites,
)
from lensadapters.adapters.hookspecs import HOOKSPEC_VERSION, ContractVariant, hookimpl
from lensadapters.adapters.latent_attention import (
    LatentAttention,
    LatentQKV,
    latent_rotary,
    latent_sites,
    latent_weights,
    refused_weight,
)
from lensadapters.adapters.layers import innermost_layer, wrapped_layers
from lensadapters.adapters.moe import (
    ExpertModules,
    FusedExperts,
    MoELayout,
    Routing,
    expert_tokens,
    router_weight,
    stored_moe_layout,
)
from lensadapters.adapters.protocol import Hooked
from lensadapters.errors import PluginValidationError, UnsupportedModelError, WeightUnavailableError
from lensadapters.hooks import specs as _specs
from lensadapters.hooks.copying import InstanceOverride, detachable, override_instance_method
from lensadapters.hooks.explicit_attention import explicit_attention, site_attention
from lensadapters.hooks.frames import ForwardState, FrameValues, current_recompute_token
from lensadapters.hooks.hook_point import HookPoint, is_recomputing
from lensadapters.hooks.offload import live_parameters
from lensadapters.hooks.rotary import (
    apply_rotate_half,
    half_table_rotate_half_spec,
    invert_rotate_half,
    rotate_half,
    rotate_half_spec,
)
from lensadapters.hooks.sites import (
    Handle,
    InputSite,
    NormSite,
    OutputSite,
    ProjectionSite,
    ScaledOutputSite,
    Site,
    completes_output,
    first_input,
    first_output,
    merge_heads,
    reads_output,
    replace_first_input,
    replace_first_output,
    split_heads,
)
from lensadapters.hooks.sites.qkv import rotary_angles
from lensadapters.hooks.specs import *  # noqa: F403  (the description language: specs.__all__)
from lensadapters.wiring.weights import (
    WEIGHT_NAMES,
    gated_query_weight,
    gated_query_weights,
    layer_weight,
    mlp_weights,
    read_linear,
    read_weight,
)

__all__ = [
    # hooks and the plugin-facing model
    "HOOKSPEC_VERSION",
    "ContractVariant",
    "Hooked",
    "hf",
    "hookimpl",
    # the description language
    *_specs.__all__,
    "LatentAttention",
    "LatentQKV",
    "latent_rotary",
    "latent_sites",
    "latent_weights",
    "refused_weight",
    "ExpertModules",
    "FusedExperts",
    "MoELayout",
    "Routing",
    "apply_rotate_half",
    "half_table_rotate_half_spec",
    "invert_rotate_half",
    "rotate_half",
    "rotary_angles",
    "rotate_half_spec",
    "stored_moe_layout",
    "DeltaNetProjections",
    "FUSED_PER_KEY_HEAD",
    "GATED_DELTANET_POINTS",
    "SEPARATE_PROJECTIONS",
    "gated_deltanet_paths",
    "gated_deltanet_point_names",
    "split_per_key_head",
    # points, sites, per-forward state, the order rule
    "ForwardState",
    "FrameValues",
    "Handle",
    "HookPoint",
    "InputSite",
    "NormSite",
    "OutputSite",
    "ProjectionSite",
    "ScaledOutputSite",
    "Site",
    "GatedDeltaNetSite",
    "QueryGateSite",
    "SHARED_EXPERT_POINTS",
    "gated_deltanet_site",
    "query_gate_site",
    "shared_expert_sites",
    "InstanceOverride",
    "override_instance_method",
    "detachable",
    "completes_output",
    "explicit_attention",
    "first_input",
    "first_output",
    "is_recomputing",
    "current_recompute_token",
    "merge_heads",
    "reads_output",
    "replace_first_input",
    "replace_first_output",
    "site_attention",
    "split_heads",
    # weights
    "WEIGHT_NAMES",
    "expert_tokens",
    "gated_query_weight",
    "gated_query_weights",
    "innermost_layer",
    "layer_weight",
    "live_parameters",
    "mlp_weights",
    "read_linear",
    "read_weight",
    "router_weight",
    "wrapped_layers",
    # errors
    "PluginValidationError",
    "UnsupportedModelError",
    "WeightUnavailableError",
]
