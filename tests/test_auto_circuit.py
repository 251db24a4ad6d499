"""auto-circuit 1.0 on a HookedModel (through ``as_hooked_transformer``) equals auto-circuit on TransformerLens 2.x
with the same weights: its edge attribution patching scores (``mask_gradient_prune_scores``, the fast EAP: patch
wrappers put in the hook points' places) agree on every edge, Q/K/V-input edges included. Needs auto-circuit in an
environment with TransformerLens 2.x (README, "Tools that run on lensadapters"; scripts/setup-tl-clients.sh)."""

from __future__ import annotations

from functools import reduce
from typing import Any, Optional

import pytest
import torch

from lensadapters import HookedModel

pytest.importorskip("auto_circuit")
pytest.importorskip("transformer_lens")


def _model(family: str) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=48, n_positions=64)).eval()
    config = LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,  # auto-circuit's Q/K/V-input edges are per query head
        num_hidden_layers=2,
        intermediate_size=48,
        vocab_size=48,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clean and corrupted prompts (the third token differs) and an answer and a wrong answer per prompt."""
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(3, 48, (4, 6), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 48, (4,), generator=g)
    return clean, corrupt, torch.randint(3, 48, (4,), generator=g), torch.randint(3, 48, (4,), generator=g)


def _eap_scores(model: Any, graph: Optional[list[Any]] = None) -> dict[str, torch.Tensor]:
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.utils.graph_utils import patchable_model

    clean, corrupt, answer, wrong_answer = _prompts()
    answers, wrong = [torch.tensor([int(a)]) for a in answer], [torch.tensor([int(w)]) for w in wrong_answer]
    loader = PromptDataLoader(PromptDataset(clean, corrupt, answers, wrong), seq_len=None, diverge_idx=0, batch_size=4)
    patchable = patchable_model(
        model, factorized=True, slice_output="last_seq", separate_qkv=True, device=torch.device("cpu")
    )
    if graph is not None:
        graph.extend([patchable.srcs, patchable.dests])
    return mask_gradient_prune_scores(
        patchable, loader, None, grad_function="logit", answer_function="avg_diff", mask_val=0.0
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_edge_attribution_scores_equal_transformer_lens(family: str) -> None:
    from lensadapters.integrations.transformer_lens import as_hooked_transformer
    from lensadapters.testing.tl_reference import hooked_transformer, word_tokenizer

    model = _model(family)
    tok = word_tokenizer(48)
    reference = hooked_transformer(model, tokenizer=tok)
    for switch in ("use_attn_result", "use_split_qkv_input", "use_hook_mlp_in"):  # what auto-circuit's loaders set
        setattr(reference.cfg, switch, True)
    reference.setup()
    theirs = _eap_scores(reference)
    hm = HookedModel.wrap(model, tokenizer=tok)
    tokens = torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = hm.run_with_hooks(tokens)
    ours = _eap_scores(as_hooked_transformer(hm))
    assert sorted(ours) == sorted(theirs)
    assert {name.rsplit(".", 1)[1] for name in ours} >= {"hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in"}
    edges = 0
    for name, scores in theirs.items():
        torch.testing.assert_close(ours[name], scores, rtol=0, atol=1e-7)  # measured: ≤ 5.6e-9 (scores up to 0.017)
        edges += scores.numel()
    assert edges == 110 and max(s.abs().max() for s in theirs.values()) > 1e-3
    # auto-circuit leaves its patch wrappers in the hook points' places (on TransformerLens too); out of patch mode
    # they pass the values through, and the model computes what it did
    from auto_circuit.types import PatchWrapper

    assert all(isinstance(reduce(getattr, name.split("."), hm), PatchWrapper) for name in ours)
    with torch.no_grad():
        after = hm.run_with_hooks(tokens)
    torch.testing.assert_close(getattr(after, "logits", after), getattr(before, "logits", before), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lensadapters_edge_attribution_equals_auto_circuit_on_transformer_lens(family: str) -> None:
    """``lensadapters.edge_attribution`` (EAP, ``at="clean"``: auto-circuit's convention) on the HookedModel gives
    every edge the score auto-circuit's EAP gives it on TransformerLens with the same weights: auto-circuit's
    ``mask_gradient_prune_scores`` with ``mask_val=0`` is d(-metric)/d(mask) where the mask moves a source from its
    clean to its corrupted output, i.e. (clean - corrupted) . d metric / d input, lensadapters' edge score."""
    from lensadapters.analysis.edge_attribution import edge_attribution
    from lensadapters.testing.tl_reference import hooked_transformer, word_tokenizer

    model = _model(family)
    tok = word_tokenizer(48)
    reference = hooked_transformer(model, tokenizer=tok)
    for switch in ("use_attn_result", "use_split_qkv_input", "use_hook_mlp_in"):
        setattr(reference.cfg, switch, True)
    reference.setup()
    graph: list[Any] = []
    theirs = _eap_scores(reference, graph)
    sources, destinations = graph
    clean, corrupt, answer, wrong = _prompts()
    rows = torch.arange(4)

    def metric(logits: torch.Tensor) -> torch.Tensor:  # auto-circuit's avg_diff on the last position's logits
        last = logits[:, -1]
        return (last[rows, answer] - last[rows, wrong]).mean()

    ours = edge_attribution(HookedModel.wrap(model, tokenizer=tok), clean, corrupt, metric, at="clean", progress=False)
    up = {name: i for i, name in enumerate(ours.upstream)}
    down = {name: i for i, name in enumerate(ours.downstream)}

    def our_name(name: str) -> str:  # auto-circuit's node names -> lensadapters'
        if name == "Resid Start":
            return "embed"
        if name == "Resid End":
            return "logits"
        if name.startswith("MLP "):
            return "M" + name[4:]
        return name[:-1] + name[-1].lower() if name[-2:] in (".Q", ".K", ".V") else name

    compared = 0
    for dest in destinations:
        row = theirs[dest.module_name] if dest.head_idx is None else theirs[dest.module_name][dest.head_idx]
        for src in sources:
            if src.src_idx >= row.shape[-1]:
                continue  # the source comes after the destination: no edge
            ours_score = ours.scores[up[our_name(src.name)], down[our_name(dest.name)]]
            assert ours.valid[up[our_name(src.name)], down[our_name(dest.name)]], (src.name, dest.name)
            # measured: <= 6.5e-9 (scores up to 0.017)
            torch.testing.assert_close(ours_score.float(), row[src.src_idx].float(), rtol=1e-4, atol=1e-7)
            compared += 1
    assert compared == int(ours.valid.sum()) == 110  # every edge of both graphs, one to one
