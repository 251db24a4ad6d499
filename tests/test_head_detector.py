"""detect_head: the detection patterns, and heads found where a hooked pattern puts them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.head_detector import (
    detect_head,
    get_duplicate_token_head_detection_pattern,
    get_induction_head_detection_pattern,
    get_previous_token_head_detection_pattern,
)
from lensadapters.testing import attention_layers, is_causal
from lensadapters.testing.tiny_models import ARCH_NAMES, first_causal, tiny

TOKENS = torch.tensor([[5, 6, 7, 5, 6, 7]])


def test_detection_patterns() -> None:
    previous = get_previous_token_head_detection_pattern(TOKENS)
    assert torch.equal(previous, torch.diag(torch.ones(5), -1))
    duplicate = get_duplicate_token_head_detection_pattern(TOKENS)
    expected = torch.zeros(6, 6)
    expected[3, 0] = expected[4, 1] = expected[5, 2] = 1
    assert torch.equal(duplicate, expected)
    induction = get_induction_head_detection_pattern(TOKENS)
    expected = torch.zeros(6, 6)
    expected[3, 1] = expected[4, 2] = expected[5, 3] = 1  # the token after the earlier copy
    assert torch.equal(induction, expected)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_head_made_to_attend_to_the_previous_token_scores_one(arch: str) -> None:
    hm = HookedModel.wrap(tiny(arch))
    layers = attention_layers(hm)
    target = (layers[-1], hm.cfg.n_heads - 1)
    previous = get_previous_token_head_detection_pattern(TOKENS)
    previous[0, 0] = 1  # the first position can only attend to itself

    def force(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
        pattern = pattern.clone()
        pattern[:, target[1]] = previous
        return pattern

    hm.add_hook(f"blocks.{target[0]}.attn.hook_pattern", force)
    scores = detect_head(hm, TOKENS, "previous_token_head")
    assert scores.shape == (hm.cfg.n_layers, hm.cfg.n_heads)
    assert scores[target] == pytest.approx(1 - 1 / 6, abs=1e-6)  # all but the first row's mass
    assert scores.argmax() == target[0] * hm.cfg.n_heads + target[1]
    assert detect_head(hm, TOKENS, "previous_token_head", exclude_bos=True)[target] == pytest.approx(1.0)
    if is_causal(hm):
        abs_score = detect_head(hm, TOKENS, "previous_token_head", error_measure="abs")[target]
    else:  # "abs" scores causal patterns only (as TransformerLens): an encoder's other heads attend to later tokens
        with pytest.raises(ValueError, match="not lower triangular"):
            detect_head(hm, TOKENS, "previous_token_head", error_measure="abs")
        abs_score = detect_head(hm, TOKENS, "previous_token_head", heads=[target], error_measure="abs")[target]
    assert abs_score == pytest.approx(1 - round(1 / 6, 3), abs=1e-6)  # only position 0 deviates (by 1)
    only = detect_head(hm, TOKENS, "previous_token_head", heads=[target])
    assert only[target] == scores[target] and (only == -1).sum() == only.numel() - 1
    others = [i for i in range(hm.cfg.n_layers) if i not in layers]  # blocks with another token mixer: no heads
    assert (scores[others] == -1).all() and (scores[layers] != -1).all()
    if others:
        with pytest.raises(ValueError, match=rf"blocks \[{others[0]}\] have no attention pattern"):
            detect_head(hm, TOKENS, "previous_token_head", heads=[(others[0], 0)])
    hm.reset_hooks(including_permanent=True)
    hm.unwrap()


def test_a_given_cache_is_not_modified_and_bad_inputs_are_refused() -> None:
    hm = HookedModel.wrap(tiny(first_causal()))
    _, cache = hm.run_with_cache(TOKENS, remove_batch_dim=True)
    before = cache["pattern", 0].clone()
    detect_head(hm, TOKENS, "induction_head", cache=cache, exclude_bos=True, exclude_current_token=True)
    assert torch.equal(cache["pattern", 0], before)
    with pytest.raises(ValueError, match="detection_pattern"):
        detect_head(hm, TOKENS, "copying_head")
    with pytest.raises(ValueError, match="lower triangular"):
        detect_head(hm, TOKENS, torch.ones(6, 6))
    with pytest.raises(ValueError, match="more than one token"):
        detect_head(hm, TOKENS[:, :1], "previous_token_head")
    hm.unwrap()
