"""Gemma 4 text models (``model_type: "gemma4_text"``) for lensadapters: ``Gemma4ForCausalLM``, ``Gemma4TextModel``;
the "unified" Gemma 4 text models (``gemma4_unified_text``: ``Gemma4UnifiedForCausalLM``, ``Gemma4UnifiedTextModel``).

TransformerLens 2.x names and semantics on Gemma 4's structure:

* Sandwich norms (``ln1_post``/``ln2_post``; ``hook_attn_out``/``hook_mlp_out`` after them), plain ``x / rms *
  weight`` RMSNorm (Gemma 4 has no ``1 + weight``), embeddings scaled by ``sqrt(d_model)`` (in ``hook_embed`` and
  ``W_E``), attention scale 1 (the query and key norms stand in for it), an optional final-logit softcap
  (``cfg.output_logits_soft_cap``), sliding-window and full layers from ``config.layer_types``.
* Per-head query, key and value norms. The model projects and normalizes the queries and rotates them, then
  projects keys and values, normalizes and rotates the keys, then normalizes the values (a norm without weight):
  ``attn.hook_q``, ``attn.q_norm.*``, ``attn.hook_rot_q``, ``attn.hook_k``, ``attn.hook_v``, ``attn.k_norm.*``,
  ``attn.hook_rot_k``, ``attn.v_norm.hook_scale``/``hook_normalized``, in that order. ``hook_v`` is the value
  projection (``normalized @ W_V``); ``attn.v_norm.hook_normalized`` is the value attention mixes into
  ``hook_z`` (an edit there is an edit of the values every query reads).
* Per-layer head sizes: full-attention layers use ``global_head_dim`` (wider than the sliding layers' ``head_dim``),
  with their own RoPE (``proportional``: RoPE on a ``partial_rotary_factor`` of each head, the rest unrotated).
  Each layer's points have that layer's head size and its own ``(cos, sin)`` (``ModelLayout.rotary_input``);
  ``cfg.d_head`` is the sliding layers' size, ``cfg.extra["global_head_dim"]`` the full layers'. Where the sizes
  differ, the stacked weights (``hm.W_Q``...) raise (one tensor cannot hold both): read one layer's weights with
  ``lensadapters.plugin_api.layer_weight``/``hm.blocks[i]``.
* Per-layer input embeddings (``hidden_size_per_layer_input``, PLE): after the MLP's residual add each block
  adds ``norm(W_proj(gelu(W_gate(x)) * per_layer_input))``. Points: ``blocks.L.hook_per_layer_input`` (the
  ``[b, p, d_ple]`` per-layer input the block receives, token and context parts combined as the model computes
  them; fires at block entry), ``blocks.L.hook_per_layer_gate`` (``gelu(W_gate(x))``, ``[b, p, d_ple]``) and
  ``blocks.L.hook_per_layer_out`` (what the branch adds to the residual stream, ``[b, p, d_model]``). An edit of
  any of them is what the rest of the block computes with. The block output is then scaled by the layer's
  ``layer_scalar`` buffer: ``hook_resid_post = (hook_resid_mid + hook_mlp_out + hook_per_layer_out) *
  layer_scalar`` (``BlockLayout.more_after_mlp``: an edit of ``hook_resid_mid`` reaches both). The per-layer inputs
  are computed from the token ids beside the residual stream (``ModelLayout.side_inputs``): ``start_at_layer`` needs
  ``tokens=``, and patching a residual leaves them as the run computes them.

* Key/value sharing across layers (``num_kv_shared_layers``, Gemma-4 E2B/E4B): the last ``num_kv_shared_layers``
  layers have no key/value projections and attend with the keys and values of the last earlier layer of their type
  (``kv_sources(config)``; ``SeparateQKV.kv_from``). Those layers have ``hook_q``, ``q_norm.*`` and ``hook_rot_q``
  but no ``hook_k``/``hook_v``/``k_norm``/``hook_rot_k``/``v_norm``/``hook_k_input``/``hook_v_input`` and no
  ``W_K``/``W_V`` (reading them names the source layer): an edit of the source layer's ``hook_k``, ``hook_v``,
  ``k_norm.*``, ``hook_rot_k`` or ``v_norm.*`` changes the keys and values of the source layer *and* of every layer
  that reads them. Their MLPs may be twice as wide (``use_double_wide_mlp``). During ``generate``, transformers
  runs the sharing layers on the last prompt position only at the first step (``logits_to_keep``): their points
  then see that position only, as the model computes.

* ``attention_k_eq_v`` (Gemma-4 31B): full layers have no value projection, their values are the key projection's
  output, normalized apart (``v_norm``), with their own number of key/value heads (``num_global_key_value_heads``;
  ``SeparateQKV.kv_heads``). ``hook_k`` is then the input of ``k_norm`` and ``hook_v`` the input of ``v_norm``
  (the same numbers, but an edit of one leaves the other as it was; ``SeparateQKV.values_from_keys``); such a layer
  has no ``hook_k_input``/``hook_v_input`` (one projection feeds both) and its ``W_V`` is its ``W_K``.

* ``Gemma4ForConditionalGeneration``: its language model's points, as above, plus (with a vision tower) the image
  features' projector (``embed_vision``) as ``vision_projector.hook_out``. At the image tokens the model embeds the
  padding token and looks its per-layer inputs up for the padding token, the context part from the embeddings with
  the image features in: ``hook_per_layer_input`` is that value. ``use_bidirectional_attention="vision"`` (image
  tokens attend to each other in sliding layers) is the model's own mask, read as computed. An audio tower and its
  ``embed_audio`` are run as the model runs them, without points.

* The mixture-of-experts block (``enable_moe_block``, Gemma-4 26B-A4B): experts *beside* the dense MLP
  (``MoELayout.beside``). The router reads the residual stream (``hook_mlp_in``) with its own norm and scale, then
  ``proj`` (``W_router``): ``hook_router_logits``; softmax over every expert (``hook_expert_weights``), top-k,
  renormalized, times each chosen expert's ``per_expert_scale`` (``hook_routing_weights``; ``Routing.expert_scale``).
  The experts read the residual stream through ``pre_feedforward_layernorm_2``: ``mlp.experts.{e}.*``. The dense
  MLP's output after ``post_feedforward_layernorm_1`` is ``mlp.hook_dense_out``, the experts' sum after
  ``post_feedforward_layernorm_2`` is ``mlp.hook_moe_out``; their sum is ``ln2_post``'s input, whose output is
  ``hook_mlp_out``. An edit of ``hook_mlp_in``/``hook_resid_mid`` reaches both branches (``MoELayout.inputs``).

* ``gemma4_unified_text``: the same layers, attention, MLP, norms and ``layer_scalar`` as ``gemma4_text`` (its
  ``modeling_gemma4_unified`` copies them), without per-layer inputs and without the experts' block (its config has
  neither field): every point and weight above but ``hook_per_layer_*`` and the experts'; key/value sharing,
  ``attention_k_eq_v``, per-layer head sizes and the double-wide MLP as above. Without per-layer inputs a run
  ``start_at_layer`` needs ``tokens=`` only where a later layer reads the keys and values of one before the start.
  Its config's default ``use_bidirectional_attention="vision"`` changes nothing in a text-only model.
  ``Gemma4UnifiedForConditionalGeneration`` (``gemma4_unified``): its language model's points, plus (with
  ``vision_config``) the output of its vision embedder's projection to the language model's width
  (``embed_vision.multimodal_embedder``, ``[b, patches, d_model]``, padding patches included; the model scatters
  the others into the image tokens) as ``vision_projector.hook_out``. The model has no vision tower; audio is
  projected (``embed_audio``) as the model does it, without points.

Refused at wrap time, naming what works: bidirectional
attention (``use_bidirectional_attention="all"``), rope types other than rotate-half ones, ``Gemma4Model`` (wrap a
``Gemma4ForCausalLM``), custom modeling code. Flash and flex attention: every hook point but the pattern and score
points.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    ModelLayout,
    ProjectionNorm,
    SeparateQKV,
    UnsupportedModelError,
    hf,
    hookimpl,
)
from lensadapters.moe import FusedExperts, MoELayout, Routing
from lensadapters.plugin_api import Hooked, HookPoint, OutputSite, Site, rotate_half_spec

__version__ = "0.1.0"
# the family's name is the text model's (Gemma4TextModel), the contract the plugin's
LENSADAPTERS_CONTRACT = "lensadapters_gemma4.testing:Gemma4Contract"
#: ``gemma4_unified_text`` (``Gemma4UnifiedForCausalLM``...): Gemma 4 without per-layer inputs and experts
TEXT_CLASSES = ("Gemma4ForCausalLM", "Gemma4TextModel", "Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextModel")
#: the vision-language model whose language model (a ``Gemma4TextModel``) the plugin describes
VLM_CLASSES = ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")
_V_NORM = ProjectionNorm("self_attn.v_norm", "bphd")
_KV_PATHS = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm", "self_attn.v_norm")
FAMILY = hf.DecoderFamily(
    "Gemma4Text",
    model_type="gemma4_text",
    packages=("gemma4", "gemma4_unified"),
    norms=("Gemma4RMSNorm", "Gemma4UnifiedRMSNorm"),
    block=hf.SANDWICH_BLOCK,
    qk_norms=hf.qk_norms("bphd"),  # the MLP: the family's default gate/up/down projections
    rope_types=(*hf.ROTATE_HALF_ROPE_TYPES, "proportional"),
    scaled_embeddings=True,
    layer_optional=_KV_PATHS,  # layers reading another layer's keys and values have none
)
ARCH = FAMILY.architecture(
    "Gemma 4 text (Gemma4ForCausalLM, Gemma4TextModel): per-layer input embeddings, per-layer head sizes, "
    "query/key/value norms, sandwich norms, sliding windows; the language model of Gemma4ForConditionalGeneration",
    name="gemma4",
    model_types=("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified"),
    transformers=">=5.23,<6",
    vision_language=True,
)
_PLE_PATHS = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm", "act_fn")
#: the experts' branch beside the dense MLP (``enable_moe_block``): its router reads the residual stream itself
#: (norm, scale, then ``proj``), the experts read it through their own pre-norm, each branch has its own post-norm
_MOE_INPUTS = ("router", "pre_feedforward_layernorm_2")
_MOE_OUTPUTS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
_MOE_PATHS = (*_MOE_INPUTS, *_MOE_OUTPUTS, "router.proj", "experts")


def _moe(config: Any) -> bool:
    """Whether the config has experts beside the MLP (a ``gemma4_unified_text`` config has no such field)."""
    return bool(getattr(config, "enable_moe_block", False))


def _ple(config: Any) -> int:
    """The width of the per-layer inputs, 0 where the config has none (``gemma4_unified_text``: no such field)."""
    return int(getattr(config, "hidden_size_per_layer_input", 0) or 0)


def _cap(value: Optional[float]) -> float:
    return float(value) if value else -1.0


def layer_head_dims(config: Any) -> list[int]:
    """Each layer's head size (full-attention layers: ``global_head_dim``)."""
    return [config.per_layer_config[i].head_dim for i in range(config.num_hidden_layers)]


def kv_sources(config: Any) -> list[Optional[int]]:
    """For each layer, the layer whose keys and values it attends with (``num_kv_shared_layers``: the last layers
    reuse those of the last earlier layer of their type), or ``None`` where it computes its own."""
    first_shared = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    types = config.layer_types
    return [
        None if i < first_shared else max(j for j in range(first_shared) if types[j] == types[i])
        for i in range(config.num_hidden_layers)
    ]


def check(model: Any) -> None:
    c = hf.text_config(model)
    unsupported = [
        (
            getattr(c, "use_bidirectional_attention", None) == "all",
            "use_bidirectional_attention='all' (not a causal model)",
        ),
    ]
    for found, what in unsupported:
        if found:
            raise UnsupportedModelError(
                f"this Gemma 4 config sets {what}; the gemma4 plugin does not describe it yet (it serves causal "
                f"Gemma 4 text models)"
            )


def validate_class(model: Any) -> None:
    name = type(model).__name__
    # the multimodal model (with or without a vision tower) whose language model is a Gemma 4 text model
    if name in VLM_CLASSES and type(model.get_decoder()).__name__ in TEXT_CLASSES:
        return
    if name not in TEXT_CLASSES:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Gemma 4 text model; the gemma4 plugin describes Gemma4ForCausalLM, "
            f"Gemma4TextModel and the language model of Gemma4ForConditionalGeneration: load the checkpoint with "
            f"Gemma4ForCausalLM.from_pretrained for text-only use"
        )


def missing_in_layer(layer: nn.Module) -> list[str]:
    """What a layer lacks: per-layer-input modules where its config has per-layer inputs, key/value projections
    and norms where it computes its own keys and values."""
    missing = []
    if getattr(layer, "hidden_size_per_layer_input", 0):
        missing += [p for p in _PLE_PATHS if not hasattr(layer, p)]
    if getattr(layer, "enable_moe_block", False):
        missing += hf.missing_paths(layer, _MOE_PATHS)
    attn = getattr(layer, "self_attn", None)
    if not getattr(attn, "is_kv_shared_layer", False):  # attention_k_eq_v: v_proj is None on full layers
        own = _KV_PATHS if not getattr(attn, "use_alternative_attention", False) else _KV_PATHS[:1] + _KV_PATHS[2:]
        missing += hf.missing_paths(layer, own)
    return missing


def config_fields(model: Any) -> dict[str, Any]:
    c = hf.text_config(model)
    dims = layer_head_dims(c)
    moe = (
        dict(d_mlp=c.moe_intermediate_size, num_experts=c.num_experts, experts_per_token=c.top_k_experts)
        if _moe(c)
        else {}
    )
    return dict(
        **moe,
        act_fn=c.hidden_activation,
        output_logits_soft_cap=_cap(c.final_logit_softcapping),
        **hf.window_fields(hf.layer_windows(c)),
        extra={
            "rope_type": hf.rope_types(model.get_submodule(hf.join(FAMILY.base(model), "rotary_emb"))),
            "rope_theta_local": hf.rope_theta(c, "sliding_attention"),
            "attn_scale": 1.0,
            "global_head_dim": max(dims),
            "layer_head_dims": dims,
            "hidden_size_per_layer_input": _ple(c),
            "use_normalization_before_and_after": True,
            "use_qk_norm": True,
            "use_v_norm": True,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", True)),
            **({"dense_d_mlp": c.intermediate_size} if _moe(c) else {}),
        },
    )


def embed(model: Any, layout: ModelLayout) -> ModelLayout:
    # each layer's (cos, sin) from its attention module's `position_embeddings`: sliding and full layers differ
    # per-layer inputs: every block reads one computed from the token ids besides the residual stream
    c = hf.text_config(model)
    side = ("hook_per_layer_input",) if _ple(c) else ()
    return replace(
        layout,
        rotary=None,
        rotary_input="position_embeddings",
        side_inputs=side,
    )


def block(model: Any, layer: int) -> BlockLayout:
    # a block with per-layer inputs adds their branch after the MLP's residual add; every block scales its output
    return replace(FAMILY.block, more_after_mlp=True)


def attn_qkv(model: Any, layer: int) -> SeparateQKV:
    q_norm, k_norm = FAMILY.qk_norms or (None, None)
    c = hf.text_config(model)
    source = kv_sources(c)[layer]
    # attention_k_eq_v: full layers have no v_proj, their values are the key projection's output
    keys_as_values = source is None and bool(getattr(c, "attention_k_eq_v", False)) and is_full(c, layer)
    q, k, v = FAMILY.qkv
    return SeparateQKV(
        q,
        k,
        k if keys_as_values else v,
        rotary=rotate_half_spec(layer_head_dims(c)[layer]),
        q_norm=q_norm,
        k_norm=k_norm,
        v_norm=_V_NORM if source is None else None,
        kv_from=source,
        kv_heads=c.per_layer_config[layer].num_key_value_heads,
        values_from_keys=keys_as_values,
    )


def mlp(model: Any, layer: int) -> Any:
    """The dense MLP, or (``enable_moe_block``) the experts beside it: routed by softmax over every expert
    (float32), top-``top_k_experts``, renormalized, each weight times its expert's ``per_expert_scale``."""
    c = hf.text_config(model)
    if not _moe(c):
        return FAMILY.dense_mlp()
    return MoELayout(
        router="router",
        routing=Routing(
            c.num_experts, c.top_k_experts, normalize=True, weights_dtype="float32", expert_scale="per_expert_scale"
        ),
        experts=FusedExperts("experts"),
        router_output="probabilities",
        router_logits="router.proj",
        beside=FAMILY.dense_mlp(),
        inputs=_MOE_INPUTS,
        branch_outputs=_MOE_OUTPUTS,
    )


def is_full(config: Any, layer: int) -> bool:
    return bool(config.layer_types[layer] == "full_attention")


def tiny_config(seed: int) -> Any:
    """A Gemma-4-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 3 layers (two sliding with head
    size 16, then a full one with head size 32 and proportional RoPE), GQA (4 query heads, 2 kv heads), a 4-token
    window, per-layer inputs of width 16. Other seeds vary depth, heads and the window."""
    from transformers import Gemma4TextConfig

    sizes = {
        "head_dim": 16,
        "global_head_dim": 32,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 512,
    }
    return hf.sliding_toy(Gemma4TextConfig, seed, (3, (4, 2)), full_every=3, last_full=True, **sizes, **TOKENS)


#: Gemma's special tokens (bos 2, eos 1), in every toy config
TOKENS = {"bos_token_id": 2, "eos_token_id": 1}


def precheck(model: Any) -> None:
    # what the plugin does not describe is named before the layout check would report its missing modules
    validate_class(model)
    check(model)


PLUGIN = hf.DecoderPlugin(
    ARCH,
    FAMILY,
    tiny_config,
    config=config_fields,
    precheck=precheck,
    missing_in_layer=missing_in_layer,
    embed=embed,
    block=block,
    attn_qkv=attn_qkv,
    mlp=mlp,
).export(globals())


class ArgumentSite(Site):
    """One argument of a module's forward (by position or keyword), shown to a point; an edit is what the module
    runs with."""

    def __init__(self, module: nn.Module, point: HookPoint, index: int, name: str) -> None:
        self.module, self.point, self.index, self.name = module, point, index, name
        self.points = (point,)

    def install(self) -> list[Any]:
        # first among the module's pre-hooks: the point is named before the module's input points
        return [self.module.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        positional = len(args) > self.index
        value = args[self.index] if positional else kwargs.get(self.name)
        if value is None:
            return None
        value, changed = self.point.apply(value, protect=True)
        if not changed:
            return None
        if positional:
            return args[: self.index] + (value,) + args[self.index + 1 :], kwargs
        return args, {**kwargs, self.name: value}


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Hooked) -> list[Site]:
    """The per-layer-input points of every block that has per-layer inputs."""
    if arch.name != ARCH.name:
        return []
    sites: list[Site] = []
    for i, layer in enumerate(hooked.block_modules):
        if not getattr(layer, "hidden_size_per_layer_input", 0):
            continue
        pre = f"blocks.{i}."
        given = hooked.new_point(pre + "hook_per_layer_input", before=pre + "hook_resid_pre")
        gate = hooked.new_point(pre + "hook_per_layer_gate", after=pre + "hook_mlp_out")
        out = hooked.new_point(pre + "hook_per_layer_out", after=pre + "hook_per_layer_gate")
        sites += [
            ArgumentSite(layer, given, 1, "per_layer_input"),
            OutputSite(layer.get_submodule("act_fn"), gate),
            OutputSite(layer.get_submodule("post_per_layer_input_norm"), out),
        ]
    return sites
