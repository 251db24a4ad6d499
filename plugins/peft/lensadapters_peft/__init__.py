"""PEFT / LoRA for lensadapters: a cross-cutting plugin (it claims no architecture).

It works with every architecture plugin, third-party ones included:

* ``HookedModel.wrap(peft_model)`` opens ``PeftModel`` → ``LoraModel`` → the Hugging Face model
  (``lensadapters_resolve_model``); hook names are those of the bare model, ``hm.model`` and
  ``hm.unwrap()`` are the ``PeftModel``. Every hook point sees the adapted computation, since the
  core's sites sit on the LoRA wrappers (``lora.Linear``), whose output includes the delta.
* New hook points ``*_lora`` for the LoRA contribution of each adapted projection
  (``lensadapters_extra_sites``), readable and editable, split with the projection's own layout.
* Effective weights (base + B·A·scaling of the active adapters; disabled and merged adapters
  respected) for LoRA layers (``lensadapters_linear_weight``), so ``hm.W_Q``... and the core's
  identities hold on adapted models. ``lora_factors`` gives A and B in TransformerLens shapes.
* Helpers (``helpers``, exported here): ``adapters_disabled(hm)``, ``using_adapter(hm, name)``,
  ``run_with_cache_base_and_adapted``, ``lora_factors``, ``lora_hook_names``.
* Other PEFT tuners living in the layers (IA³, LoHa, LoKr...): hook points see their computation, and
  reading one of their weights raises a ``WeightUnavailableError`` that names the module and the method.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn

from lensadapters import (
    Architecture,
    ContractVariant,
    FusedGateUp,
    FusedQKV,
    LinearWeight,
    MLPLayout,
    UnsupportedModelError,
    WeightUnavailableError,
    hookimpl,
)
from lensadapters.sites import BlockShapeSite, merge_heads, split_heads

from . import _lora
from ._lora import effective_linear, is_lora_embedding, is_lora_linear
from ._sites import LoraDeltaSite
from .helpers import (
    BaseAndAdapted,
    LoraFactors,
    adapters_disabled,
    lora_factors,
    lora_hook_names,
    run_with_cache_base_and_adapted,
    using_adapter,
)

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
#: the layers whose weights this plugin supplies: PEFT's tuner layers (and the LoRA embedding behind W_E/W_pos)
LENSADAPTERS_LAYERS = ("peft.",)

__all__ = [
    "LoraFactors",
    "BaseAndAdapted",
    "adapters_disabled",
    "using_adapter",
    "run_with_cache_base_and_adapted",
    "lora_factors",
    "lora_hook_names",
    "LoraDeltaSite",
]

Tensor = torch.Tensor

# (short name used by lora_factors, hook point name relative to the block)
QKV_POINTS = (("q", "attn.hook_q_lora"), ("k", "attn.hook_k_lora"), ("v", "attn.hook_v_lora"))
O_POINT = "attn.hook_o_lora"
MLP_PRE_POINT = "mlp.hook_pre_lora"
MLP_PRE_LINEAR_POINT = "mlp.hook_pre_linear_lora"
MLP_OUT_POINT = "mlp.hook_out_lora"


# --- opening the wrapper ------------------------------------------------------------------------


@hookimpl
def lensadapters_resolve_model(model: Any) -> Optional[nn.Module]:
    """``PeftModel`` → its tuner (``LoraModel``...) → the Hugging Face model."""
    if "peft" not in sys.modules:  # nothing can be a peft object before peft is imported
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, PeftModel):
        prompt = [name for name, cfg in model.peft_config.items() if getattr(cfg, "is_prompt_learning", False)]
        if prompt:
            raise UnsupportedModelError(
                f"lensadapters-peft supports adapters that live inside the model's layers (LoRA and other tuners); "
                f"adapter(s) {prompt} are prompt-learning adapters (prompt/prefix/p-tuning), which change the "
                f"sequence the model sees. Wrap model.get_base_model() to hook the base model instead."
            )
        return model.base_model
    if isinstance(model, BaseTuner):
        return model.model
    mixed = getattr(sys.modules.get("peft.mixed_model"), "PeftMixedModel", None)
    if mixed is not None and isinstance(model, mixed):
        return model.base_model
    return None


@hookimpl
def lensadapters_wrapped_layer(module: nn.Module) -> Optional[nn.Module]:
    """A PEFT tuner layer (``lora.Linear``, ``lora.Linear8bitLt``, IA³...) wraps its ``base_layer``."""
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(tuners_utils, "BaseTunerLayer", None)
    if base is None or not isinstance(module, base):
        return None
    return getattr(module, "base_layer", None)


@hookimpl
def lensadapters_contract_variants() -> list[ContractVariant]:
    """``lensadapters check PLUGIN --lora``: the contract suite on LoRA-adapted models."""
    return [ContractVariant("lora", "lensadapters_peft.testing:LoraContract", "LoRA-adapted (PEFT) models")]


# --- weights --------------------------------------------------------------------------------------


def _is_non_lora_tuner_layer(module: Any) -> bool:
    """A PEFT tuner layer (``BaseTunerLayer``) of another method than LoRA: IA³, LoHa, LoKr, OFT, VeRA..."""
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(tuners_utils, "BaseTunerLayer", None)
    if base is None or not isinstance(module, base):
        return False
    lora = _lora.lora_layer_type()
    return lora is None or not isinstance(module, lora)


def _peft_method(module: nn.Module) -> str:
    """The PEFT method of a tuner layer, as PEFT's config class spells it (``"IA3"``, ``"LoHa"``, ``"LoKr"``...)."""
    where = type(module).__module__
    mapping = getattr(sys.modules.get("peft.mapping"), "PEFT_TYPE_TO_TUNER_MAPPING", {})
    configs = getattr(sys.modules.get("peft.mapping"), "PEFT_TYPE_TO_CONFIG_MAPPING", {})
    for peft_type, tuner in mapping.items():
        package = tuner.__module__.rsplit(".", 1)[0]
        if where.startswith(package + "."):
            config = configs.get(peft_type)
            name = getattr(config, "__name__", "")
            return name[: -len("Config")] if name.endswith("Config") else str(getattr(peft_type, "value", peft_type))
    parts = where.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["peft", "tuners"] else type(module).__name__


def _non_lora_weight_error(module: nn.Module) -> WeightUnavailableError:
    adapters = list(getattr(module, "active_adapters", []) or [])
    return WeightUnavailableError(  # the core puts the module's path in front
        f"lensadapters-peft cannot read the weight of this {type(module).__module__}.{type(module).__name__}: it "
        f"is adapted by the PEFT method "
        f"{_peft_method(module)} (adapter(s) {adapters}), and lensadapters-peft reads LoRA weights only. Hook points "
        f"still see the adapted computation, except attn.hook_result of such an output projection (it is computed "
        f"from W_O). For plain weights, wrap a merged copy: "
        f"HookedModel.wrap(copy.deepcopy(peft_model).merge_and_unload())."
    )


@hookimpl
def lensadapters_linear_weight(module: nn.Module, read: Any) -> Optional[LinearWeight]:
    if is_lora_linear(module):
        return effective_linear(module, read)
    if _is_non_lora_tuner_layer(module):
        raise _non_lora_weight_error(module)
    return None


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Optional[Tensor]:
    """``W_E``/``W_pos`` when LoRA adapts the embedding table (``lora.Embedding``)."""
    layout = hooked.layout
    path = {"W_E": layout.embed, "W_pos": layout.pos_embed}.get(name)
    if not path:
        return None
    module = hooked.hf_model.get_submodule(path)
    if not is_lora_embedding(module):
        return None
    W = _lora.effective_embedding(module)
    return W[layout.pos_embed_offset :] if name == "W_pos" else W


@hookimpl
def lensadapters_module_attribute(module: nn.Module, name: str) -> Optional[Any]:
    """LoRA on a parameter (``target_parameters``, PEFT's ``ParamWrapper``: fused MoE experts): the wrapped
    module's attribute ``name``, with the deltas of the adapters its forward adds (none when disabled or merged)."""
    wrapper = getattr(sys.modules.get("peft.tuners.lora.layer"), "ParamWrapper", None)
    if wrapper is None or not isinstance(module, wrapper):
        return None
    deltas = []
    inner: Any = module
    while isinstance(inner, wrapper):  # one wrapper per targeted parameter, nested
        if inner.parameter_name == name:
            state, adapters = _lora.contributing_adapters(inner)
            if state == "active":
                deltas += [inner.get_delta_weight(adapter) for adapter in adapters]
        inner = inner.base_layer
    value = getattr(inner, name)
    for delta in deltas:
        value = value + delta
    return value


# --- hook points for the LoRA deltas --------------------------------------------------------------


def _new_point_before(hooked: Any, target: str, name: str) -> Any:
    names = hooked.hook_names
    at = names.index(target)
    return hooked.new_point(name, after=names[at - 1] if at > 0 else None)


def _heads_split(n_heads: int) -> tuple[Any, Any]:
    return (lambda t: (split_heads(t, n_heads),)), (lambda t: merge_heads(t))


def _plain_split() -> tuple[Any, Any]:
    return (lambda t: (t,)), (lambda t: t)


@hookimpl(trylast=True)  # after the architecture plugin's: it declares the projections' parts (projection_parts)
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Any]:
    """``*_lora`` points for every LoRA-adapted projection.

    A projection whose output the architecture's points show in parts (``hooked.projection_parts``: a gated query
    projection's queries and gates, a gated DeltaNet's fused projections per role) gets one delta point per part,
    ``<part's point>_lora``, the delta split the same way; the others are split with the layouts (``QKVLayout``,
    ``FusedGateUp``: per head, per q/k/v, per half).

    Layers PEFT replaces after wrapping (a new adapter's target modules, ``merge_and_unload()``) are refused by the
    core's module guard (``lensadapters.guard``), which watches the modules of these sites too."""
    declared = {id(parts.module) for parts in hooked.projection_parts}
    sites = _layout_sites(hooked, declared)
    for parts in hooked.projection_parts:
        if is_lora_linear(parts.module):
            points = [hooked.new_point(name + "_lora", before=parts.first_point) for name in parts.points]
            sites.append(LoraDeltaSite(parts.module, points, parts.split, parts.merge, hooked.forward_state))
    return sites


def _layout_sites(hooked: Any, declared: set[int]) -> list[Any]:
    """The delta sites of the projections the layouts describe, but those whose parts are ``declared``."""

    def adapted(module: nn.Module) -> bool:
        return is_lora_linear(module) and id(module) not in declared

    sites: list[Any] = []
    cfg = hooked.cfg
    for i, block in enumerate(hooked.block_modules):
        pre = f"blocks.{i}."
        qkv, bl, mlp = hooked.qkv_layouts[i], hooked.block_layouts[i], hooked.mlp_layouts[i]
        if bl is None:  # an opaque block (the generic adapter): no projection points to split a delta for
            continue
        get = block.get_submodule
        first = len(sites)
        if isinstance(qkv, FusedQKV):
            module = get(qkv.module)
            if adapted(module):
                points = [_new_point_before(hooked, pre + "attn.hook_q", pre + n) for _, n in QKV_POINTS]
                sites.append(LoraDeltaSite(module, points, qkv.split, qkv.merge, hooked.forward_state))
        elif qkv is not None:  # None: a token mixer other than softmax attention, with no attn.* points
            n_kv = qkv.kv_heads or cfg.n_key_value_heads
            heads = (cfg.n_heads, n_kv, n_kv)
            # kv_from: another layer's k/v; values_from_keys: one projection (its delta point is hook_k's)
            paths = (
                (qkv.q,)
                if qkv.kv_from is not None
                else (qkv.q, qkv.k)
                if qkv.values_from_keys
                else (qkv.q, qkv.k, qkv.v)
            )
            for (short, name), path, h in zip(QKV_POINTS, paths, heads):
                module = get(path)
                if adapted(module):
                    point = _new_point_before(hooked, f"{pre}attn.hook_{short}", pre + name)
                    sites.append(LoraDeltaSite(module, [point], *_heads_split(h), hooked.forward_state))
        module = get(bl.o_proj)
        if qkv is not None and adapted(module):
            point = _new_point_before(hooked, pre + "attn.hook_result", pre + O_POINT)
            sites.append(LoraDeltaSite(module, [point], *_plain_split(), hooked.forward_state))
        if isinstance(mlp, FusedGateUp):  # one LoRA on the fused gate/up projection: a delta point per half
            module = get(mlp.module)
            if adapted(module):
                points = [
                    _new_point_before(hooked, pre + "mlp.hook_pre", pre + n)
                    for n in (MLP_PRE_POINT, MLP_PRE_LINEAR_POINT)
                ]
                sites.append(LoraDeltaSite(module, points, mlp.split, mlp.merge, hooked.forward_state))
        if isinstance(mlp, FusedGateUp):
            projections: tuple = ((mlp.out, "hook_mlp_out", MLP_OUT_POINT),)
        elif isinstance(mlp, MLPLayout):
            projections = (
                (mlp.pre, "mlp.hook_pre", MLP_PRE_POINT),
                (mlp.pre_linear, "mlp.hook_pre_linear", MLP_PRE_LINEAR_POINT),
                (mlp.out, "hook_mlp_out", MLP_OUT_POINT),
            )
        else:  # a mixture of experts has no single MLP projection to watch
            projections = ()
        for path, target, name in projections:
            if path is None:
                continue
            module = get(path)
            if adapted(module):
                if name == MLP_OUT_POINT:  # the down projection runs right after its input, mlp.hook_post (a norm
                    point = hooked.new_point(pre + name, after=pre + "mlp.hook_post")  # may follow: ln2_post)
                else:
                    point = _new_point_before(hooked, pre + target, pre + name)
                sites.append(LoraDeltaSite(module, [point], *_plain_split(), hooked.forward_state))
        if getattr(bl, "flat_mlp", False) and len(sites) > first:
            # the block flattens tokens to [b*p, d] around its MLP (OPT): show [b, p, ...] like the core's points
            points = [p for site in sites[first:] for p in site.points]
            for point in points:
                point.token_shape = hooked.hook_dict[pre + "hook_resid_pre"].token_shape
            sites.append(BlockShapeSite(i, block, points, hooked.forward_state))
    return sites
