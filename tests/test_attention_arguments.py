"""The core's explicit attention (run for hook_attn_scores/hook_pattern) honours every argument a model passes to
transformers' attention interface, or refuses it by name; guessed norm specs are checked, never silently wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from lensadapters import UnsupportedModelError
from lensadapters.attention import IRRELEVANT_ARGUMENTS, default_scores, explicit_attention
from lensadapters.defaults import lensadapters_norm_scale
from lensadapters.hook_point import HookPoint
from lensadapters.testing import AdapterContract, architecture_plugin, assert_close


class Attention(nn.Module):
    is_causal = True


def attend(query, key, value, mask=None, **kwargs):
    scores, pattern = HookPoint("scores", lambda p: None), HookPoint("pattern", lambda p: None)
    seen = {}
    scores.add(lambda t, hook: seen.__setitem__("scores", t.clone()), readonly=True)
    out, pattern_ = explicit_attention(
        Attention(),
        query,
        key,
        value,
        mask,
        scores_fn=lambda m, q, k, s: default_scores(m, q, k, s),
        scores_point=scores,
        pattern_point=pattern,
        **kwargs,
    )
    return out, pattern_, seen["scores"]


def qkv(q_len=5, k_len=5, heads=2):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, heads, q_len, 4, generator=g),
        torch.randn(1, heads, k_len, 4, generator=g),
        torch.randn(1, heads, k_len, 4, generator=g),
    )


def test_unknown_arguments_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'alibi_slopes'.*refuses"):
        attend(*qkv(), alibi_slopes=torch.zeros(2))
    attend(*qkv(), alibi_slopes=None)  # an argument set to None asks for nothing
    attend(*qkv(), **{name: 1 for name in IRRELEVANT_ARGUMENTS})


def test_softcap_applies_before_the_mask_as_eager_does():
    q, k, v = qkv()
    _, pattern, scores = attend(q, k, v, softcap=0.5, scaling=1.0, implementation="eager")
    raw = q @ k.transpose(-1, -2)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(scores[..., causal], (torch.tanh(raw / 0.5) * 0.5)[..., causal])
    assert (scores[..., ~causal] == float("-inf")).all()
    assert_close(pattern.sum(-1), torch.ones(1, 2, 5), "rows sum to 1")


def _eager_with_sinks(query, key, value, mask, sinks, scaling):
    """transformers' eager attention with sinks (an additive float mask), written out independently."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling + mask
    column = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined = torch.cat([weights, column], dim=-1)
    probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(probs, value).transpose(1, 2), probs


def test_attention_sinks_join_the_softmax_and_leave_the_pattern_short_of_one():
    """``s_aux`` (a learned logit per head) joins the softmax as an extra column: the pattern over the real keys is
    eager's bitwise (left padding included, whose rows give everything to the sink) and sums to less than one, the
    missing share being ``exp(sink) / (exp(sink) + sum exp(scores))``; hook_attn_scores has no sink column, and an
    edit there goes through the softmax with the sink."""
    q, k, v = qkv()
    sinks = torch.tensor([0.5, -1.0])
    blocked = ~torch.ones(5, 5, dtype=torch.bool).tril()
    blocked = blocked.expand(1, 1, 5, 5).clone()
    blocked[..., :2] = True  # two left pads: their rows are empty
    mask = torch.zeros(1, 1, 5, 5).masked_fill(blocked, torch.finfo(torch.float32).min)
    out, pattern, scores = attend(q, k, v, mask, s_aux=sinks, scaling=0.5, implementation="eager")
    expected_out, expected = _eager_with_sinks(q, k, v, mask, sinks, 0.5)
    assert torch.equal(pattern, expected) and torch.equal(out, expected_out)
    assert scores.shape == (1, 2, 5, 5) and (scores[..., blocked[0, 0]] == float("-inf")).all()
    assert (pattern[..., :2, :] == 0).all(), "a row without keys gives everything to the sink"
    finite = scores[..., 2:, :].exp().sum(-1)
    sink_share = sinks.exp()[:, None] / (sinks.exp()[:, None] + finite)
    assert_close(1 - pattern[..., 2:, :].sum(-1), sink_share, "the sink takes the rest")
    scale = HookPoint("scores", lambda p: None)
    scale.add(lambda t, hook: t * 2)
    _, edited = explicit_attention(
        Attention(),
        q,
        k,
        v,
        mask,
        scores_fn=default_scores,
        scores_point=scale,
        pattern_point=HookPoint("pattern", lambda p: None),
        s_aux=sinks,
        scaling=0.5,
    )
    _, doubled = _eager_with_sinks(q, k, v, mask, sinks, 1.0)
    assert_close(edited, doubled, "doubled scores, sink unchanged")


def test_softcap_under_sdpa_is_refused_naming_eager():
    with pytest.raises(UnsupportedModelError, match="softcap.*set_attn_implementation\\('eager'\\)"):
        attend(*qkv(), softcap=50.0, implementation="sdpa")


def test_sliding_window_without_a_mask_is_the_model_band():
    """Without a materialized mask (sdpa's causal fast path) the window is applied as transformers' overlay: a query
    at i sees keys j with i - window < j <= i; queries are the last q_len of k_len positions."""
    _, pattern, _ = attend(*qkv(), sliding_window=2)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-2)
    assert ((pattern[0] > 0) == allowed).all()
    _, pattern, _ = attend(*qkv(q_len=1, k_len=5), sliding_window=3)
    assert ((pattern[0, :, 0] > 0) == torch.tensor([False, False, True, True, True])).all()


def test_is_causal_false_without_a_mask_attends_everywhere():
    _, pattern, _ = attend(*qkv(), is_causal=False)
    assert (pattern > 0).all()


class GemmaStyleRMSNorm(nn.Module):
    """A (1 + weight) RMSNorm named like any RMSNorm: the core's guess (x / rms * weight) would be wrong."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) + 0.1)
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class PlainRMSNorm(GemmaStyleRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_a_guessed_norm_spec_that_the_module_contradicts_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"does not compute.*weight_offset=1.0"):
        lensadapters_norm_scale(arch=None, module=GemmaStyleRMSNorm(8))
    spec = lensadapters_norm_scale(arch=None, module=PlainRMSNorm(8))
    assert spec.kind == "RMS" and spec.weight_offset == 0.0 and spec.eps == 1e-6


def test_wrapping_refuses_an_undeclared_norm_that_is_not_the_guess():
    """A Llama whose final norm computes (1 + weight): its plugin does not declare it, the core's guess does not fit
    it, so wrapping fails naming the module (not at the first hook, not with wrong numbers)."""
    info = architecture_plugin("llama")
    if info is None:
        pytest.skip("no installed plugin claims Llama models")
    contract = type("C", (AdapterContract,), {"plugin": info.plugin})()
    config = LlamaConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    )
    model = contract.make_model(config, 0)
    model.model.norm.__class__ = type(
        "OffsetLlamaRMSNorm",
        (type(model.model.norm),),
        {
            "forward": lambda self, x: (
                x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)
            )
        },
    )
    with pytest.raises(UnsupportedModelError, match=r"model\.norm: OffsetLlamaRMSNorm looks like an RMSNorm"):
        contract.wrap(model)
