"""The per-head input points of multi-head latent attention (``hook_attn_in``, ``hook_q_input``, ``hook_k_input``,
``hook_v_input``: TransformerLens' ``use_split_qkv_input``) against plain PyTorch, and edge attribution over them.

The reference (:class:`PerHeadAttention`) is a plain forward hook on the HF attention module that recomputes its
output with every head's query, key and value from that head's own copy of the block input, through the model's
own modules (``input_layernorm``, ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``, the rope key from the key copy), transformers' own
rotary function, and a softmax attention written out. Unedited, it gives the model's logits; with a delta added to
one head's copy it is what that edit means, and its autograd gives the exact gradient of every copy. Float64 models
(dense: transformers 4.57's MoE does not run in float64), DeepSeek-V3 (interleaved rope, with and without a query
latent) and V2 (complex rotary); then EAP and EAP-IG edge scores against derivatives and patches made through the
reference."""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any, Callable, Optional

import pytest
import torch

from lensadapters import HookedModel
from lensadapters import edge_attribution as eap
from lensadapters.errors import HookReturnError
from lensadapters.testing.tiny_models import patching_pair

Tensor = torch.Tensor
testing = pytest.importorskip("lensadapters_deepseek_v3.testing")
WHICH = ("q", "k", "v")
MODELS = {
    "V3 q latent": dict(v2=False, q_lora_rank=8, interleave=True),
    "V3 q_proj": dict(v2=False, q_lora_rank=None, interleave=False),
    "V2 q latent": dict(v2=True, q_lora_rank=8),
    "V3 generic adapter": dict(v2=False, q_lora_rank=8, interleave=True),  # described automatically, verified
}
#: how far a float64 reference may round from the served points, relative: DeepSeek-V2 rotates its rope columns in
#: float32 (complex64), where two float64 inputs a few ulps apart can round to float32 numbers one ulp apart
TOL = {"V2 q latent": 1e-6}


#: edge scores: the gradients pass backwards through the model's RMSNorms, which compute in float32 (see below)
EAP_TOL = 1e-6


def tol(label: str) -> float:
    return TOL.get(label, 1e-10)


def model_of(label: str, dtype: torch.dtype = torch.float64, layers: int = 2) -> torch.nn.Module:
    config = testing.deepseek_v3_config(n_heads=4, hidden=32, layers=layers, dense_layers=layers, **MODELS[label])
    model = testing.DeepseekV3Contract().make_model(config, 0, attn_implementation="sdpa")
    return model.to(dtype).eval()


def tokens(vocab: int, seed: int = 1) -> Tensor:
    return torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(seed))


def metric(logits: Tensor) -> Tensor:
    return (logits[:, -1, 5] - logits[:, -1, 7]).sum()


class PerHeadAttention:
    """Layer ``layer``'s attention recomputed by plain hooks, each head's ``q``/``k``/``v`` from its own copy of the
    block input; ``deltas[(which, head)]`` (``[b, p, d_model]``) is added to that copy. ``copies`` keeps the copies
    of the last forward (their ``.grad`` after a backward: ``retain_grad``)."""

    def __init__(self, model: torch.nn.Module, layer: int, deltas: Optional[dict] = None) -> None:
        self.model, self.block = model, model.model.layers[layer]
        self.attn, self.deltas = self.block.self_attn, deltas or {}
        self.copies: dict[str, Tensor] = {}
        self.modeling = importlib.import_module(type(self.attn).__module__)

    def __enter__(self) -> "PerHeadAttention":
        self.handles = [
            self.block.register_forward_pre_hook(self._block_input, with_kwargs=True),
            self.attn.register_forward_hook(self._attention, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _block_input(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.x = args[0] if args else kwargs["hidden_states"]

    def _attention(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        a, c, x = self.attn, self.model.config, self.x
        h, nope, rope, dv, rank = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        )
        for which in WHICH:
            copy = x.unsqueeze(2).repeat(1, 1, h, 1)
            if copy.requires_grad:
                copy.retain_grad()
            self.copies[which] = copy
        edited = {w: t.clone() for w, t in self.copies.items()}
        for (which, head), delta in self.deltas.items():
            edited[which][:, :, head] = edited[which][:, :, head] + delta.to(x.dtype)

        def own(t: Tensor, width: int) -> Tensor:  # [b, p, h (copy), h * width] -> each copy's own head's
            return t.unflatten(-1, (h, width)).diagonal(dim1=2, dim2=3).movedim(-1, 2)

        ln = self.block.input_layernorm
        n_q = ln(edited["q"])
        q_in = a.q_proj(n_q) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(n_q)))
        q = own(q_in, nope + rope).transpose(1, 2)  # [b, h, p, d]
        kv_k = a.kv_a_proj_with_mqa(ln(edited["k"]))
        kv_v = a.kv_a_proj_with_mqa(ln(edited["v"]))
        k_nope = own(a.kv_b_proj(a.kv_a_layernorm(kv_k[..., :rank])), nope + dv)[..., :nope].transpose(1, 2)
        k_rot = kv_k[..., rank:].transpose(1, 2)  # each head's own rope key
        v = own(a.kv_b_proj(a.kv_a_layernorm(kv_v[..., :rank])), nope + dv)[..., nope:].transpose(1, 2)
        angles = kwargs["position_embeddings"]
        q_pass, q_rot = q[..., :nope], q[..., nope:]
        if c.model_type == "deepseek_v2":
            q_rot, k_rot = self.modeling.apply_rotary_emb(q_rot, k_rot, angles)
        elif c.rope_interleave:
            q_rot, k_rot = self.modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, *angles)
        else:
            q_rot, k_rot = self.modeling.apply_rotary_pos_emb(q_rot, k_rot, *angles)
        q, k = torch.cat((q_pass, q_rot), -1), torch.cat((k_nope, k_rot), -1)
        scores = q @ k.transpose(-1, -2) * a.scaling
        p = scores.shape[-1]
        causal = torch.ones(p, p, dtype=torch.bool, device=scores.device).tril()
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        z = (pattern @ v).transpose(1, 2).flatten(-2)
        return (a.o_proj(z), *output[1:])


def wrap(label: str, model: torch.nn.Module) -> HookedModel:
    """The plugin's wrapping, or the generic adapter's automatic description (no plugin asked for) for a label
    saying so: its per-head query, key and value inputs verified at wrap time (``hook_attn_in`` has no reference
    there, and is not served)."""
    if "generic" not in label:
        return HookedModel.wrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model, adapter="generic")
    assert hm.cfg.n_layers == 2 and "blocks.1.hook_attn_in" not in hm.hook_dict
    return hm


def served_model(label: str) -> tuple[HookedModel, Tensor]:
    hm = wrap(label, model_of(label))
    return hm, tokens(hm.cfg.d_vocab)


def add_at(head: int, delta: Tensor) -> Callable[[Tensor, Any], Tensor]:
    def hook(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        x[:, :, head] = x[:, :, head] + delta.to(x.dtype)
        return x

    return hook


@pytest.mark.parametrize("label", list(MODELS))
def test_head_inputs_are_the_block_input_and_the_reference_is_the_model(label: str) -> None:
    """Each per-head input is the block input once per head; hooking them all without an edit leaves the logits
    bit for bit; the plain per-head reference, unedited, is the model's own attention (float64 rounding)."""
    hm, ids = served_model(label)
    model, layer = hm.hf_model, 1
    names = [f"blocks.{layer}.hook_{w}" for w in ("attn_in", "q_input", "k_input", "v_input")]
    names = [n for n in names if n in hm.hook_dict or "attn_in" not in n]
    with torch.no_grad():
        plain = model(ids).logits
        _, cache = hm.run_with_cache(ids, names_filter=names)
        resid = hm.run_with_cache(ids, names_filter=f"blocks.{layer}.hook_resid_pre")[1][
            f"blocks.{layer}.hook_resid_pre"
        ]
        same = hm.run_with_hooks(ids, fwd_hooks=[(n, lambda x, hook: x.clone()) for n in names], return_type="logits")
        with PerHeadAttention(model, layer):
            reference = model(ids).logits
    for name in names:
        assert cache[name].shape == (*ids.shape, hm.cfg.n_heads, hm.cfg.d_model)
        assert torch.equal(cache[name], resid.unsqueeze(2).expand_as(cache[name]))
    assert torch.equal(same, plain)
    assert (reference - plain).abs().max() <= tol(label) * plain.abs().max()
    hm.unwrap()


@pytest.mark.parametrize("label", list(MODELS))
def test_one_heads_input_edit_is_that_heads_query_key_or_value_from_the_edited_input(label: str) -> None:
    """An edit of head ``h``'s copy in ``hook_q_input``/``hook_k_input``/``hook_v_input`` (and of every stream of
    head ``h`` through ``hook_attn_in``) moves the logits as the reference computing that head's query, key (its rope
    key too) or value from the edited copy; no other head's ``hook_q``/``hook_k``/``hook_v`` changes."""
    hm, ids = served_model(label)
    model, head = hm.hf_model, 2
    delta = torch.randn((*ids.shape, hm.cfg.d_model), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        plain = model(ids).logits
        _, before = hm.run_with_cache(ids, names_filter=lambda n: n.endswith(("hook_q", "hook_k", "hook_v")))
    worst = 0.0
    for layer in range(hm.cfg.n_layers):
        for which in (*WHICH, "attn_in") if f"blocks.{layer}.hook_attn_in" in hm.hook_dict else WHICH:
            point = f"blocks.{layer}.hook_{which}" + ("" if which == "attn_in" else "_input")
            streams = WHICH if which == "attn_in" else (which,)
            with torch.no_grad():
                with PerHeadAttention(model, layer, {(w, head): delta for w in streams}):
                    expected = model(ids).logits
                with hm.hooks(fwd_hooks=[(point, add_at(head, delta))]):
                    got, after = hm.run_with_cache(ids, names_filter=[f"blocks.{layer}.attn.hook_{w}" for w in WHICH])
            moved = float((expected - plain).abs().max())
            assert moved > 1e-3, point
            error = float((got - expected).abs().max()) / moved
            worst = max(worst, error)
            assert error <= tol(label), (point, error)
            for w in WHICH:
                name = f"blocks.{layer}.attn.hook_{w}"
                others = [h for h in range(hm.cfg.n_heads) if h != head]
                assert torch.equal(after[name][:, :, others], before[name][:, :, others]), (point, name)
                assert (w in streams) != torch.equal(after[name][:, :, head], before[name][:, :, head]), (point, name)
    print(f"{label}: largest edit error relative to the edit's effect {worst:.2e}")
    hm.unwrap()


@pytest.mark.parametrize("label", list(MODELS))
def test_gradients_at_the_head_inputs_are_the_references(label: str) -> None:
    """The gradient a backward hook reads at each per-head input is the reference's gradient of that head's copy
    (the derivative through that head's query, key or value alone), and the gradient at the embeddings is the
    model's own."""
    hm, ids = served_model(label)
    model = hm.hf_model
    names = [f"blocks.{i}.hook_{w}_input" for i in range(hm.cfg.n_layers) for w in WHICH]
    grads: dict[str, Tensor] = {}
    embed = "blocks.0.hook_resid_pre"
    with torch.enable_grad():
        with hm.hooks(bwd_hooks=[(n, lambda g, hook: grads.setdefault(hook.name, g)) for n in [*names, embed]]):
            metric(hm(ids, return_type="logits")).backward()
        model.zero_grad(set_to_none=True)
        refs = [PerHeadAttention(model, i) for i in range(hm.cfg.n_layers)]
        embedding: list[Tensor] = []
        handle = model.model.embed_tokens.register_forward_hook(
            lambda m, a, o: (o.retain_grad(), embedding.append(o))[1] and None
        )
        try:
            for ref in refs:
                ref.__enter__()
            metric(model(ids).logits).backward()
        finally:
            for ref in refs:
                ref.__exit__()
            handle.remove()
        model.zero_grad(set_to_none=True)
    worst = 0.0
    for i, ref in enumerate(refs):
        for w in WHICH:
            got, want = grads[f"blocks.{i}.hook_{w}_input"], ref.copies[w].grad
            assert want is not None and float(want.abs().max()) > 1e-6
            error = float((got - want).abs().max() / want.abs().max())
            worst = max(worst, error)
            assert error <= tol(label), (i, w, error)
    want = embedding[0].grad
    assert want is not None and float((grads[embed] - want).abs().max() / want.abs().max()) <= tol(label)
    print(f"{label}: largest gradient error relative to the largest gradient {worst:.2e}")
    hm.unwrap()


def _reference_derivative(model: torch.nn.Module, ids: Tensor, layer: int, key: tuple, delta: Tensor) -> float:
    """d/da metric(reference run with a * delta added to the copy ``key = (which, head)`` of layer ``layer``)."""
    a = torch.zeros((), dtype=torch.float64, requires_grad=True)
    with torch.enable_grad(), PerHeadAttention(model, layer, {key: a * delta}):
        value = metric(model(ids).logits)
        return float(torch.autograd.grad(value, a)[0])


def _node_deltas(hm: HookedModel, clean: Tensor, corrupted: Tensor, graph: Any) -> Callable[[Any], Tensor]:
    """Each upstream node's clean-minus-corrupted output (two runs for all of them)."""
    names = sorted({node.point for node in graph.upstream})
    with torch.no_grad():
        a = hm.run_with_cache(clean, names_filter=names)[1]
        b = hm.run_with_cache(corrupted, names_filter=names)[1]

    def delta(node: Any) -> Tensor:
        d = a[node.point] - b[node.point]
        return d if node.head is None else d[:, :, node.head]

    return delta


@pytest.mark.parametrize("label", list(MODELS))
def test_edge_scores_are_the_references_derivatives_and_patches(label: str) -> None:
    """EAP (at the corrupted run) is no longer refused: every score into a head's query, key or value input equals
    the derivative of the metric with the upstream node's clean-minus-corrupted output added to that head's copy in
    the reference; EAP-IG with one step equals EAP at the clean run; and faithfulness with one head-input edge
    removed is the clean run with that edge's corrupted-minus-clean difference patched in by the reference."""
    model = model_of(label)
    hm = wrap(label, model)
    clean = tokens(hm.cfg.d_vocab)
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 7) % hm.cfg.d_vocab
    scores = eap.edge_attribution(hm, clean, corrupted, metric, progress=False)
    graph = scores.graph
    kinds = [d.name.rsplit(".", 1)[-1] for d in graph.downstream if d.kind == "attn"]
    assert kinds.count("q") == kinds.count("k") == kinds.count("v") == hm.cfg.n_layers * hm.cfg.n_heads
    node_delta = _node_deltas(hm, clean, corrupted, graph)
    into_heads = [  # a sample of the edges into the head inputs: every upstream kind, q, k and v of every head
        (u, d) for u, d in scores.valid.nonzero().tolist() if graph.downstream[d].kind == "attn" and (u + d) % 5 == 0
    ]
    checked, worst = 0, 0.0
    for u, d in into_heads:
        up, down = graph.upstream[u], graph.downstream[d]
        which = down.name.rsplit(".", 1)[-1]
        expected = _reference_derivative(model, corrupted, down.layer, (which, down.head), node_delta(up))
        error = abs(float(scores.scores[u, d]) - expected) / max(1.0, abs(expected))
        worst = max(worst, error)
        # float32 rounding: EAP hooks every point at once, and the model's RMSNorms compute in float32 even in a
        # float64 model, so an ulp of float64 anywhere upstream can round to float32 apart in their backward (one
        # point hooked alone gives the reference's gradient bit for bit: test_gradients_at_the_head_inputs...)
        assert error <= EAP_TOL, (up.name, down.name, float(scores.scores[u, d]), expected)
        checked += 1
    assert checked >= 6 and float(scores.scores.abs().max()) > 1e-3
    one = eap.edge_attribution(hm, clean, corrupted, metric, steps=1, progress=False)
    at_clean = eap.edge_attribution(hm, clean, corrupted, metric, at="clean", progress=False)
    torch.testing.assert_close(one.scores, at_clean.scores, rtol=EAP_TOL, atol=1e-12)
    # one head -> key-input edge removed: the clean run with that edge patched from the corrupted run, by hand
    u, d = next(
        (u, d)
        for u, d in scores.valid.nonzero().tolist()
        if graph.downstream[d].name.endswith(".k") and graph.upstream[u].kind == "attn"
    )
    up, down = graph.upstream[u], graph.downstream[d]
    circuit = scores.valid.clone()
    circuit[u, d] = False
    patched = eap.faithfulness(hm, clean, corrupted, metric, circuit).metric
    with torch.no_grad(), PerHeadAttention(model, down.layer, {("k", down.head): -node_delta(up)}):
        expected = float(metric(model(clean).logits))
    assert math.isclose(patched, expected, rel_tol=10 * tol(label), abs_tol=1e-12), (patched, expected)  # forward
    assert patched != scores.clean_metric
    print(f"{label}: {checked} edges, largest score error {worst:.2e}")
    hm.unwrap()


def test_float32_moe_models_get_a_graph_and_their_scores_are_derivatives() -> None:
    """The plugin's own tiny DeepSeek-V3 (float32, MoE layers): every edge into the last block's head inputs of a
    sample equals the derivative through the reference (float32 rounding)."""
    hm, clean, corrupted, metric_ = patching_pair("deepseek_v3")
    scores = eap.edge_attribution(hm, clean, corrupted, metric_, progress=False)
    graph, last = scores.graph, hm.cfg.n_layers - 1
    edges = [
        (u, d)
        for u, d in scores.valid.nonzero().tolist()
        if graph.downstream[d].kind == "attn" and graph.downstream[d].layer == last
    ][::7]
    node_delta = _node_deltas(hm, clean, corrupted, graph)
    for u, d in edges:
        up, down = graph.upstream[u], graph.downstream[d]
        a = torch.zeros((), dtype=torch.float64, requires_grad=True)
        delta = node_delta(up)
        key = (down.name.rsplit(".", 1)[-1], down.head)
        with torch.enable_grad(), PerHeadAttention(hm.hf_model, last, {key: a * delta}):
            expected = float(torch.autograd.grad(metric_(hm.hf_model(corrupted).logits), a)[0])
        assert abs(float(scores.scores[u, d]) - expected) <= 1e-4 * max(1.0, abs(expected)), (up.name, down.name)
    assert len(edges) >= 4
    hm.unwrap()


def _cached_and_one_pass(hm: HookedModel, ids: Tensor, steps: int = 3) -> list[tuple[Tensor, Tensor]]:
    """``(the last position's logits with the cache, those of one pass over the whole sequence)`` at each of
    ``steps`` greedy steps after ``ids``."""
    model, pairs = hm.hf_model, []
    out = model(ids, use_cache=True)
    for _ in range(steps):
        ids = torch.cat((ids, out.logits[:, -1:].argmax(-1)), dim=1)
        out = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        pairs.append((out.logits[:, -1], model(ids, use_cache=False).logits[:, -1]))
    return pairs


@pytest.mark.parametrize("which", ["q_input", "k_input", "v_input", "attn_in"])
def test_head_input_edits_during_cached_generation(which: str) -> None:
    """An edit of one head's copy while generating with the cache: a query input's at every step is that of one
    pass over the whole sequence; a key or value input's too where the cache keeps the per-head keys and values
    (transformers 4), and refused by name where it keeps the latents, which every step decompresses again
    (transformers 5: the edit of the earlier positions would be lost)."""
    hm = HookedModel.wrap(model_of("V3 q latent", torch.float32))
    ids = tokens(hm.cfg.d_vocab)[:1]
    bump = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(4))
    hooks = [(f"blocks.1.hook_{which}", add_at(2, bump * 3))]
    if which != "q_input" and testing.CACHES_LATENTS:
        with torch.no_grad(), hm.hooks(fwd_hooks=hooks):
            out = hm.hf_model(ids, use_cache=True)
            with pytest.raises(HookReturnError, match="cached generation"):
                hm.hf_model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        hm.unwrap()
        return
    with torch.no_grad():
        plain = _cached_and_one_pass(hm, ids)
        with hm.hooks(fwd_hooks=hooks):
            edited = _cached_and_one_pass(hm, ids)
    for (cached, one_pass), (unedited, _) in zip(edited, plain):
        torch.testing.assert_close(cached, one_pass, rtol=1e-5, atol=1e-5)
        assert (cached - unedited).abs().max() > 1e-3
    hm.unwrap()
