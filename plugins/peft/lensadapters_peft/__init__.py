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
* Helpers: ``adapters_disabled(hm)``, ``using_adapter(hm, name)``, ``run_with_cache_base_and_adapted``.
* Other PEFT tuners living in the layers (IA³, LoHa, LoKr...): hook points see their computation, and
  reading one of their weights raises a ``WeightUnavailableError`` that names the module and the method.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from lensadapters import (
    ActivationCache,
    Architecture,
    ContractVariant,
    FusedGateUp,
    FusedQKV,
    LensAdaptersError,
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


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Any]:
    """``*_lora`` points for every LoRA-adapted projection.

    Layers PEFT replaces after wrapping (a new adapter's target modules, ``merge_and_unload()``) are refused by the
    core's module guard (``lensadapters.guard``), which watches the modules of these sites too."""
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
            if is_lora_linear(module):
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
                if is_lora_linear(module):
                    point = _new_point_before(hooked, f"{pre}attn.hook_{short}", pre + name)
                    sites.append(LoraDeltaSite(module, [point], *_heads_split(h), hooked.forward_state))
        module = get(bl.o_proj)
        if qkv is not None and is_lora_linear(module):
            point = _new_point_before(hooked, pre + "attn.hook_result", pre + O_POINT)
            sites.append(LoraDeltaSite(module, [point], *_plain_split(), hooked.forward_state))
        if isinstance(mlp, FusedGateUp):  # one LoRA on the fused gate/up projection: a delta point per half
            module = get(mlp.module)
            if is_lora_linear(module):
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
            if is_lora_linear(module):
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


def lora_hook_names(hm: Any) -> list[str]:
    """The LoRA-delta hook points of ``hm``, in execution order."""
    return [n for n in hm.hook_names if n.endswith("_lora")]


# --- base versus adapted -------------------------------------------------------------------------


def _peft_model(hm: Any) -> Any:
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel

    return hm.model if isinstance(hm.model, PeftModel) else None


def _tuner_layers(hm: Any) -> list[nn.Module]:
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in hm.hf_model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def _keep_requires_grad(layers: Sequence[nn.Module]) -> Iterator[None]:
    """PEFT's enable/disable/set_adapter also flip ``requires_grad``; put the user's flags back."""
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


@contextlib.contextmanager
def adapters_disabled(hm: Any) -> Iterator[Any]:
    """Run ``hm`` as the base model inside the block (PEFT's ``disable_adapter``); yields ``hm``.

    Hook points stay the same; the ``*_lora`` points read zero (an edit adds to the base output).
    As in PEFT, merged adapters are unmerged by the first forward pass with adapters disabled.
    Adapter ``requires_grad`` flags are restored on exit.
    """
    layers = _tuner_layers(hm)
    if not layers:
        raise LensAdaptersError("adapters_disabled: this model has no PEFT adapter layers")
    peft_model = _peft_model(hm)
    with _keep_requires_grad(layers):
        if peft_model is not None:
            with peft_model.disable_adapter():
                yield hm
        else:
            before = [(layer, layer.disable_adapters) for layer in layers]
            try:
                for layer in layers:
                    layer.enable_adapters(False)
                yield hm
            finally:
                for layer, disabled in before:
                    layer.enable_adapters(not disabled)


def _active_adapters(hm: Any, layers: Sequence[nn.Module]) -> Union[str, list[str]]:
    peft_model = _peft_model(hm)
    if peft_model is not None:
        active = peft_model.base_model.active_adapter
    else:
        active = getattr(hm.model, "active_adapter", None) or layers[0].active_adapter
    return list(active) if isinstance(active, (list, tuple)) else active


def _set_adapters(hm: Any, names: Union[str, list[str]], layers: Sequence[nn.Module]) -> None:
    peft_model = _peft_model(hm)
    if peft_model is not None:
        if isinstance(names, str):
            peft_model.set_adapter(names)
        else:
            peft_model.base_model.set_adapter(names)
    elif hasattr(hm.model, "set_adapter") and hm.model is not hm.hf_model:
        hm.model.set_adapter(names)
    else:
        for layer in layers:
            layer.set_adapter(names)


@contextlib.contextmanager
def using_adapter(hm: Any, names: Union[str, Sequence[str]]) -> Iterator[Any]:
    """Make the named adapter(s) active inside the block and restore the previous ones after; yields ``hm``.

    Several names activate several adapters at once (their deltas add up in each ``*_lora`` point).
    Outside a ``with`` block, ``peft_model.set_adapter(name)`` works as well: hook points follow the
    active adapter at every forward pass.
    """
    layers = _tuner_layers(hm)
    if not layers:
        raise LensAdaptersError("using_adapter: this model has no PEFT adapter layers")
    names = names if isinstance(names, str) else list(names)
    previous = _active_adapters(hm, layers)
    with _keep_requires_grad(layers):
        _set_adapters(hm, names, layers)
        try:
            yield hm
        finally:
            _set_adapters(hm, previous, layers)


class BaseAndAdapted(NamedTuple):
    """Result of :func:`run_with_cache_base_and_adapted`."""

    logits: Any
    cache: ActivationCache
    base_logits: Any
    base_cache: ActivationCache


def run_with_cache_base_and_adapted(hm: Any, *args: Any, **kwargs: Any) -> BaseAndAdapted:
    """``run_with_cache`` twice on the same input: with the adapters as they are, then disabled.

    Takes the arguments of ``hm.run_with_cache`` (``names_filter``, ``device``...). Returns
    ``(logits, cache, base_logits, base_cache)``; both caches have the same keys. Call it with the
    adapters unmerged (disabling unmerges merged adapters, as in PEFT).
    """
    logits, cache = hm.run_with_cache(*args, **kwargs)
    with adapters_disabled(hm):
        base_logits, base_cache = hm.run_with_cache(*args, **kwargs)
    return BaseAndAdapted(logits, cache, base_logits, base_cache)


# --- LoRA factors in TransformerLens shapes ------------------------------------------------------


@dataclass(frozen=True)
class LoraFactors:
    """One adapter's factors on one projection, in TransformerLens orientation (``x @ A @ B * scaling``).

    ``A`` and ``B`` are views of the live parameters. Shapes (``r`` = rank):

    * ``"q"``: A ``[d_model, r]``, B ``[n_heads, r, d_head]``; ``"k"``/``"v"``: B ``[n_key_value_heads, r, d_head]``
      (for a fused QKV projection A is shared by q, k and v and B is split with the projection's layout);
    * ``"o"``: A ``[n_heads, d_head, r]``, B ``[r, d_model]``;
    * ``"in"``/``"gate"``/``"out"``: A ``[d_in, r]``, B ``[r, d_out]`` (``"in"`` is the up projection of a gated MLP,
      as ``W_in``; for a fused gate/up projection A is shared by both and B is split with the layout's ``split``).

    ``b`` is the adapter's bias (``lora_bias=True``) times ``scaling`` in the shape of the matching ``b_*``, else None.
    :attr:`W` is the delta weight ``A @ B * scaling`` in the shape of ``hm.W_Q[layer]``, ``hm.W_O[layer]``...
    """

    A: Tensor
    B: Tensor
    scaling: float
    adapter: str
    which: str
    b: Optional[Tensor] = None

    @property
    def W(self) -> Tensor:
        A, B = self.A, self.B.to(self.A.dtype)
        if self.which in ("q", "k", "v"):
            return torch.einsum("mr,hrd->hmd", A, B) * self.scaling
        if self.which == "o":
            return torch.einsum("hdr,rm->hdm", A, B) * self.scaling
        return A @ B * self.scaling


_WHICH = ("q", "k", "v", "o", "in", "gate", "out")


def lora_factors(hm: Any, layer: int, which: str, adapter: Optional[str] = None) -> LoraFactors:
    """The LoRA factors of ``adapter`` (default: the one active adapter) on one projection of block ``layer``.

    ``which`` is one of ``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"in"``, ``"gate"``, ``"out"`` (the projections behind
    ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``W_in``, ``W_gate``, ``W_out``). See :class:`LoraFactors` for the shapes.
    """
    if which not in _WHICH:
        raise ValueError(f"which must be one of {_WHICH}, not {which!r}")
    cfg = hm.cfg
    block = hm.block_modules[layer]
    qkv, bl, mlp = hm.qkv_layouts[layer], hm.block_layouts[layer], hm.mlp_layouts[layer]
    if which in ("q", "k", "v"):
        path = qkv.module if isinstance(qkv, FusedQKV) else getattr(qkv, which)
    elif which == "o":
        path = bl.o_proj
    elif not isinstance(mlp, (MLPLayout, FusedGateUp)):
        raise LensAdaptersError(
            f"layer {layer}'s MLP is a mixture of experts: lora_factors reads single projections (q, k, v, o) there"
        )
    elif which in ("in", "gate") and isinstance(mlp, FusedGateUp):
        path = mlp.module
    elif which == "in":
        path = mlp.pre_linear or mlp.pre
    elif which == "gate":
        if mlp.pre_linear is None:
            raise AttributeError("'gate' exists only for gated MLPs (cfg.gated_mlp)")
        path = mlp.pre
    else:
        path = mlp.out
    module = block.get_submodule(path)
    if not is_lora_linear(module):
        raise LensAdaptersError(f"blocks.{layer}.{path} ({type(module).__name__}) has no LoRA adapter")
    if adapter is None:
        candidates = _lora.active_lora_adapters(module)
        if len(candidates) != 1:
            raise LensAdaptersError(
                f"blocks.{layer}.{path}: {len(candidates)} active LoRA adapters here ({candidates}); name one with "
                f"adapter=... (available: {list(module.lora_A)})"
            )
        adapter = candidates[0]
    if adapter not in module.lora_A:
        raise LensAdaptersError(f"blocks.{layer}.{path} has no LoRA adapter {adapter!r} (it has {list(module.lora_A)})")
    if _lora.is_variant(module, adapter):
        raise LensAdaptersError(f"adapter {adapter!r} is a LoRA variant (DoRA...): its update is not A @ B * scaling")
    scaling = module.scaling[adapter]
    A = module.lora_A[adapter].weight.T  # [d_in, r]
    B = module.lora_B[adapter].weight.T  # [r, d_out]
    bias = module.lora_B[adapter].bias
    b = None if bias is None else bias * scaling
    if which in ("q", "k", "v"):
        index = "qkv".index(which)
        if isinstance(qkv, FusedQKV):
            B = qkv.split(B)[index]  # [r, h, d_head]
            b = None if b is None else qkv.split(b)[index]
        else:
            B = B.unflatten(-1, (-1, cfg.d_head))
            b = None if b is None else b.unflatten(-1, (-1, cfg.d_head))
        B = B.permute(1, 0, 2)  # [h, r, d_head]
    elif which == "o":
        A = A.unflatten(0, (cfg.n_heads, -1))  # [h, d_head, r]
    elif which in ("in", "gate") and isinstance(mlp, FusedGateUp):  # B's columns split like the fused output
        index = 0 if which == "gate" else 1
        B = mlp.split(B)[index]
        b = None if b is None else mlp.split(b)[index]
    return LoraFactors(A, B, scaling, adapter, which, b)
