"""lensadapters.edge_attribution on every installed architecture: each edge's score is the derivative of the metric
with that edge's upstream difference added to that downstream input (a brute-force reference: one scaled patch per
edge through the head-input points, differentiated), a node's edges add up to its attribution-patching score, EAP-IG
integrates what it says, circuits and faithfulness patch exactly the edges outside the circuit."""

from __future__ import annotations

import pytest
import torch

from lensadapters import attribution
from lensadapters import edge_attribution as eap
from lensadapters.testing.tiny_models import ARCH_NAMES, patching_pair


def setup(arch: str, seed: int = 0):
    """The arch's patching pair; a model whose structure EAP refuses skips, after checking that the refusal names
    the blocks (``test_eap_refuses_a_residual_stream_that_is_not_the_graphs_sum``)."""
    hm, clean, corrupted, metric = patching_pair(arch, seed)
    try:
        eap.graph_of(hm)
    except attribution.AttributionUnavailable as error:
        assert "blocks [" in str(error)
        hm.unwrap()
        pytest.skip(f"refused: {error}")
    return hm, clean, corrupted, metric


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_eap_refuses_a_residual_stream_that_is_not_the_graphs_sum(arch: str) -> None:
    """Blocks that compute more after their MLP's residual add (per-layer inputs, a layer scalar), post-LN blocks,
    blocks mixing tokens without softmax attention or attention blocks without per-head input points:
    ``edge_attribution`` refuses, naming the blocks; other models get a graph."""
    hm, clean, corrupted, metric = patching_pair(arch)
    more = [i for i, bl in enumerate(hm.block_layouts) if bl is not None and (bl.more_after_mlp or bl.post_norm)]
    mixers = [i for i, (bl, qkv) in enumerate(zip(hm.block_layouts, hm.qkv_layouts)) if bl is not None and qkv is None]
    # softmax attention without the per-head input points: no q/k/v edges to score
    no_inputs = [
        i for i, qkv in enumerate(hm.qkv_layouts) if qkv is not None and f"blocks.{i}.hook_q_input" not in hm.hook_dict
    ]
    if not more and not mixers and not no_inputs:
        assert eap.graph_of(hm).valid.any()
        hm.unwrap()
        return
    with pytest.raises(attribution.AttributionUnavailable, match=r"blocks \["):
        eap.edge_attribution(hm, clean, corrupted, metric, progress=False)
    hm.unwrap()


def first_with_a_graph():
    """The patching pair of the first architecture whose graph EAP builds (one in name order may be refused: a hybrid
    whose blocks mix tokens without softmax attention, a post-LN encoder)."""
    for arch in ARCH_NAMES:
        hm, clean, corrupted, metric = patching_pair(arch)
        try:
            eap.graph_of(hm)
        except attribution.AttributionUnavailable:
            hm.unwrap()
            continue
        return hm, clean, corrupted, metric
    pytest.skip("no installed architecture has an EAP graph")


def node_delta(hm, clean, corrupted, node) -> torch.Tensor:
    with torch.no_grad():
        _, a = hm.run_with_cache(clean, names_filter=node.point)
        _, b = hm.run_with_cache(corrupted, names_filter=node.point)
    delta = a[node.point] - b[node.point]
    return delta if node.head is None else delta[:, :, node.head]


def edge_derivative(hm, tokens, metric, delta: torch.Tensor, downstream) -> float:
    """d/da metric(run with a * delta added to the downstream input), at a = 0: the edge's score by definition."""
    a = torch.zeros((), dtype=torch.float64, requires_grad=True)
    where = (slice(None), slice(None)) if downstream.head is None else (slice(None), slice(None), downstream.head)

    def add(x: torch.Tensor, hook) -> torch.Tensor:
        x = x.clone()
        x[where] = x[where] + (a * delta).to(x.dtype)
        return x

    with torch.enable_grad():
        value = metric(hm.run_with_hooks(tokens, fwd_hooks=[(downstream.point, add)], return_type="logits"))
        return float(torch.autograd.grad(value, a)[0])


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_edge_scores_are_the_derivatives_along_each_edge(arch: str) -> None:
    hm, clean, corrupted, metric = setup(arch)
    scores = eap.edge_attribution(hm, clean, corrupted, metric, progress=False)
    graph, cfg = scores.graph, hm.cfg
    # the graph: every head's query input, one key and one value input per key/value head, MLP inputs, the logits
    kinds = [d.name.rsplit(".", 1)[-1] for d in graph.downstream if d.kind == "attn"]
    assert kinds.count("q") == cfg.n_layers * cfg.n_heads
    assert kinds.count("k") == kinds.count("v") == cfg.n_layers * cfg.n_key_value_heads
    assert graph.downstream[-1].name == "logits" and graph.upstream[0].name == "embed"
    assert scores.scores[~scores.valid].abs().sum() == 0
    # every edge of a random sample, and the heaviest, against the brute-force derivative
    edges = scores.valid.nonzero()
    sample = edges[torch.randperm(len(edges), generator=torch.Generator().manual_seed(1))[:6]].tolist()
    sample.append(divmod(int(scores.scores.abs().argmax()), scores.scores.shape[1]))
    tol = 1e-5 if cfg.dtype == torch.float64 else 1e-4  # the head inputs' edits are computed in float32
    for u, d in sample:
        up, down = graph.upstream[u], graph.downstream[d]
        expected = edge_derivative(hm, corrupted, metric, node_delta(hm, clean, corrupted, up), down)
        assert abs(float(scores.scores[u, d]) - expected) <= tol * max(1.0, abs(expected)), (up.name, down.name)
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_nodes_edges_add_up_to_its_attribution_score(arch: str) -> None:
    """The residual stream's gradient is the sum of its readers' (every head input, the MLP input, the logits), so
    the sum of a node's edges is its attribution-patching score. A parallel block whose MLP reads the attention's
    normalized input has no MLP-input node, and the sum misses that reader: there only the logits' edges are
    compared."""
    hm, clean, corrupted, metric = setup(arch)
    scores = eap.edge_attribution(hm, clean, corrupted, metric, progress=False)
    graph = scores.graph
    a = attribution.attribute(
        hm, clean, corrupted, metric, ["resid_pre", "result", "attn_out", "mlp_out"], progress=False
    )
    per_node = {
        "embed": a.scores("resid_pre", ("layer",))[0],
        **{f"M{layer}": v for layer, v in enumerate(a.scores("mlp_out", ("layer",)))},
        **{f"A{layer}": v for layer, v in enumerate(a.scores("attn_out", ("layer",)))},
    }
    for layer, row in enumerate(a.scores("result", ("layer", "head"))):
        per_node.update({f"A{layer}.{h}": v for h, v in enumerate(row)})
    mlp_inputs = sum(d.kind == "mlp" for d in graph.downstream)
    if mlp_inputs < hm.cfg.n_layers:
        assert hm.cfg.parallel_attn_mlp and "blocks.0.hook_mlp_in" not in hm.hook_dict
        hm.unwrap()
        return
    sums = scores.node_scores()
    tol = 1e-5 if hm.cfg.dtype == torch.float64 else 1e-4  # the head inputs' edits are computed in float32
    for name, total in sums.items():
        assert abs(total - float(per_node[name])) <= tol * max(1.0, abs(total)), name
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES[::5])
def test_eap_ig_integrates_from_the_corrupted_to_the_clean_input(arch: str) -> None:
    """One step is EAP on the clean run; two steps average the gradients at the midpoint and at the clean embeddings,
    and the embeddings' edges add up to the derivative along the path. A parallel block without ``hook_mlp_in``
    (GPT-J) has no MLP-input node, so that sum misses what reaches the metric through the MLPs: there the MLPs'
    outputs are silenced (every run, the reference's included), which leaves nothing unscored."""
    hm, clean, corrupted, metric = setup(arch)
    if hm.cfg.num_experts:  # routing switches experts along the path: no smooth path to integrate along
        hm.unwrap()
        pytest.skip("a mixture of experts' top-k routing is not differentiable along the interpolation")
    unscored = [i for i in range(hm.cfg.n_layers) if f"blocks.{i}.hook_mlp_in" not in hm.hook_names]
    silenced = [(f"blocks.{i}.hook_mlp_out", lambda x, hook: torch.zeros_like(x)) for i in unscored]
    with hm.hooks(silenced):
        one = eap.edge_attribution(hm, clean, corrupted, metric, steps=1, progress=False)
        at_clean = eap.edge_attribution(hm, clean, corrupted, metric, at="clean", progress=False)
        # one step: the clean input's gradient (up to float32 rounding: the head inputs' edits are computed in float32)
        assert torch.allclose(one.scores, at_clean.scores, atol=1e-6, rtol=1e-5)
        two = eap.edge_attribution(hm, clean, corrupted, metric, steps=2, progress=False)
        with torch.no_grad():
            _, ends = hm.run_with_cache(clean, names_filter="blocks.0.hook_resid_pre")
            _, starts = hm.run_with_cache(corrupted, names_filter="blocks.0.hook_resid_pre")
        start, end = starts["blocks.0.hook_resid_pre"], ends["blocks.0.hook_resid_pre"]
        expected = 0.0
        for alpha in (0.5, 1.0):
            a = torch.zeros((), dtype=torch.float64, requires_grad=True)

            def embed(x: torch.Tensor, hook, alpha=alpha, a=a) -> torch.Tensor:
                return (start + (alpha + a) * (end - start)).to(x.dtype)

            with torch.enable_grad():
                value = metric(hm.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.hook_resid_pre", embed)]))
                expected += float(torch.autograd.grad(value, a)[0]) / 2
    got = float(two.scores[0].sum())
    assert abs(got - expected) <= 1e-5 * max(1.0, abs(expected)), (got, expected)
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES[::2])  # every other architecture (CI time)
def test_faithfulness_patches_exactly_the_edges_outside_the_circuit(arch: str) -> None:
    hm, clean, corrupted, metric = setup(arch)
    scores = eap.edge_attribution(hm, clean, corrupted, metric, progress=False)
    valid = scores.valid
    everything = eap.faithfulness(hm, clean, corrupted, metric, valid)
    nothing = eap.faithfulness(hm, clean, corrupted, metric, torch.zeros_like(valid))
    assert abs(everything.metric - scores.clean_metric) < 1e-9 and abs(everything.recovered - 1) < 1e-6
    assert abs(nothing.metric - scores.corrupted_metric) < 1e-4 and abs(nothing.recovered) < 1e-3
    # all but one edge: the clean run with that downstream input moved by the upstream's corrupted-minus-clean
    u, d = next(  # the first head -> head-input edge
        (u, d)
        for u, d in scores.valid.nonzero().tolist()
        if scores.graph.downstream[d].kind == "attn" and scores.graph.upstream[u].kind == "attn"
    )
    up, down = scores.graph.upstream[u], scores.graph.downstream[d]
    circuit = valid.clone()
    circuit[u, d] = False
    one = eap.faithfulness(hm, clean, corrupted, metric, circuit)
    delta = -node_delta(hm, clean, corrupted, up)
    where = (slice(None), slice(None)) if down.head is None else (slice(None), slice(None), down.head)

    def move(x: torch.Tensor, hook) -> torch.Tensor:
        x = x.clone()
        x[where] = x[where] + delta.to(x.dtype)
        return x

    with torch.no_grad():
        expected = float(metric(hm.run_with_hooks(clean, fwd_hooks=[(down.point, move)], return_type="logits")))
    assert abs(one.metric - expected) <= 1e-5 * max(1.0, abs(expected)), (up.name, down.name)
    assert one.metric != everything.metric and one.edges == int(valid.sum()) - 1
    hm.unwrap()


def test_circuits_take_the_top_edges_and_the_smallest_circuit_reaches_its_target() -> None:
    hm, clean, corrupted, metric = first_with_a_graph()
    scores = eap.edge_attribution(hm, clean, corrupted, metric, progress=False)
    top = scores.circuit(top_n=5)
    assert int(top.sum()) == 5 and bool((top <= scores.valid).all())
    least = scores.scores.abs()[top].min()
    assert bool((scores.scores.abs()[scores.valid & ~top] <= least).all())
    threshold = scores.circuit(threshold=float(least))
    assert bool((threshold >= top).all())
    first = scores.edges()[0]
    assert abs(first[2]) == float(scores.scores.abs().max()) and top[scores.upstream.index(first[0])].any()
    circuit, faith = eap.smallest_circuit(hm, clean, corrupted, metric, scores, target=0.5, progress=False)
    assert faith.recovered >= 0.5 and faith.edges == int(circuit.sum()) <= int(scores.valid.sum())
    with pytest.raises(ValueError, match="top_n"):
        scores.circuit()
    hm.unwrap()


def test_edge_attribution_shows_progress_and_leaves_no_gradient(capsys) -> None:
    hm, clean, corrupted, metric = first_with_a_graph()
    eap.edge_attribution(hm, clean, corrupted, metric, steps=2)
    assert "EAP-IG" in capsys.readouterr().err
    assert all(p.grad is None for p in hm.hf_model.parameters())
    hm.unwrap()
