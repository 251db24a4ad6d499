"""The adapter hooks: the contract between the core and its plugins (pluggy hookspecs).

Every hook is called at wrap time (or when weights are read), never per forward pass. When a model
is wrapped, the core selects one *architecture plugin* (a plugin implementing
``lensadapters_architectures``) and calls the architecture hooks over that plugin, the
*cross-cutting plugins* (PEFT, 8-bit, ... — plugins that claim no architecture) and the core's
defaults only: a plugin never sees another architecture's model, so its implementations need no
guard. Hooks marked ``firstresult`` stop at the first implementation that returns non-``None``.

Versioning: ``HOOKSPEC_VERSION`` follows semantic versioning. Adding a hook or an optional argument
is a minor change; removing or changing one is a major change. A plugin declares the major version
it was written for with a module attribute ``LENSADAPTERS_HOOKSPEC = "1"``; the registry refuses
plugins written for another major version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from lensadapters.adapters.protocol import Hooked
    from lensadapters.hooks.sites import Site
    from lensadapters.hooks.specs import (
        Architecture,
        BlockLayout,
        HookedConfig,
        LinearWeight,
        MLPLayouts,
        ModelLayout,
        NormSpec,
        QKVLayout,
    )

PROJECT = "lensadapters"
HOOKSPEC_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- discovery and matching -------------------------------------------------------------------


@hookspec
def lensadapters_architectures() -> Sequence["Architecture"]:
    """Return the architectures this plugin adapts (implemented by architecture plugins only)."""


@hookspec(firstresult=True)
def lensadapters_resolve_model(model: Any) -> Optional["nn.Module"]:
    """Return the Hugging Face ``PreTrainedModel`` inside a wrapper (``PeftModel``...), or ``None``.

    Called repeatedly until no plugin peels another layer.
    """


@hookspec
def lensadapters_validate(arch: "Architecture", model: "nn.Module") -> None:
    """Raise ``UnsupportedModelError`` (or warn) for a configuration the plugin cannot represent."""


@hookspec(firstresult=True)
def lensadapters_tiny_config(arch: "Architecture", seed: int) -> Any:
    """Return a small ``PretrainedConfig`` of this architecture for the demo and the CLI."""


# --- structure (the declarative description) --------------------------------------------------


@hookspec(firstresult=True)
def lensadapters_config(arch: "Architecture", model: "nn.Module") -> "HookedConfig":
    """Return ``hm.cfg`` for the model."""


@hookspec(firstresult=True)
def lensadapters_embed(arch: "Architecture", model: "nn.Module") -> "ModelLayout":
    """Where embeddings, position embeddings, rotary module, blocks, final norm and unembed live."""


@hookspec(firstresult=True)
def lensadapters_block(arch: "Architecture", model: "nn.Module", layer: int) -> Optional["BlockLayout"]:
    """Where the norms, attention and MLP of block ``layer`` live, and whether it is parallel.

    ``None`` makes the block *opaque*: the core creates no hook points for it (and ``lensadapters_attn_qkv`` /
    ``lensadapters_mlp_act`` may return ``None`` for it too); the plugin then creates and serves the points it can
    in ``lensadapters_extra_sites`` and overrides the weight accessors (``lensadapters_weight``) that need the
    block's description. The core's generic adapter describes every block this way.
    """


@hookspec(firstresult=True)
def lensadapters_attn_qkv(arch: "Architecture", model: "nn.Module", layer: int) -> Optional["QKVLayout"]:
    """How queries, keys and values are produced in block ``layer`` (separate or fused; rotary).

    ``None`` for a block whose token mixer is not softmax attention (a linear-attention or state-space layer of a
    hybrid model): the core then serves the block's residual, norm and MLP points and ``hook_attn_out`` (the output
    of ``BlockLayout.attn``, the mixer), but no ``attn.*`` point and no ``W_Q``/``W_K``/``W_V``/``W_O`` for it; the
    plugin serves the mixer's own points in ``lensadapters_extra_sites``.
    """


@hookspec(firstresult=True)
def lensadapters_mlp_act(arch: "Architecture", model: "nn.Module", layer: int) -> "MLPLayouts":
    """Which projections surround the MLP activation of block ``layer`` (``MLPLayout``, or ``FusedGateUp`` for one
    fused gate/up projection)."""


@hookspec(firstresult=True)
def lensadapters_norm_scale(arch: "Architecture", module: "nn.Module") -> "NormSpec":
    """How ``module`` normalizes (LayerNorm or RMSNorm, eps, weight, bias, weight offset).

    Architecture plugins declare their norms here. The core's fallback recognizes ``nn.LayerNorm`` and, for
    other classes named ``*RMSNorm``, checks the guess ``x / sqrt(mean(x²) + eps) * weight`` against the module on
    a probe input: a norm that computes something else (Gemma's ``(1 + weight)``) is refused, never guessed.
    """


# --- attention patterns -------------------------------------------------------------------------


@hookspec(firstresult=True)
def lensadapters_attn_pattern(arch: "Architecture", hooked: "Hooked") -> Any:
    """Return the backend that exposes attention scores and patterns (``PatternBackend``).

    The core's default serves architectures that call transformers' attention interface; a plugin
    for a model that computes attention itself returns its own backend.
    """


@hookspec(firstresult=True)
def lensadapters_attn_scores(
    arch: "Architecture",
    module: "nn.Module",
    query: "torch.Tensor",
    key: "torch.Tensor",
    scaling: Optional[float],
    implementation: str,
) -> Optional["torch.Tensor"]:
    """Return pre-mask attention scores ``[b, h, q, k]`` when the model computes them unusually.

    ``query`` is ``[b, h, q, d]`` and ``key`` ``[b, h, k, d]`` (grouped heads already repeated);
    ``scaling`` is what the model passed to the attention interface (``None`` if nothing);
    ``implementation`` the attention implementation the model was configured with ("sdpa",
    "eager"...), so the scores can mirror what that implementation computes.
    """


@hookspec(firstresult=True)
def lensadapters_attn_original(arch: "Architecture", module: "nn.Module", implementation: str) -> Optional[Any]:
    """Return the attention function transformers runs for ``module`` under ``implementation`` when that is not
    the attention interface's function, or ``None``.

    While a layer's patterns are hooked the config selects the lensadapters attention function for the whole
    model, and every *unhooked* layer is handed back to ``implementation``'s interface function. A model that
    bypasses the interface in some configurations (GPT-2's ``reorder_and_upcast_attn`` under eager attention)
    returns here what it would have run, with the interface's signature
    ``fn(module, query, key, value, attention_mask, **kwargs) -> (output [b, q, h, d], weights)``, so that
    unhooked layers keep the model's exact numbers.
    """


# --- weights ------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def lensadapters_linear_weight(module: "nn.Module", read: Any) -> Optional["LinearWeight"]:
    """Return the *effective* weight ``[d_in, d_out]`` and bias of a linear-like module, or ``None``.

    Cross-cutting plugins implement this for quantized storage and adapter wrappers; ``read(m)``
    reads another module through all plugins (for a wrapper's base layer).
    """


@hookspec(firstresult=True)
def lensadapters_weight(arch: "Architecture", hooked: "Hooked", name: str) -> Optional["torch.Tensor"]:
    """Override one weight accessor when the layout alone is not enough; ``None`` keeps the core's.

    ``name`` is one of ``lensadapters.weights.WEIGHT_NAMES``: ``W_E W_pos W_U b_U W_Q b_Q _W_K _b_K _W_V _b_V
    W_O b_O W_in b_in W_gate b_gate W_out b_out`` (``W_K``/``W_V`` are ``_W_K``/``_W_V`` repeated to the query
    heads). Return the whole tensor in TransformerLens' shape, read from the live parameters. ``W_E`` is the
    embedding table as stored: the core multiplies it by ``ModelLayout.embed_scale``.
    """


@hookspec(firstresult=True)
def lensadapters_module_attribute(module: "nn.Module", name: str) -> Optional[Any]:
    """Return attribute ``name`` of the module that ``module`` (a plugin's wrapper) stands for, as the wrapped
    forward computes with it, or ``None`` when ``module`` is not such a wrapper.

    Used for storage the core reads by attribute rather than as a linear layer (a fused experts module's 3-D
    parameters and activation): a plugin that adapts a parameter (PEFT's LoRA on ``gate_up_proj``) returns the
    effective value, delta included.
    """


# --- extra hook points ----------------------------------------------------------------------------


@hookspec
def lensadapters_extra_sites(arch: "Architecture", hooked: "Hooked") -> Sequence["Site"]:
    """Return additional ``Site`` objects: new hook points (adapter contributions...) or points taken over.

    Called once per wrap, after the core created its hook points and before it builds its sites: create
    points with ``hooked.new_point(name, after=...)``, take over a core point with ``hooked.claim_point(name)``
    (see :class:`lensadapters.protocol.Hooked`), and return the sites that serve them.
    """


# =================================================================================================
# Cross-cutting plugins: contract variants and wrapper layers
# (a plugin declares what it adds; the core and other plugins find it without naming the plugin)
# =================================================================================================


@dataclass(frozen=True)
class ContractVariant:
    """One variant of the contract suite, as a cross-cutting plugin declares it.

    * ``name``: a short identifier, also the command-line flag (``"lora"``: ``lensadapters check PLUGIN --lora``).
    * ``contract``: ``"package.module:ClassName"`` of the variant's mixin, an ``AdapterContract`` subclass that is
      put in front of an architecture's contract (``class T(Mixin, MyArchContract)``).
    * ``runs_on``: what the variant's models are, for messages (``"LoRA-adapted (PEFT) models"``).
    * ``distribution``: the distribution that ships the mixin (``pip install`` hints); ``None``: the declaring
      plugin's own distribution.
    """

    name: str
    contract: str
    runs_on: str
    distribution: Optional[str] = None


@hookspec
def lensadapters_contract_variants() -> Sequence["ContractVariant"]:
    """Return the variants of the contract suite this plugin offers (``lensadapters.ContractVariant``).

    A cross-cutting plugin that transforms models (LoRA adapters, quantization...) ships a mixin contract
    that runs every property on such models; declaring it here makes ``lensadapters check PLUGIN --NAME``
    and the test matrices (``lensadapters.testing.contract_matrix``) find it.
    """


@hookspec(firstresult=True)
def lensadapters_wrapped_layer(module: "nn.Module") -> Optional["nn.Module"]:
    """Return the layer ``module`` wraps when it is one of this plugin's wrapper layers (an adapter layer
    around its base layer), else ``None``.

    Other plugins find their own layers under any wrapper with ``lensadapters.wrapped_layers(module)``,
    which calls this repeatedly.
    """
