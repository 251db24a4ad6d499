"""The names of the core's hook points, in the order they fire: what the wiring creates for a description."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from lensadapters.adapters.moe import MoELayout, is_moe, moe_point_names
from lensadapters.hooks.specs import (
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    MLPLayout,
    MLPLayouts,
    OpaqueMLP,
    QKVLayout,
)

Tensor = torch.Tensor


PATTERN_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")


def _norm_points(prefix: str) -> list[str]:
    return [f"{prefix}.hook_scale", f"{prefix}.hook_normalized"]


def qkv_point_names(qkv: QKVLayout) -> list[str]:
    """The query/key/value points of one block (relative to ``blocks.{i}.``), in the order they fire.

    Separate projections run one after another, each query/key rotated as soon as it is projected (or, with a
    ``q_norm``/``k_norm``, as soon as it is normalized); a fused projection yields q, k and v at once and rotary
    follows.
    """
    rotary = qkv.rotary is not None
    norms = {"q": qkv.q_norm, "k": qkv.k_norm}

    def after_norm(x: str) -> list[str]:  # the norm's points, then rotary on its output
        if norms[x] is None:
            return []
        return _norm_points(f"attn.{x}_norm") + ([f"attn.hook_rot_{x}"] if rotary else [])

    if isinstance(qkv, FusedQKV):  # the parts, rotary on those without a norm, then each norm and its rotary
        return (
            ["attn.hook_q", "attn.hook_k", "attn.hook_v"]
            + [f"attn.hook_rot_{x}" for x in "qk" if rotary and norms[x] is None]
            + [p for x in "qk" if norms[x] is not None for p in after_norm(x)]
        )

    def projection(x: str) -> list[str]:  # the projection, rotated right away when no norm follows it
        return [f"attn.hook_{x}"] + ([f"attn.hook_rot_{x}"] if rotary and norms[x] is None else [])

    if qkv.kv_from is not None:  # keys and values are another layer's
        return projection("q") + after_norm("q")
    if qkv.values_from_keys:  # hook_k and hook_v at the inputs of their norms, the keys' first
        return (
            projection("q")
            + after_norm("q")
            + ["attn.hook_k"]
            + after_norm("k")
            + ["attn.hook_v"]
            + (_norm_points("attn.v_norm"))
        )
    if qkv.norms_after_projections:
        return projection("q") + projection("k") + ["attn.hook_v"] + after_norm("q") + after_norm("k")
    if qkv.v_norm is not None:  # k and v projected, then the key norm, then the value norm
        return (
            projection("q")
            + after_norm("q")
            + projection("k")
            + ["attn.hook_v"]
            + after_norm("k")
            + (_norm_points("attn.v_norm"))
        )
    return projection("q") + after_norm("q") + projection("k") + after_norm("k") + ["attn.hook_v"]


def is_gated(mlp: Union[MLPLayouts, MoELayout]) -> bool:
    """Whether a dense MLP layout has a gate and an up projection (``mlp.hook_pre_linear``, ``W_gate``)."""
    return isinstance(mlp, FusedGateUp) or (isinstance(mlp, MLPLayout) and mlp.pre_linear is not None)


def non_attention_blocks(hooked: Any) -> list[int]:
    """The blocks a plugin describes with a token mixer other than softmax attention (``lensadapters_attn_qkv``
    returned ``None``: the linear-attention or state-space layers of hybrid models). They have no ``attn.*`` point,
    no heads and no attention weights; the analyses that need those refuse them by name."""
    layouts = zip(getattr(hooked, "block_layouts", None) or [], getattr(hooked, "qkv_layouts", None) or [])
    return [i for i, (block, qkv) in enumerate(layouts) if block is not None and qkv is None]


def blocks_without_head_inputs(hooked: Any) -> list[int]:
    """The softmax-attention blocks without every per-head input point (``hook_q_input``/``hook_k_input``/
    ``hook_v_input``): projections the core's head-input site cannot serve (``SeparateQKV.head_inputs`` is ``False``
    and no form of the plugin's serves them; multi-head latent attention's form does) or one projection feeding keys
    and values (``values_from_keys``), or points a verification withheld."""
    names = set(hooked.hook_names)
    layouts = getattr(hooked, "qkv_layouts", None) or []
    return [
        i
        for i, qkv in enumerate(layouts)
        if qkv is not None and any(f"blocks.{i}.hook_{w}_input" not in names for w in "qkv")
    ]


def _dense_mlp_names(mlp: MLPLayouts) -> list[str]:
    return ["mlp.hook_pre"] + (["mlp.hook_pre_linear"] if is_gated(mlp) else []) + ["mlp.hook_post"]


def block_point_names(
    block: BlockLayout, qkv: Optional[QKVLayout], mlp: Union[MLPLayouts, MoELayout, OpaqueMLP]
) -> list[str]:
    """The core's hook points of one block (relative to ``blocks.{i}.``), in the order they fire.

    Post-norm blocks normalize after each residual add; ``ln1_post``/``ln2_post`` normalize the attention and
    MLP outputs before the residual adds. A block without softmax attention (``qkv`` is ``None``) has no
    ``attn.*`` point: its mixer's output is ``hook_attn_out``. A block without an MLP (``BlockLayout.no_mlp``) has
    no MLP, ``ln2`` or ``hook_resid_mid`` point.
    """
    ln1 = _norm_points("ln1") if block.ln1 is not None else []
    attn = [] if qkv is None else qkv_point_names(qkv)
    if qkv is not None:
        attn += ["attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "attn.hook_result"]
    attn += (_norm_points("ln1_post") if block.ln1_post is not None else []) + ["hook_attn_out"]
    if block.no_mlp:  # one branch: the block's output is its input plus the attention's
        return ["hook_resid_pre"] + ln1 + attn + ["hook_resid_post"]
    if is_moe(mlp) and mlp.beside is not None:  # a dense MLP, then the experts beside it, each branch's output
        mlp_names = _dense_mlp_names(mlp.beside) + ["mlp.hook_dense_out"] + moe_point_names(mlp) + ["mlp.hook_moe_out"]
    elif is_moe(mlp):  # a mixture of experts: routing and per-expert points (lensadapters.moe)
        mlp_names = moe_point_names(mlp)
    elif isinstance(mlp, OpaqueMLP):  # its inside is not described: no mlp.* point
        mlp_names = []
    else:
        mlp_names = _dense_mlp_names(mlp)
    mlp_names += (_norm_points("ln2_post") if block.ln2_post is not None else []) + ["hook_mlp_out"]
    if block.post_norm:
        return (
            ["hook_resid_pre"]
            + attn
            + ["hook_resid_mid"]
            + ln1
            + ["hook_mlp_in"]
            + mlp_names
            + (
                ["hook_resid_post"] + _norm_points("ln2") + ["hook_normalized_resid_post"]
                if block.resid_post_before_norm
                else _norm_points("ln2") + ["hook_resid_post"]
            )
        )
    if block.parallel and block.ln2 is not None and block.ln2_before_attn:
        return ["hook_resid_pre"] + ln1 + ["hook_mlp_in"] + _norm_points("ln2") + attn + mlp_names + ["hook_resid_post"]
    names = ["hook_resid_pre"] + ln1 + attn
    if not block.parallel:
        names.append("hook_resid_mid")
    if block.ln2 is not None:
        names += ["hook_mlp_in"] + _norm_points("ln2")
    elif not block.parallel:  # no pre-MLP norm (OLMo 2): the MLP reads the residual stream itself
        names.append("hook_mlp_in")
    return names + mlp_names + ["hook_resid_post"]
