"""Tools built on TransformerLens, run unmodified on a HookedModel and on TransformerLens with the same weights.

Each test needs its tool installed and is skipped otherwise. sae-dashboard 0.8 declares ``transformers<4.57``, so it is
installed without its dependencies in its own environment (``scripts/setup-tl-clients.sh``; the README's "Tools that
run on lensadapters" gives the recipe)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lensadapters import HookedModel

sae_lens = pytest.importorskip("sae_lens")
pytest.importorskip("sae_dashboard")


def _models() -> tuple[Any, Any, Any]:
    from transformers import LlamaForCausalLM

    from lensadapters.testing.tl_reference import hooked_transformer, word_tokenizer

    torch.manual_seed(0)
    from lensadapters.testing.tiny_models import CLIENT_LLAMA, gqa_llama

    config = gqa_llama(**CLIENT_LLAMA)
    model = LlamaForCausalLM(config).eval()
    tok = word_tokenizer(config.vocab_size)
    reference = hooked_transformer(model, tokenizer=tok)
    hst = sae_lens.HookedSAETransformer(reference.cfg, tokenizer=tok, move_to_device=False)
    hst.load_state_dict(reference.state_dict())
    hst.eval()
    return model, tok, hst


def _sae(hook: str, d_in: int, **cfg: Any) -> Any:
    from sae_lens.saes.sae import SAEMetadata

    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(d_in=d_in, d_sae=24, metadata=SAEMetadata(hook_name=hook), **cfg)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sae


def _numbers(x: Any, out: list[float]) -> list[float]:
    """Every number in a (nested) sae-dashboard data object, in a fixed order."""
    if isinstance(x, torch.Tensor):
        out.extend(float(v) for v in x.flatten().tolist())
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        out.append(float(x))
    elif isinstance(x, dict):
        for key in sorted(x, key=str):
            _numbers(x[key], out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _numbers(v, out)
    elif hasattr(x, "__dict__"):
        _numbers(vars(x), out)
    return out


def _assert_same(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs) and len(ours) > 1000
    a = torch.tensor([0.0 if math.isnan(v) else v for v in ours], dtype=torch.float64)
    b = torch.tensor([0.0 if math.isnan(v) else v for v in theirs], dtype=torch.float64)
    assert [math.isnan(v) for v in ours] == [math.isnan(v) for v in theirs]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-4)  # float32 rounding of TransformerLens' other op order


@pytest.mark.parametrize(
    ("hook", "cfg"), [("blocks.0.hook_resid_post", {}), ("blocks.1.attn.hook_z", {"reshape_activations": "hook_z"})]
)
def test_sae_dashboard_feature_and_prompt_views_equal_transformer_lens(hook: str, cfg: dict) -> None:
    from sae_dashboard.data_parsing_fns import get_prompt_data
    from sae_dashboard.sae_vis_data import SaeVisConfig
    from sae_dashboard.sae_vis_runner import SaeVisRunner

    from lensadapters.integrations.transformer_lens import as_hooked_transformer

    model, tok, hst = _models()
    hm = HookedModel.wrap(model, tokenizer=tok)
    tokens = torch.randint(3, 48, (32, 16), generator=torch.Generator().manual_seed(1))
    prompt = tok.decode([5, 9, 13, 7, 21, 4])
    results = []
    for client_model in (hst, as_hooked_transformer(hm, base=sae_lens.HookedSAETransformer), hm):
        vis_cfg = SaeVisConfig(hook_point=hook, features=list(range(8)), minibatch_size_features=8)
        data = SaeVisRunner(vis_cfg).run(encoder=_sae(hook, 32, **cfg), model=client_model, tokens=tokens)
        numbers = _numbers(data.feature_data_dict, [])
        if client_model is not hm:
            # the prompt view asserts isinstance(model, HookedTransformer), which the view passes; sae-dashboard 0.8's
            # get_prompt_data then unpacks its own wrapper's dict as a pair, and fails so on TransformerLens too
            with pytest.raises(ValueError, match="not enough values to unpack"):
                get_prompt_data(data, prompt, num_top_features=4)
        results.append(numbers)
    _assert_same(results[1], results[0])
    _assert_same(results[2], results[0])
    hm.unwrap()
