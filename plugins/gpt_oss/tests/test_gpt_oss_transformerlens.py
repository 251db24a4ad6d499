"""GPT-OSS against TransformerLens 2.18's own GPT-OSS (``HookedTransformer`` with its ``GptOssMoE``, its config
entry and weight conversion, no weight processing) on the same weights. Runs where ``transformer_lens`` imports (the
transformers 4.57 environment).

TransformerLens 2.18 has no attention sinks, no sliding window (``use_local_attn=False``) and no YaRN (its rotary
base only), and hard-codes the SwiGLU limit 7.0 and gain 1.702: on a model where none of these changes anything
(sinks at ``-inf``, full attention, default RoPE) every hook point both have and every edit agree; with the model's
own sinks and windows TransformerLens computes another model (its patterns sum to one and attend outside the
window), which lensadapters does not (it is HF eager's, tested in ``test_gpt_oss.py``). TransformerLens' routing
points are flattened to ``[b*p, ...]``; it has no router-logits, routing-weights or expert-result point, and an
edit of its expert indices reads the new expert's (zero) probability where lensadapters keeps each slot's weight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lensadapters_gpt_oss.testing import GptOssContract, gpt_oss_config

from lensadapters.testing.contract_support import perturb
from lensadapters.testing.tl_compare import transformer_lens_available

pytestmark = pytest.mark.skipif(not transformer_lens_available(), reason="transformer_lens is not installed")

CONTRACT = GptOssContract()
FULL = ["full_attention", "full_attention"]


def pair(sinks: bool = False, **overrides: Any) -> tuple[Any, Any, Any]:
    """``(HF model, wrapped model, TL's model)``; without ``sinks`` every head's sink logit is ``-inf``."""
    from lensadapters_gpt_oss.reference import tl_gpt_oss

    fields = {**dict(layers=2, layer_types=FULL, rope="default", experts=4, top_k=2, limit=7.0), **overrides}
    model = CONTRACT.make_model(gpt_oss_config(**fields), 0)
    if not sinks:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))
    return model, CONTRACT.wrap(model), tl_gpt_oss(model)


def tokens() -> torch.Tensor:
    return torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def shared_names(hm: Any, tl: Any) -> list[str]:
    return [n for n in hm.hook_names if n in tl.hook_dict and not n.endswith("_input")]


def test_every_shared_point_and_edit_agrees_where_transformerlens_computes_the_same_model() -> None:
    """Sinks at -inf, full attention, default RoPE: every point both have holds the same value (TL's flattened
    routing points reshaped; TL's per-expert points fire only for experts with tokens), the logits agree, and the
    same edit at every shared point (expert indices aside: their semantics differ, see the module docstring) gives
    the same logits."""
    _, hm, tl = pair()
    ids = tokens()
    names = shared_names(hm, tl)
    with torch.no_grad():
        logits, ours = hm.run_with_cache(ids, names_filter=names)
        tl_logits, theirs = tl.run_with_cache(ids, names_filter=names)
    compared = {}
    for name in names:
        if name not in theirs.cache_dict:
            assert ours[name].numel() == 0, f"{name}: TL did not fire where lensadapters has rows"
            continue
        value = theirs[name].reshape(ours[name].shape)
        if name.endswith("hook_expert_indices"):
            assert torch.equal(value, ours[name])
            continue
        compared[name] = (ours[name].double() - value.double()).nan_to_num(posinf=0, neginf=0).abs().max().item()
    assert len(compared) > 60 and max(compared.values()) < 2e-4, sorted(compared.items(), key=lambda kv: -kv[1])[:3]
    assert (logits - tl_logits).abs().max() < 2e-4
    for name in names:
        if name.endswith("hook_expert_indices") or name not in theirs.cache_dict:
            continue

        def edit(t: torch.Tensor, hook: Any, name: str = name) -> torch.Tensor:
            shape = ours[name].shape
            return perturb(t.reshape(shape), type("H", (), {"name": name})()).reshape(t.shape)

        with torch.no_grad():
            edited = hm.run_with_hooks(ids, fwd_hooks=[(name, edit)])
            tl_edited = tl.run_with_hooks(ids, fwd_hooks=[(name, edit)])
        assert (edited - tl_edited).abs().max() < 2e-4 * max(1.0, edited.abs().max().item()), name
    hm.unwrap()


def test_transformerlens_has_no_sinks_or_windows() -> None:
    """With the model's sinks TL's patterns sum to one (lensadapters': less, as HF's) and its logits are not the
    model's; with a sliding layer TL attends outside the window. lensadapters' logits are the model's either way."""
    model, hm, tl = pair(sinks=True, layer_types=["sliding_attention", "full_attention"], window=3)
    ids = tokens()
    name = "blocks.0.attn.hook_pattern"
    with torch.no_grad():
        reference = model(ids).logits
        logits, ours = hm.run_with_cache(ids, names_filter=[name])
        tl_logits, theirs = tl.run_with_cache(ids, names_filter=[name])
    assert torch.equal(logits, reference)
    assert (ours[name].sum(-1) < 1 - 1e-3).all()
    assert torch.allclose(theirs[name].sum(-1), torch.ones(2, 4, 9))
    assert theirs[name][..., 8, 0].min() > 0 and (ours[name][..., 8, :6] == 0).all(), "TL attends outside the window"
    assert (tl_logits - reference).abs().max() > 1e-3
    hm.unwrap()
