"""The generic adapter's hook implementations (registered by the core's registry, selected only as a fallback or
with ``adapter="generic"``)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.described_sums import described_sum_reference, described_sum_site
from lensadapters.adapters.generic.gated_z import GATED_Z, gated_layers, gated_z_sites, refused_gated_weight
from lensadapters.adapters.generic.identify import Findings, NormBehaviour, identify, layer_ranges
from lensadapters.adapters.generic.latent import claim_latent_points, latent_sites_served
from lensadapters.adapters.generic.mixer import reference as internal_reference
from lensadapters.adapters.generic.mixer import register as register_mixer_form
from lensadapters.adapters.generic.mixer import serve_verified_internals
from lensadapters.adapters.generic.mixer_sites import layer_sites as mixer_sites
from lensadapters.adapters.generic.own_attention import OWN_CODE
from lensadapters.adapters.generic.references import (
    AFTER_BLOCKS,
    DESCRIBED_ATTN_OUT,
    DESCRIBED_SUMS_REFERENCES,
    OPAQUE_REFERENCES,
    PARALLEL_MIXERS,
)
from lensadapters.adapters.generic.rotated_norm import ROTATED_NORMS
from lensadapters.adapters.generic.shared_expert import SHARED_EXPERTS, shared_expert_sites
from lensadapters.adapters.generic.sites import AttentionFunctionBackend, AttentionFunctionSite, ModuleIOSite
from lensadapters.adapters.generic.structure import WRITE_A_PLUGIN
from lensadapters.adapters.generic.verify import OPAQUE_BRANCHES
from lensadapters.adapters.generic.verify_described import VERIFYING as _verifying
from lensadapters.adapters.generic.verify_described import verify_description
from lensadapters.adapters.hookspecs import hookimpl
from lensadapters.adapters.latent_attention import refused_weight
from lensadapters.errors import WeightUnavailableError
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import NormSite, Site
from lensadapters.hooks.sites.attention import ResultSite
from lensadapters.hooks.specs import Architecture, BlockLayout, HookedConfig, ModelLayout, NormSpec

NAME = "generic"
ARCH = Architecture(
    name=NAME,
    model_types=(),
    description="any other decoder-only model: residual stream, attention and MLP outputs, attention patterns and "
    "hook_z where the model calls transformers' attention interface, the final norm",
)
#: what the generic adapter serves of the weight accessors; the others need a plugin
WEIGHTS = ("W_E", "W_U")
UNVERIFIED = "unverified"  # the group of ``Findings.missing`` naming the described points that failed verification

_findings: "weakref.WeakKeyDictionary[nn.Module, Findings]" = weakref.WeakKeyDictionary()
Tensor = torch.Tensor
_norms: "weakref.WeakKeyDictionary[nn.Module, NormBehaviour]" = weakref.WeakKeyDictionary()


class GenericAdapterWarning(UserWarning):
    """A model was wrapped by the generic adapter because no plugin supports its ``model_type``."""


def findings(model: nn.Module) -> Findings:
    """What the generic adapter found for ``model`` (identified on first use; again at every wrap)."""
    found = _findings.get(model)
    if found is None:
        found = _findings[model] = identify(model)
        OPAQUE_BRANCHES[model] = {i: (b.attn, b.mlp) for i, b in enumerate(found.blocks)}
        OPAQUE_REFERENCES[model] = internal_reference
        DESCRIBED_SUMS_REFERENCES[model] = described_sum_reference
        PARALLEL_MIXERS[model] = {
            i: b.beside
            for i, b in enumerate(found.blocks)
            if b.beside is not None and getattr(b.mixer, "sum", None) is None  # else a SumSite's (.mixer_sites)
        }
        register_mixer_form(model, found, _norms)
        OWN_CODE[model] = dict(found.own_attention)
        layers_found = found.description.layers if found.description is not None else []
        DESCRIBED_ATTN_OUT[model] = {i: d.attn_out for i, d in enumerate(layers_found) if d and d.attn_out}
        ROTATED_NORMS[model] = {i: d.rotated_norms for i, d in enumerate(layers_found) if d and d.rotated_norms}
        GATED_Z[model] = frozenset(i for i, d in enumerate(layers_found) if d and d.z_changed)
        SHARED_EXPERTS[model] = {i: d.shared_expert for i, d in enumerate(layers_found) if d and d.shared_expert}
        if found.final_norm is not None and found.final_norm_behaviour is not None:
            _norms[model.get_submodule(found.final_norm)] = found.final_norm_behaviour
        if found.description is not None:
            layers = list(model.get_submodule(found.structure.layers).children())
            for layer, described in zip(layers, found.description.layers):
                for path, behaviour in (described.norms if described is not None else {}).items():
                    _norms[layer.get_submodule(path)] = behaviour
    return found


def _described(model: nn.Module, layer: int) -> Optional[Any]:
    d = findings(model).description
    return d.layers[layer] if d is not None else None


def _fully_described(model: nn.Module) -> bool:
    d = findings(model).description
    return d is not None and all(layer is not None for layer in d.layers)


@hookimpl
def lensadapters_validate(arch: Architecture, model: nn.Module) -> None:
    _findings.pop(model, None)  # a model may have changed since it was last wrapped: identify it again
    findings(model)


@hookimpl
def lensadapters_config(arch: Architecture, model: nn.Module) -> HookedConfig:
    """What the config and the probe tell; ``None`` for what the generic adapter cannot know."""
    c, found = model.config, findings(model)
    weight = getattr(model.get_submodule(found.structure.embed), "weight", None)
    d_vocab, d_model = tuple(weight.shape) if weight is not None and weight.dim() == 2 else (None, None)
    d_model = getattr(c, "hidden_size", None) or d_model
    heads = found.heads or getattr(c, "num_attention_heads", None)
    d_head = found.d_head or (d_model // heads if d_model and heads else None)
    behaviour = found.final_norm_behaviour
    d = found.description
    described = [layer for layer in d.layers if layer is not None] if d is not None else []
    if described and described[0].norms:
        behaviour = next(iter(described[0].norms.values()))
    return HookedConfig(
        n_layers=len(found.blocks),
        d_model=d_model,
        n_heads=heads,
        d_head=d_head,
        d_mlp=getattr(c, "intermediate_size", None),
        d_vocab=d_vocab or getattr(c, "vocab_size", None),
        n_ctx=getattr(c, "max_position_embeddings", None),
        act_fn=(described[0].act_fn if described else None) or getattr(c, "hidden_act", None),
        normalization_type=behaviour.kind if behaviour is not None else None,  # type: ignore[arg-type]
        positional_embedding_type="rotary" if d is not None and d.rotary else None,  # type: ignore[arg-type]
        rotary_dim=d.rotary_dim if d is not None and d.rotary else None,
        model_type=getattr(c, "model_type", "") or type(model).__name__,
        n_key_value_heads=found.kv_heads or getattr(c, "num_key_value_heads", None) or heads,
        parallel_attn_mlp=described[0].block.parallel if described else None,  # type: ignore[arg-type]
        gated_mlp=described[0].gated if described else None,  # type: ignore[arg-type]
        eps=behaviour.eps if behaviour is not None and behaviour.eps is not None else 1e-5,
        original_architecture=type(model).__name__,
        extra={"adapter": NAME, "described": d is not None},
        attention_dir="bidirectional" if _bidirectional(model, found) else "causal",
    )


def _bidirectional(model: nn.Module, found: Findings) -> bool:
    """Whether every layer's attention module says it is not causal (``is_causal = False``: an encoder, whose
    attention function gets a mask that hides only padding)."""
    paths = [(layer, b.attention_function) for layer, b in zip(_layers(model, found), found.blocks)]
    flags = [getattr(layer.get_submodule(p), "is_causal", None) if p else None for layer, p in paths]
    return bool(flags) and all(flag is False for flag in flags)


def _layers(model: nn.Module, found: Findings) -> list[nn.Module]:
    return list(model.get_submodule(found.structure.layers).children())


@hookimpl
def lensadapters_embed(arch: Architecture, model: nn.Module) -> ModelLayout:
    found = findings(model)
    s, scale, d = found.structure, found.embed_scale, found.description
    described: dict[str, Any] = {}
    if d is not None:  # the core serves the final norm's points and rotary of the described layers
        behaviour = found.final_norm_behaviour
        if found.final_norm is not None and behaviour is not None and behaviour.eps is not None:
            described["ln_final"] = found.final_norm
            described["ln_final_after_blocks"] = found.final_norm_after_blocks
        described["rotary"] = d.rotary
        described["rotary_input"] = d.rotary_input
        described["rotary_from_inputs"] = d.rotary_from_inputs
    if scale is None or scale == 1.0:
        return ModelLayout(blocks=s.layers, embed=s.embed, unembed=s.unembed, **described)
    return ModelLayout(
        blocks=s.layers,
        embed=s.embed,
        unembed=s.unembed,
        **described,
        embed_scale=scale,
        # after the module: hook_embed is the first layer's input, checked to be the product in every forward
        embed_scale_after_module=not found.embed_scaled_in_module,
        embed_scale_rounded=found.embed_scale_rounded,
        embed_scale_in_place=found.embed_scaled_in_place,
    )


@hookimpl
def lensadapters_block(arch: Architecture, model: nn.Module, layer: int) -> Optional[BlockLayout]:
    """A described layer's layout (:mod:`.describe`); any other block is opaque to the core: the generic adapter
    serves its points (``lensadapters_extra_sites``)."""
    described = _described(model, layer)
    return described.block if described is not None else None


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: nn.Module, layer: int) -> Any:
    described = _described(model, layer)
    return described.qkv if described is not None else None


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: nn.Module, layer: int) -> Any:
    described = _described(model, layer)
    return described.mlp if described is not None else None


@hookimpl
def lensadapters_attn_pattern(arch: Architecture, hooked: Any) -> Any:
    """Layers that compute attention in the model's own code: the softmax capture of the core; the others (none
    in a model whose layers are all described) through the attention interface, as by default."""
    own = findings(hooked.hf_model).own_attention
    if not own:
        return None
    from lensadapters.adapters.defaults import lensadapters_attn_pattern as interface_backend
    from lensadapters.hooks.softmax_capture import SoftmaxCaptureBackend

    return SoftmaxCaptureBackend(hooked.attention_modules, own, interface_backend(arch=arch, hooked=hooked))


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    behaviour = _norms.get(module)
    return behaviour.spec(module) if behaviour is not None else None


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Optional[Tensor]:
    key = name.lstrip("_")
    if key in WEIGHTS:
        found = findings(hooked.hf_model)
        why = found.unserved_weights.get(key)
        if why is not None:
            raise WeightUnavailableError(
                f"hm.{key}: the generic adapter could not verify it on this {type(hooked.hf_model).__name__}: {why}. "
                f"A plugin can describe it (see {WRITE_A_PLUGIN})"
            )
        if key == "W_U" and found.logit_scale not in (None, 1.0) and found.structure.unembed is not None:
            # the model scales the logits after the unembedding: final @ W_U is the logits
            unembed = hooked.hf_model.get_submodule(found.structure.unembed)
            return hooked.read_linear(unembed).W * found.logit_scale
        return None
    found = findings(hooked.hf_model)
    if found.description is not None:  # every layer described, or a hybrid's (the others of the mixer form)
        why = found.unverified.get(key) or refused_weight(hooked, key) or refused_gated_weight(hooked, key)
        if why is not None:
            raise WeightUnavailableError(
                f"hm.{key}: the generic adapter described this {type(hooked.hf_model).__name__} but could not verify "
                f"{key}: {why}. A plugin can describe it (see {WRITE_A_PLUGIN})"
            )
        return None  # the core reads it from the verified description
    raise WeightUnavailableError(
        f"hm.{name.lstrip('_')}: this {type(hooked.hf_model).__name__} is wrapped by the generic adapter (no plugin "
        f"supports model_type {hooked.cfg.model_type!r}), which reads only {' and '.join(WEIGHTS)}: where the other "
        f"weights live, and how they split into heads, is what a plugin describes. See {WRITE_A_PLUGIN}."
        + _per_layer_experts(hooked, key)
    )


def _per_layer_experts(hooked: Any, key: str) -> str:
    """Where a weight the generic adapter does not stack has per-layer readers: the experts of the mixer form's
    mixtures of experts whose per-expert points it verified (``hooked.own_mlp_layouts``)."""
    layers = sorted(getattr(hooked, "own_mlp_layouts", {}))
    if not layers or key not in ("W_in", "W_gate", "W_out", "b_in", "b_gate", "b_out", "W_router"):
        return ""
    if key == "W_router":
        reader = "lensadapters.moe.router_weight(hm.wiring, layer)"
    else:
        role = key.split("_")[1]
        reader = f"lensadapters.weights.mlp_weights(hm.wiring, layer, {role!r})"
    return f" The experts of layers {', '.join(map(str, layers))} (verified on the probe) are read per layer: {reader}"


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    """Every point of the blocks and the final norm (the core created ``hook_embed``)."""
    model, found = hooked.hf_model, findings(hooked.hf_model)
    sites: list[Site] = []
    if found.embed_scale is None:  # not verified: absent (the warning says why)
        hooked.claim_point("hook_embed")
        hooked.remove_point("hook_embed")
    elif found.embed_scale == 1.0 and "hook_embed" in found.copied:
        sites.append(
            ModuleIOSite(model.get_submodule(found.structure.embed), hooked.claim_point("hook_embed"), copy=True)
        )
    modules = [
        layer.get_submodule(b.attention_function)
        if b.attention_function is not None and (bl is None or i in gated_layers(model))
        else None
        for i, (layer, b, bl) in enumerate(zip(hooked.block_modules, found.blocks, hooked.block_layouts))
    ]
    backend = AttentionFunctionBackend(model.config, modules)
    gated, claimed = gated_z_sites(hooked, backend, found.missing)  # the core's points this plugin serves itself
    sites += gated
    for i, (layer, block) in enumerate(zip(hooked.block_modules, found.blocks)):
        if hooked.block_layouts[i] is not None and block.beside is not None:  # the mixer beside the attention
            # added times constants: the layer's own sums serve its branch points (.described_sums)
            sum_sites = described_sum_site(hooked, i, layer, block, claimed)
            sites += sum_sites or [_beside_site(hooked, i, layer, block)]
        elif hooked.block_layouts[i] is not None:  # an MLP of two modules added as one sum (.described_sums)
            sites += described_sum_site(hooked, i, layer, block, claimed)
        if hooked.block_layouts[i] is not None:  # described: the core serves its points
            described = _described(model, i)
            if described is not None and described.shared_expert is not None:  # a MoE's shared expert's points
                sites += shared_expert_sites(hooked, i, layer, described.shared_expert)
            if described is not None and described.attn_out is not None:  # what a post-LN block adds to x
                if described.attn_out == described.block.o_proj and f"blocks.{i}.attn.hook_result" in hooked.hook_dict:
                    # both on the projection's output: hook_result fires first, as in TransformerLens (its edit is
                    # in what hook_attn_out sees), so this plugin serves it too, before hook_attn_out
                    result = hooked.claim_point(f"blocks.{i}.attn.hook_result")
                    point = hooked.claim_point(f"blocks.{i}.hook_attn_out")
                    claimed |= {result.name, point.name}
                    o_proj = layer.get_submodule(described.block.o_proj)
                    sites.append(
                        _ResultThenOutput(
                            ResultSite(o_proj, result, hooked.cfg.n_heads, hooked._o_reader(i)),
                            ModuleIOSite(o_proj, point),
                        )
                    )
                    continue
                point = hooked.claim_point(f"blocks.{i}.hook_attn_out")
                claimed.add(point.name)
                sites.append(ModuleIOSite(layer.get_submodule(described.attn_out), point))
            for name, path in (("hook_attn_out", block.attn), ("hook_mlp_out", block.mlp)):
                # a branch output the model writes into afterwards (Falcon's parallel block adds the attention
                # output into the MLP's in place): served as the core would, with the model continuing with a copy;
                # one returned with the tokens merged (Llama 4's mixture of experts): served in the residual's shape
                special = name in block.copied or name in block.flat
                scaled = described is not None and described.block.scaled  # the core's ScaledBranchSite serves it
                if special and not scaled and path is not None and f"blocks.{i}.{name}" not in claimed:
                    point = hooked.claim_point(f"blocks.{i}.{name}")
                    claimed.add(point.name)
                    module = layer.get_submodule(path)
                    sites.append(ModuleIOSite(module, point, copy=name in block.copied, as_input=name in block.flat))
            continue
        points = {name: hooked.new_point(f"blocks.{i}.{name}") for name in block.points}
        copied = block.copied
        if "hook_resid_pre" in points:
            sites.append(ModuleIOSite(layer, points["hook_resid_pre"], output=False, copy="hook_resid_pre" in copied))
        if "attn.hook_z" in points:
            sites.append(
                AttentionFunctionSite(
                    i,
                    backend,
                    points.get("attn.hook_attn_scores"),
                    points.get("attn.hook_pattern"),
                    points["attn.hook_z"],
                    copy_z="attn.hook_z" in copied,
                )
            )
        if block.mixer is not None:
            sites += mixer_sites(hooked, i, layer, block, points)
        summed = block.mixer is not None and block.mixer.sum is not None  # its branch points: a SumSite's
        if "hook_mixer_out" in points and block.beside is not None and not summed:
            module = layer.get_submodule(block.beside)
            sites.append(ModuleIOSite(module, points["hook_mixer_out"], copy="hook_mixer_out" in copied))
        for name, path in (("hook_attn_out", block.attn), ("hook_mlp_out", block.mlp)):
            if name in points and not summed:
                module, flat = layer.get_submodule(path), name in block.flat
                sites.append(ModuleIOSite(module, points[name], copy=name in copied, as_input=flat))
        if "hook_resid_post" in points:
            sites.append(ModuleIOSite(layer, points["hook_resid_post"], copy="hook_resid_post" in copied))
    if found.final_norm is not None and found.final_norm_after_blocks:  # its call after the last layer only
        AFTER_BLOCKS[model.get_submodule(found.final_norm)] = _layers(model, found)[-1]
    if hooked.layout.ln_final is None and found.final_norm is not None and found.final_norm_behaviour is not None:
        norm = model.get_submodule(found.final_norm)
        point = hooked.new_point("ln_final.hook_normalized")
        hooked.register_norm("ln_final", norm)
        after = {"after": AFTER_BLOCKS.get(norm), "state": hooked.forward_state}
        if any(b.mixer is not None for b in found.blocks) and found.final_norm_behaviour.eps is not None:
            # the mixer form's verification runs: the scale too, verified with its points (a norm, not a stand-in)
            scale = hooked.new_point("ln_final.hook_scale", before="ln_final.hook_normalized")
            sites.append(NormSite(norm, lambda: hooked.norm_spec(norm), scale, point, **after))
        elif found.final_norm_behaviour.kind == "LN" and not found.final_norm_after_blocks:  # its output
            sites.append(ModuleIOSite(norm, point, copy="ln_final.hook_normalized" in found.copied))
        else:  # RMSNorm's: x / scale, before the weight; edits reach the output through the weight
            scale = HookPoint("ln_final.hook_scale", lambda p: None)  # not served: a stand-in that is never hooked
            sites.append(NormSite(norm, lambda: hooked.norm_spec(norm), scale, point, **after))
    opaque_mixers = any(b.mixer is not None and bl is None for b, bl in zip(found.blocks, hooked.block_layouts))
    if opaque_mixers:
        sites = serve_verified_internals(hooked, found, sites, _verifying)
    if found.description is not None:
        claimed |= claim_latent_points(hooked)  # multi-head latent attention's points (.latent)
        why_not_patterns = _withhold_patterns(hooked, found, claimed)
        failed = _serve_verified(hooked, claimed)
        sites = [site for site in sites if not any(p.name in failed for p in site.points)]
        sites += latent_sites_served(hooked)
        if why_not_patterns is not None:  # the probe's reason stays: the described layers have no patterns either
            found.missing.setdefault(PATTERNS_GROUP, why_not_patterns)
    # the selective-scan points of every layer's Mamba mixer (.scan), described layer or not: one call, after the
    # other points' verification (a model with both kinds of layer, bfloat16 Falcon-H1's, made them twice)
    if opaque_mixers or (found.description is not None and any(block.beside is not None for block in found.blocks)):
        from lensadapters.adapters.generic.scan import serve_scan

        sites = serve_scan(hooked, found, sites, _verifying)
    return sites


PATTERNS_GROUP = "attention scores and patterns"


def _withhold_patterns(hooked: Any, found: Findings, claimed: set[str]) -> Optional[str]:
    """Remove ``hook_attn_scores``/``hook_pattern`` of the described layers whose attention call the probe found
    the core's explicit attention does not reproduce (an attention function given sparse ``indices``...): the
    probe's reason, ``None`` where no such layer is described."""
    withheld = False
    for i, (block, layout) in enumerate(zip(found.blocks, hooked.block_layouts)):
        if layout is None or "attn.hook_z" not in block.points or "attn.hook_pattern" in block.points:
            continue
        for name in ("attn.hook_attn_scores", "attn.hook_pattern"):
            full = f"blocks.{i}.{name}"
            if full in hooked.hook_dict:
                if full not in claimed:
                    hooked.claim_point(full)
                hooked.remove_point(full)
                withheld = True
    return found.missing.get(PATTERNS_GROUP) if withheld else None


def _beside_site(hooked: Any, i: int, layer: nn.Module, block: Any) -> Site:
    """``hook_mixer_out`` of a described layer: the output of the token mixer it runs beside its attention module
    (:mod:`.parallel`), listed where it fires: after the pre-norm both read, or after ``hook_attn_out`` where the
    mixer runs after the attention module."""
    first = block.points.index("hook_mixer_out") < block.points.index("hook_attn_out")
    anchors = ["ln1.hook_normalized", "hook_resid_pre"] if first else ["hook_attn_out"]
    after = next((f"blocks.{i}.{a}" for a in anchors if f"blocks.{i}.{a}" in hooked.hook_dict), None)
    point = hooked.new_point(f"blocks.{i}.hook_mixer_out", after=after)
    assert block.beside is not None
    return ModuleIOSite(layer.get_submodule(block.beside), point, copy="hook_mixer_out" in block.copied)


class _ResultThenOutput(Site):
    """``attn.hook_result`` and ``hook_attn_out`` both on one projection's output, in one forward hook: the result
    first (its edit is in what ``hook_attn_out`` sees), as TransformerLens orders them."""

    def __init__(self, result: ResultSite, output: ModuleIOSite) -> None:
        self.result, self.output = result, output
        self.points = (result.point, output.point)

    def install(self) -> list[Any]:
        return [self.output.module.register_forward_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.result.point.has_live_hooks():
            edited = self.result._hook(module, args, kwargs, output)
            output = edited if edited is not None else output
            changed = edited is not None
        else:
            changed = False
        served = self.output._on_output(module, args, kwargs, output)
        return served if served is not None else (output if changed else None)


# --- verification of the described points (the probe forward: verify_described) -----------------------------


def _serve_verified(hooked: Any, claimed: frozenset[str] | set[str] = frozenset()) -> set[str]:
    """Remove every point that failed verification (the warning says which and why); their names. ``claimed``:
    the core's points this plugin claimed already (for a site of its own)."""
    model = hooked.hf_model
    if model in _verifying:
        return set()
    found = findings(model)
    found.unverified.clear()
    found.unverified.update(verify_description(hooked))
    if _fully_described(model):  # the probe's notes on the opaque blocks' points no longer apply
        for group in (
            "hook_attn_out and hook_mlp_out",
            "attention scores and patterns",
            "attention scores, patterns and hook_z",
        ):
            found.missing.pop(group, None)
    by_reason: dict[str, list[str]] = {}
    for name, why in found.unverified.items():
        by_reason.setdefault(why, []).append(name)
    if by_reason:
        found.missing[UNVERIFIED] = "; ".join(f"{describe_points(names)}: {why}" for why, names in by_reason.items())
    for name in found.unverified:
        if name in hooked.hook_dict:
            if name not in claimed:
                hooked.claim_point(name)
            hooked.remove_point(name)
        else:  # a point the core creates after the plugins' sites (the per-head inputs)
            hooked.withheld.add(name)
    return set(found.unverified)


# --- the warning ------------------------------------------------------------------------------------------------


def describe_points(names: list[str]) -> str:
    """``hook_names`` in a few words: block points grouped by the layers that have them."""
    by_point: dict[str, list[int]] = {}
    outside: list[str] = []
    for name in names:
        if name.startswith("blocks."):
            _, layer, rest = name.split(".", 2)
            by_point.setdefault(rest, []).append(int(layer))
        else:
            outside.append(name)
    groups: dict[str, list[str]] = {}
    for point, layers in by_point.items():
        groups.setdefault(layer_ranges(layers).replace(", ", ","), []).append(point)
    parts = outside[:1] + [
        f"blocks.{{{layers}}}.{{{', '.join(points)}}}" if len(points) > 1 else f"blocks.{{{layers}}}.{points[0]}"
        for layers, points in groups.items()
    ]
    return "; ".join(parts + outside[1:])


def summary(hooked: Any, fallback: bool = True) -> str:
    """The plain-language account of a generic wrap: which points exist, which do not and why, what to do."""
    model, found = hooked.hf_model, findings(hooked.hf_model)
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    head = (
        f"no lensadapters plugin supports model_type {model_type!r}, so the generic adapter wrapped this "
        f"{type(model).__name__}"
        if fallback
        else f"the generic adapter wrapped this {type(model).__name__}"
    )
    text = (
        f"{head}, from its structure and one probe forward pass. It has {len(hooked.hook_names)} hook points: "
        f"{describe_points(hooked.hook_names)}."
    )
    for group, why in found.missing.items():
        text += f" Not served, as they failed verification: {why}." if group == UNVERIFIED else f" No {group}: {why}."
    described = found.description is not None and all(bl is not None for bl in hooked.block_layouts)
    if described:
        text += (
            " Its blocks were described automatically (norms, queries, keys and values, rotary, MLP, weights), and "
            "every point served was verified on a probe forward pass: its value, and the effect of an edit on the "
            "logits, against plain PyTorch hooks on the model's own modules."
        )
    else:
        parts = _not_served_everywhere(hooked)
        wanted = ", ".join(parts) + (" and " if parts else "") + f"every weight but {' and '.join(WEIGHTS)}"
        text += (
            f" {wanted[:1].upper()}{wanted[1:]} need a plugin that describes the architecture"
            + (" (the automatic description covers only some layers)" if found.description is not None else "")
            + "."
        )
    text += f" See {WRITE_A_PLUGIN}. `lensadapters hooks CHECKPOINT_DIR` lists the points with their shapes."
    return text


#: what a description gives every block, by a point that shows it is served
DESCRIBED_POINTS = (
    ("norm scales", "ln1.hook_scale"),
    ("queries, keys and values", "attn.hook_q"),
    ("rotary", "attn.hook_rot_q"),
    ("MLP activations", "mlp.hook_post"),
    ("hook_result", "attn.hook_result"),
    ("hook_resid_mid", "hook_resid_mid"),
)


def _not_served_everywhere(hooked: Any) -> list[str]:
    """The parts of :data:`DESCRIBED_POINTS` some block lacks (the mixer form serves norm scales, ``hook_resid_mid``
    and MLP activations without a description: the warning names only what is missing)."""
    names = set(hooked.hook_names)
    blocks = range(len(hooked.block_modules))
    return [label for label, point in DESCRIBED_POINTS if not all(f"blocks.{i}.{point}" in names for i in blocks)]
