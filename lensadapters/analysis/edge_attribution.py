"""Edge attribution patching (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024): a score for every edge of the model's
computational graph from two forwards and one backward, circuits from the scores, and their faithfulness.

The graph: the residual stream is a sum of what the upstream components wrote into it, and every downstream input
reads that sum. Upstream components: the embeddings (``blocks.0.hook_resid_pre``), each attention head
(``attn.hook_result``; a block that normalizes the attention output before adding it, Gemma 2/3's and OLMo 2's
``ln1_post``, gives one node for the whole attention layer, ``hook_attn_out``, since its heads' contributions do not
add up) and each MLP (``hook_mlp_out``). Downstream inputs: each head's query, key and value input (the head-input
points ``hook_q_input``/``hook_k_input``/``hook_v_input``), each MLP's input (``hook_mlp_in``) and the logits (the
final residual stream, ``hook_resid_post`` of the last block). Under grouped-query attention a key/value head's input
is one node per key/value head (``A3.1.k`` is key/value head 1 of block 3, which every query head of its group reads):
its score is what that head's keys (or values) carry for all of them. A parallel block whose MLP reads the
attention's normalized input (GPT-J: no ``hook_mlp_in``) has no MLP-input node: those edges are not scored, by EAP
and EAP-IG alike, and a circuit keeps them (so the embeddings' edges there add up to their derivative without what
reaches it through the MLPs). Multi-head latent attention has the head-input points too (each head's query, key and
value computed from its own copy through the latents: :class:`lensadapters.adapters.latent_attention.
LatentHeadInputSite`); blocks without them (a plugin that could not verify them) are refused by name.

Edge score, with ``g_d`` the gradient of the metric with respect to input ``d``::

    score(u -> d) = sum over batch and positions of (u_clean - u_corrupted) . g_d

``g_d`` is taken on the corrupted run (``at="corrupted"``, the convention of :mod:`lensadapters.attribution`:
the estimate of restoring the edge from the clean run) or on the clean run (``at="clean"``, Hanna et al.'s and
auto-circuit's convention: minus the estimate of corrupting the edge); ``steps=m`` (EAP-IG) averages ``g_d`` over
``m`` runs whose input embeddings (``blocks.0.hook_resid_pre``) go from the corrupted to the clean ones
(``corrupted + k/m (clean - corrupted)``, ``k = 1..m``). A node's edge scores add up to its attribution-patching
score (``sum_d score(u -> d)`` equals :func:`lensadapters.attribution.attribute`'s for ``u``'s hook point).

Memory: the upstream outputs of both runs (``[batch, pos, n_upstream, d_model]`` each) and the downstream inputs'
gradients (``[batch, pos, n_downstream, d_model]``); the scores are ``[n_upstream, n_downstream]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from lensadapters.analysis.attribution_runs import (
    AttributionUnavailable,
    Metric,
    _scalar,
    _tokens,
    forward_backward,
    require_softmax_attention,
)
from lensadapters.wiring.names import blocks_without_head_inputs

Tensor = torch.Tensor

__all__ = [
    "Node",
    "Graph",
    "EdgeScores",
    "Faithfulness",
    "edge_attribution",
    "graph_of",
    "faithfulness",
    "smallest_circuit",
]


@dataclass(frozen=True)
class Node:
    """One node of the graph: ``name`` (``"embed"``, ``"A3.1"``, ``"A3"``, ``"M3"``; ``"A3.1.q"``, ``"A3.1.k"``,
    ``"A3.1.v"``, ``"M3"``, ``"logits"``), the hook point whose value (upstream) or input (downstream) it is, the
    head (or key/value head) along that point's head axis (``None``: the point is ``[batch, pos, d_model]``), its
    block (``-1`` for the embeddings, ``n_layers`` for the logits) and its kind (``"embed"``, ``"attn"``, ``"mlp"``,
    ``"logits"``)."""

    name: str
    point: str
    head: Optional[int]
    layer: int
    kind: str


@dataclass
class Graph:
    """Every upstream and downstream node of a model, and which edges exist (``valid[u, d]``: ``u`` writes to the
    residual stream before ``d`` reads it)."""

    upstream: list[Node]
    downstream: list[Node]
    valid: Tensor  # bool [U, D]

    def points(self, nodes: Sequence[Node]) -> list[tuple[str, int, int]]:
        """``(point, first node index, node count)`` per hook point, in order."""
        out: list[tuple[str, int, int]] = []
        for i, node in enumerate(nodes):
            if out and out[-1][0] == node.point:
                out[-1] = (node.point, out[-1][1], out[-1][2] + 1)
            else:
                out.append((node.point, i, 1))
        return out


def graph_of(model: Any) -> Graph:
    """The EAP graph of ``model`` (see the module's documentation)."""
    require_softmax_attention(model)
    layouts = getattr(model, "block_layouts", None) or []
    more = [i for i, bl in enumerate(layouts) if bl is not None and bl.more_after_mlp]
    if more:
        raise AttributionUnavailable(
            f"blocks {more} compute more after their MLP's residual add (per-layer inputs, a layer scalar): the "
            f"residual stream is not the sum of the embeddings', heads' and MLPs' outputs, which the EAP graph's "
            f"edges assume. Use node attribution (lensadapters.attribution) or activation patching"
        )
    missing = blocks_without_head_inputs(model)
    if missing:
        raise AttributionUnavailable(
            f"blocks {missing} have no per-head input points (hook_q_input/hook_k_input/hook_v_input: not served, or "
            f"not verified, for their attention): the graph has no query, key or value edges into them. Use node "
            f"attribution "
            f"(lensadapters.attribution) or activation patching"
        )
    cfg = model.cfg
    names = set(model.hook_names)
    layouts = model.block_layouts
    if any(layout is None for layout in layouts):
        raise ValueError("edge attribution needs every block's layout: this model has opaque blocks")
    post_ln = [i for i, layout in enumerate(layouts) if layout.post_norm]
    if post_ln:
        raise AttributionUnavailable(
            f"blocks {post_ln} normalize the residual stream itself after each add (post-LN): edge attribution needs "
            f"a residual stream that is a sum of the components' outputs. Use lensadapters.attribution"
        )
    n_heads, n_kv = cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads
    upstream = [Node("embed", "blocks.0.hook_resid_pre", None, -1, "embed")]
    downstream: list[Node] = []
    for layer in range(cfg.n_layers):
        pre = f"blocks.{layer}."
        if layouts[layer].ln1_post is None and pre + "attn.hook_result" in names:
            upstream += [Node(f"A{layer}.{h}", pre + "attn.hook_result", h, layer, "attn") for h in range(n_heads)]
        else:
            upstream.append(Node(f"A{layer}", pre + "hook_attn_out", None, layer, "attn"))
        upstream.append(Node(f"M{layer}", pre + "hook_mlp_out", None, layer, "mlp"))
        for which, heads in (("q", n_heads), ("k", n_kv), ("v", n_kv)):
            downstream += [
                Node(f"A{layer}.{h}.{which}", pre + f"hook_{which}_input", h, layer, "attn") for h in range(heads)
            ]
        if pre + "hook_mlp_in" in names:
            downstream.append(Node(f"M{layer}", pre + "hook_mlp_in", None, layer, "mlp"))
    downstream.append(Node("logits", f"blocks.{cfg.n_layers - 1}.hook_resid_post", None, cfg.n_layers, "logits"))
    valid = torch.zeros(len(upstream), len(downstream), dtype=torch.bool)
    for i, u in enumerate(upstream):
        for j, d in enumerate(downstream):
            same_block = u.layer == d.layer and u.kind == "attn" and d.kind == "mlp"
            valid[i, j] = u.layer < d.layer or (same_block and not layouts[d.layer].parallel)
    return Graph(upstream, downstream, valid)


def _stack(values: dict[str, Tensor], graph: Graph, nodes: Sequence[Node], dtype: torch.dtype) -> Tensor:
    """The nodes' values, ``[batch, pos, len(nodes), d_model]``."""
    parts = []
    for point, _, count in graph.points(nodes):
        value = values[point].to(dtype)
        parts.append(value if value.dim() == 4 else value.unsqueeze(2))
        assert parts[-1].shape[2] == count, (point, tuple(value.shape), count)
    return torch.cat(parts, dim=2)


@dataclass
class EdgeScores:
    """The score of every edge (``scores[u, d]``, zero where ``valid`` is false) and what it was computed from."""

    graph: Graph
    scores: Tensor  # [U, D]
    clean_metric: float
    corrupted_metric: float
    method: str

    @property
    def upstream(self) -> list[str]:
        return [n.name for n in self.graph.upstream]

    @property
    def downstream(self) -> list[str]:
        return [n.name for n in self.graph.downstream]

    @property
    def valid(self) -> Tensor:
        return self.graph.valid

    def edges(self) -> list[tuple[str, str, float]]:
        """Every edge ``(upstream, downstream, score)``, highest ``|score|`` first."""
        u, d = self.valid.nonzero(as_tuple=True)
        values = self.scores[u, d]
        order = values.abs().argsort(descending=True)
        return [(self.upstream[u[i]], self.downstream[d[i]], float(values[i])) for i in order.tolist()]

    def circuit(self, top_n: Optional[int] = None, threshold: Optional[float] = None) -> Tensor:
        """The edges of a circuit, a bool ``[U, D]``: the ``top_n`` edges by ``|score|``, or those with ``|score| >=
        threshold`` (both: the top ``top_n`` of those)."""
        if top_n is None and threshold is None:
            raise ValueError("pass top_n (how many edges) or threshold (the least |score| kept)")
        magnitude = torch.where(self.valid, self.scores.abs(), torch.full_like(self.scores, -1.0))
        chosen = self.valid.clone()
        if threshold is not None:
            chosen &= magnitude >= threshold
        if top_n is not None:
            kept = torch.zeros_like(chosen)
            flat = torch.where(chosen, magnitude, torch.full_like(magnitude, -1.0)).flatten()
            top = flat.topk(min(int(top_n), int(chosen.sum()))).indices
            kept.view(-1)[top] = True
            chosen &= kept
        return chosen

    def node_scores(self) -> dict[str, float]:
        """Each upstream node's edge scores summed (its attribution-patching score)."""
        return {name: float(v) for name, v in zip(self.upstream, self.scores.sum(1))}


def edge_attribution(
    model: Any,
    clean_tokens: Any,
    corrupted_tokens: Any,
    metric: Metric,
    *,
    steps: Optional[int] = None,
    at: str = "corrupted",
    progress: bool = True,
) -> EdgeScores:
    """Score every edge of ``model``'s graph for ``metric(logits)`` (one number; reduce over the batch inside it):
    EAP (one backward, on the run ``at`` names) or, with ``steps``, EAP-IG (``steps`` backwards on inputs
    interpolated from the corrupted to the clean embeddings). See the module's documentation."""
    if at not in ("corrupted", "clean"):
        raise ValueError(f"at must be 'corrupted' or 'clean', not {at!r}")
    if steps is not None and int(steps) < 1:
        raise ValueError(f"steps must be a positive number of interpolation steps, not {steps}")
    graph = graph_of(model)
    clean_tokens, corrupted_tokens = _tokens(model, clean_tokens), _tokens(model, corrupted_tokens)
    up_points = [p for p, _, _ in graph.points(graph.upstream)]
    down_points = [p for p, _, _ in graph.points(graph.downstream)]
    runs = 2 if steps is None else 2 + int(steps)
    with tqdm(total=runs, desc="edge attribution" if steps is None else "EAP-IG", disable=not progress) as bar:
        with torch.no_grad():
            cached = {}
            metrics = {}
            for which, tokens in (("clean", clean_tokens), ("corrupted", corrupted_tokens)):
                if steps is None and which == at:
                    continue
                logits, cache = model.run_with_cache(tokens, names_filter=up_points, return_type="logits")
                cached[which], metrics[which] = {p: cache[p] for p in up_points}, float(_scalar(metric(logits)))
                bar.update(1)
        if steps is None:
            tokens = clean_tokens if at == "clean" else corrupted_tokens
            metrics[at], cached[at], (grads,) = forward_backward(model, tokens, metric, up_points, down_points)
            bar.update(1)
            total = grads
        else:
            clean0, corrupted0 = (
                cached["clean"]["blocks.0.hook_resid_pre"],
                cached["corrupted"]["blocks.0.hook_resid_pre"],
            )
            total = {}
            for k in range(1, int(steps) + 1):
                alpha = k / int(steps)

                def interpolate(x: Tensor, alpha: float = alpha) -> Tensor:
                    return corrupted0 + alpha * (clean0 - corrupted0)

                _, _, (grads,) = forward_backward(model, corrupted_tokens, metric, (), down_points, embed=interpolate)
                for name, g in grads.items():
                    total[name] = total[name] + g if name in total else g.clone()
                bar.update(1)
            total = {name: g / int(steps) for name, g in total.items()}
    dtype = torch.promote_types(cached["clean"]["blocks.0.hook_resid_pre"].dtype, torch.float32)
    delta = _stack(cached["clean"], graph, graph.upstream, dtype) - _stack(
        cached["corrupted"], graph, graph.upstream, dtype
    )
    gradients = _stack(total, graph, graph.downstream, dtype)
    scores = torch.einsum("bpud,bpvd->uv", delta, gradients)
    scores = torch.where(graph.valid.to(scores.device), scores, torch.zeros_like(scores)).cpu()
    method = "EAP" if steps is None else f"EAP-IG (steps={int(steps)})"
    return EdgeScores(graph, scores, metrics["clean"], metrics["corrupted"], method)


@dataclass
class Faithfulness:
    """A circuit's run: ``metric`` with every edge outside it patched from the corrupted run, and ``recovered``, the
    share of the clean-minus-corrupted metric it keeps (1: the whole behaviour, 0: none)."""

    metric: float
    clean_metric: float
    corrupted_metric: float
    edges: int

    @property
    def recovered(self) -> float:
        gap = self.clean_metric - self.corrupted_metric
        return (self.metric - self.corrupted_metric) / gap if gap else float("nan")


def faithfulness(
    model: Any,
    clean_tokens: Any,
    corrupted_tokens: Any,
    metric: Metric,
    circuit: Tensor,
    graph: Optional[Graph] = None,
) -> Faithfulness:
    """Run the clean input with every edge outside ``circuit`` (a bool ``[U, D]``, from :meth:`EdgeScores.circuit`)
    patched from the corrupted run: each downstream input ``d`` becomes ``d + sum over u of (u_corrupted - u)`` for
    the edges ``u -> d`` not in the circuit, where ``u`` is upstream node's output in this run (as auto-circuit and
    Hanna et al. patch edges). Queries, keys and values are patched per head through the head-input points."""
    graph = graph or graph_of(model)
    clean_tokens, corrupted_tokens = _tokens(model, clean_tokens), _tokens(model, corrupted_tokens)
    if circuit.shape != graph.valid.shape:
        raise ValueError(f"circuit must be a bool [{len(graph.upstream)}, {len(graph.downstream)}] mask")
    patched = (graph.valid & ~circuit.bool().cpu()).to(torch.float64)
    up_points = graph.points(graph.upstream)
    with torch.no_grad():
        clean_logits = model(clean_tokens, return_type="logits")
        logits, cache = model.run_with_cache(
            corrupted_tokens, names_filter=[p for p, _, _ in up_points], return_type="logits"
        )
        corrupted = {p: cache[p] for p, _, _ in up_points}
        current: dict[str, Tensor] = {}

        def record(x: Tensor, hook: Any) -> None:
            current[hook.name] = x.detach().clone()

        def patcher(first: int, count: int) -> Callable[..., Optional[Tensor]]:
            def patch(x: Tensor, hook: Any) -> Optional[Tensor]:
                add = None
                for point, start, n in up_points:
                    if point not in current:
                        continue
                    weights = patched[start : start + n, first : first + count]
                    if not bool(weights.any()):
                        continue
                    diff = corrupted[point].double() - current[point].double()
                    diff = diff if diff.dim() == 4 else diff.unsqueeze(2)
                    term = torch.einsum("bpud,uv->bpvd", diff, weights.to(diff.device))
                    add = term if add is None else add + term
                if add is None:
                    return None
                return (x.double() + (add if x.dim() == 4 else add.squeeze(2))).to(x.dtype)

            return patch

        edits = [(point, patcher(first, count)) for point, first, count in graph.points(graph.downstream)]
        with model.hooks([(p, record) for p, _, _ in up_points], _readonly=True), model.hooks(edits):
            circuit_logits = model(clean_tokens, return_type="logits")
        return Faithfulness(
            float(_scalar(metric(circuit_logits))),
            float(_scalar(metric(clean_logits))),
            float(_scalar(metric(logits))),
            int((circuit.bool().cpu() & graph.valid).sum()),
        )


def smallest_circuit(
    model: Any,
    clean_tokens: Any,
    corrupted_tokens: Any,
    metric: Metric,
    scores: EdgeScores,
    target: float = 0.8,
    progress: bool = True,
) -> tuple[Tensor, Faithfulness]:
    """The fewest top edges (by ``|score|``) whose circuit keeps ``target`` of the metric's clean-minus-corrupted
    gap, found by bisection over the number of edges (``log2(edges)`` faithfulness runs; faithfulness need not grow
    with every edge added, so this is the smallest such count bisection finds, and what it returns does reach the
    target). ``(circuit, its faithfulness)``; the whole graph when nothing smaller does."""
    total = int(scores.valid.sum())
    runs: dict[int, Faithfulness] = {}

    def run(n: int) -> Faithfulness:
        if n not in runs:
            runs[n] = faithfulness(model, clean_tokens, corrupted_tokens, metric, scores.circuit(top_n=n), scores.graph)
            bar.update(1)
        return runs[n]

    with tqdm(desc="smallest circuit", disable=not progress) as bar:
        low, high = 0, total  # the whole graph is the clean run: it keeps everything
        while high - low > 1:
            middle = (low + high) // 2
            if run(middle).recovered >= target:
                high = middle
            else:
                low = middle
        return scores.circuit(top_n=high), run(high)
