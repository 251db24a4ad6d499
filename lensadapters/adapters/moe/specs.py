"""The declarative description of a mixture-of-experts MLP.

A plugin whose block has a sparse MoE MLP returns a :class:`MoELayout` from ``lensadapters_mlp_act`` instead of an
``MLPLayout`` (per layer: dense layers keep their ``MLPLayout``). The block's ``BlockLayout.mlp`` is the MoE module
(its input is the normalized MLP input, its first output ``hook_mlp_out``). The core derives everything else: the
routing hook points, the per-expert hook points, the per-expert weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

if TYPE_CHECKING:
    from torch import Tensor, nn


@dataclass(frozen=True)
class Routing:
    """How the router's logits ``[tokens, n_experts]`` become the routing the experts use.

    ``probabilities`` of every expert are computed from the logits (``"softmax"``, in float32), the ``top_k``
    largest are selected (``torch.topk``: the same experts and ties as the model), and the selected probabilities
    are the routing weights, renormalized to sum to one when ``normalize`` (Mixtral always; Qwen3-MoE and OLMoE
    when ``norm_topk_prob``). ``weights_dtype`` is the dtype the model keeps them in: ``"float32"``, or
    ``"logits"`` (cast back to the router logits' dtype).

    ``order="topk_softmax"`` describes routers that select first: the ``top_k`` largest *logits* are selected and
    the softmax is taken over those alone (in ``weights_dtype``), so the routing weights sum to one without
    renormalization. The probability of every expert (``mlp.hook_expert_weights``) is then that softmax scattered
    over the experts, zero for those not selected (TransformerLens' value for such routers), and an edit of it
    changes the weights of the selected experts (read at the indices selected from the logits), not the selection.
    ``order="topk_sigmoid"`` selects the same way and takes the sigmoid of each selected logit (in float32, then
    ``weights_dtype``) instead of the softmax over them: no renormalization, the probability of every expert that
    sigmoid at the selected experts and zero elsewhere (the scores such a router returns).

    Grouped routing (DeepSeek): ``probabilities="sigmoid"`` scores each expert with a sigmoid (float32) instead of
    the softmax. ``selection_bias`` names a router attribute ``[n_experts]`` added to the probabilities for
    *choosing* only (DeepSeek-V3's ``e_score_correction_bias``; the weights stay the unbiased probabilities).
    ``groups=(n_group, topk_group)`` splits the experts into ``n_group`` equal groups, keeps the ``topk_group``
    groups of the highest group score (``group_score``: ``"top2_sum"``, the sum of a group's two largest choice
    scores, or ``"max"``) and fills the others' choice scores with ``masked_score`` before the top-k. With
    ``normalize`` the weights are divided by their sum plus ``normalize_eps``; ``scale`` multiplies them last
    (``routed_scaling_factor``).

    ``expert_scale`` names a router attribute ``[n_experts]`` (a per-expert scale, Gemma 4's ``per_expert_scale``)
    that multiplies each selected weight after the renormalization: ``weights * expert_scale[top_k_index]``.
    """

    n_experts: int
    top_k: int
    normalize: bool = True
    probabilities: Literal["softmax", "sigmoid"] = "softmax"
    weights_dtype: Literal["float32", "logits"] = "logits"
    order: Literal["softmax_topk", "topk_softmax", "topk_sigmoid"] = "softmax_topk"
    selection_bias: Optional[str] = None
    groups: Optional[tuple[int, int]] = None
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    masked_score: float = float("-inf")
    normalize_eps: float = 0.0
    scale: float = 1.0
    expert_scale: Optional[str] = None


@dataclass(frozen=True)
class FusedExperts:
    """Experts stored as 3-D parameters of one module (transformers 5), called as
    ``experts(hidden [tokens, d_model], top_k_index [tokens, k], top_k_weights [tokens, k]) -> [tokens, d_model]``.

    ``gate_up`` names the ``[n_experts, 2 * d_mlp, d_model]`` parameter (the gate rows, then the up rows),
    ``down`` the ``[n_experts, d_model, d_mlp]`` one; ``act`` the module attribute holding the activation.
    Expert ``e`` computes ``down[e] @ (act(gate[e] @ x) * (up[e] @ x))``.

    The flags follow transformers' ``use_experts_implementation``: ``transposed`` parameters are stored
    ``[n_experts, in, out]`` and applied as ``x @ W[e]``; ``interleaved`` gate/up features alternate (gate at even,
    up at odd positions) instead of gate rows then up rows; ``gate_up_bias``/``down_bias`` name bias parameters
    ``[n_experts, out]`` added after each product. ``glu(experts_module, gate, up)``, when given, is what the
    expert computes from its gate and up projections instead of ``act(gate) * up`` (a clamped or shifted GLU), read
    live from the module's attributes: ``mlp.experts.{e}.hook_post`` is its result.

    ``scaled_input``: the routing weights multiply each expert's *input*, not its output, and the experts module
    computes every expert on every token: it is called as ``experts(routed [n_experts * tokens, d_model]) ->
    [n_experts * tokens, d_model]``, block ``e`` of ``routed`` the flattened MoE input times expert ``e``'s routing
    weight (zero where the token did not choose it), block ``e`` of the output expert ``e``'s output on it, and the
    MoE module sums the blocks. Expert ``e`` then adds ``down[e] @ (act(gate[e] @ (w x)) * (up[e] @ (w x)))`` for a
    token routed to it with weight ``w``; an expert not chosen adds its output on zeros, which is zero (no biases: a
    biased expert is not described this way).

    ``gated=False``: the experts are not gated MLPs; ``gate_up`` then names the ``[n_experts, d_mlp, d_model]`` up
    projection alone and expert ``e`` computes ``down[e] @ act(up[e] @ x)`` (Nemotron-H's squared-ReLU experts).
    They have no ``hook_gate`` point and no gate weight.
    """

    module: str
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    act: str = "act_fn"
    transposed: bool = False
    interleaved: bool = False
    gate_up_bias: Optional[str] = None
    down_bias: Optional[str] = None
    glu: Optional[Callable[["nn.Module", "Tensor", "Tensor"], "Tensor"]] = None
    scaled_input: bool = False
    gated: bool = True


@dataclass(frozen=True)
class ExpertModules:
    """Experts as a list of gated-MLP modules (transformers 4): ``{module}.{e}.{gate|up|down}`` are linear layers
    and ``{module}.{e}.{act}`` the activation; expert ``e`` computes ``down(act(gate(x)) * up(x))``."""

    module: str
    gate: str
    up: str
    down: str
    act: str = "act_fn"


@dataclass(frozen=True)
class GroupedExperts:
    """Experts as two modules of the MoE module, each holding a 3-D ``weight`` ``[n_experts, out, in]`` and called
    as ``projection(rows [n_rows, in], rows_per_expert: list[int]) -> [n_rows, out]`` on rows grouped by expert (the
    first ``rows_per_expert[0]`` rows expert 0's, then expert 1's, ...), each group times its expert's weight
    (``F.linear``); the MoE module computes ``act`` (an attribute of it) of the first half of ``gate_up``'s output
    times its second half, runs ``down`` on that, multiplies each row by its routing weight and sums the rows into
    their tokens. Expert ``e`` computes ``down[e] @ (act(gate[e] @ x) * (up[e] @ x))``, ``gate_up[e]``'s rows the
    gate rows then the up rows. ``module`` is the MoE module; ``gate_up``, ``down`` and ``act`` are relative to it.
    The router of such experts returns the routing grouped the same way (``MoELayout.router_output="grouped"``)."""

    module: str
    gate_up: str
    down: str
    act: str
    weight: str = "weight"
    gated: bool = True


Experts = Union[FusedExperts, ExpertModules, GroupedExperts]


@dataclass(frozen=True)
class MoELayout:
    """A block's MLP that routes each token to ``routing.top_k`` of ``routing.n_experts`` gated experts.

    Paths are relative to the block. ``router`` is the module computing the router logits from the flattened MLP
    input. ``router_output`` says what it returns: ``"logits"`` (a linear layer; the MoE module routes itself,
    transformers 4) or ``"routing"`` (a tuple ``(logits, top_k_weights, top_k_index)`` that the MoE module hands
    to a :class:`FusedExperts` module, transformers 5) or ``"scores"`` (a tuple ``(scores, top_k_index)``:
    ``scores`` ``[tokens, n_experts]`` holds the routing weights at the selected experts and zeros elsewhere; the
    router does not return its logits, which the core computes from its input as ``F.linear(x, router.weight,
    router.bias)``, the router's own product, and the experts are computed by the core whenever the routing is
    edited). A router's ``bias`` parameter, when it has one, is part of the logits (``lensadapters.moe.router_bias``).
    ``"index_weights"``: a tuple ``(top_k_index, top_k_weights)`` the MoE module routes with (its logits recomputed
    as for ``"scores"``; an edited routing is handed on through the router's output).
    ``"scores_logits"``: a tuple ``(scores, logits)``, ``scores`` ``[tokens, n_experts]`` the routing weights at the
    selected experts and zeros elsewhere, the selection the top-k of ``logits`` (``torch.topk``, as the router takes
    it); an edited routing is handed on as the scores it gives (the experts, a :class:`FusedExperts` module with
    ``scaled_input``, are computed by the core where the scores cannot carry it: an edited selection).

    ``"probabilities"``: a tuple ``(probabilities, top_k_weights, top_k_index)`` (the router computes the
    probabilities itself and the block hands the routing to a :class:`FusedExperts` module); the logits are then the
    output of ``router_logits``, a linear module inside the router (the router may normalize and scale its input
    before it: its weight is ``W_router``, applied to that input), whose edit the router computes with.

    ``"grouped"``: a tuple ``(order, row_tokens, row_weights, rows_per_expert, logits)`` for
    :class:`GroupedExperts`: ``order`` ``[tokens * k]`` the flattened top-k slots sorted by expert (``sort`` of the
    flattened ``[tokens, k]`` indices), ``row_tokens`` each row's token (``order // k``), ``row_weights`` each row's
    routing weight (the flattened top-k weights at ``order``, in the dtype the experts' rows are), ``rows_per_expert``
    the number of rows of each expert (a list of ints) and ``logits`` the router's logits, computed from the output
    of ``router_logits`` (a linear module inside the router, whose edit the router computes with). An edited routing
    is handed on as the router's output the same operations give for it.

    ``shared`` names a module of the block whose output the MoE module adds to the routed experts' sum (shared
    experts, DeepSeek): where the core recomputes the experts at the MoE module's output it adds that output too.
    ``shared_gate`` names a one-output linear module of the block, run on the MoE input, whose ``sigmoid`` multiplies
    the shared module's output before the MoE module adds it (Qwen3-Next's ``shared_expert_gate``): the core's
    recomputation then adds ``sigmoid(shared_gate(x)) * shared(x)``, both values as the model computed them (an edit
    of either included).

    ``beside`` describes a block that runs a dense MLP *and* the experts on the same residual stream, each branch
    with its own input norm, and adds their outputs (Gemma 4's ``enable_moe_block``): ``beside`` is the dense MLP
    (``BlockLayout.mlp`` its module, with the dense ``mlp.hook_pre``/``hook_post``), the router and the experts read
    the residual stream themselves (``inputs``: the block's modules reading it for the experts' branch, e.g. the
    router and the experts' pre-norm; an edit of ``hook_resid_mid``/``hook_mlp_in`` reaches them as it reaches
    ``ln2``), and ``branch_outputs`` = ``(dense, moe)`` names the modules whose outputs are the two branches' (the
    points ``mlp.hook_dense_out`` and ``mlp.hook_moe_out``); the block's ``ln2_post`` normalizes their sum into
    ``hook_mlp_out``. The experts must be a :class:`FusedExperts` module routed through the router's output.
    """

    router: str
    routing: Routing
    experts: Experts
    router_output: Literal[
        "logits", "routing", "scores", "index_weights", "probabilities", "scores_logits", "grouped"
    ] = "logits"
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    router_logits: Optional[str] = None
    beside: Optional[Any] = None  # MLPLayout or FusedGateUp (lensadapters.hooks.specs)
    inputs: tuple[str, ...] = ()
    branch_outputs: Optional[tuple[str, str]] = None


def is_moe(layout: object) -> bool:
    """Whether an MLP description is a mixture of experts."""
    return isinstance(layout, MoELayout)


def stored_moe_layout(
    layer: "nn.Module",
    moe: str,
    routing: Routing,
    expert_linears: tuple[str, str, str],
    fused_routing: Optional[Routing] = None,
) -> MoELayout:
    """The :class:`MoELayout` of a block whose MoE module ``moe`` (relative to ``layer``) has a router ``gate`` and
    experts ``experts``, in the storage the transformers version built: a ``ModuleList`` of gated MLPs whose linear
    layers are ``expert_linears`` = (gate, up, down) with a linear router (transformers 4), or fused 3-D experts
    behind a routing router (transformers 5, routed by ``fused_routing`` when it differs from ``routing``)."""
    from torch import nn

    if isinstance(layer.get_submodule(f"{moe}.experts"), nn.ModuleList):
        gate, up, down = expert_linears
        return MoELayout(
            router=f"{moe}.gate",
            routing=routing,
            experts=ExpertModules(f"{moe}.experts", gate=gate, up=up, down=down),
            router_output="logits",
        )
    return MoELayout(
        router=f"{moe}.gate",
        routing=fused_routing or routing,
        experts=FusedExperts(f"{moe}.experts"),
        router_output="routing",
    )
