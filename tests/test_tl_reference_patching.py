"""The analysis layer against TransformerLens 2.x on the same weights: the activation-patching sweeps, head
detection, circuits (``FactoredMatrix`` and the weights it is made of), ``get_act_name``. Skipped where
TransformerLens is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lensadapters import patching as la_patching
from lensadapters import utils as la_utils
from lensadapters.head_detector import detect_head
from lensadapters.testing.tl_analysis import (
    HEAVY,
    MODEL_TYPES,
    SETTINGS,
    check,
    draw_tokens,
    each_model_type,
    needs_transformer_lens,
    pair,
    quiet,
    tokenizer,
)

pytestmark = needs_transformer_lens


# --- patching, head detection, circuits --------------------------------------------------------------------

_SWEEPS = [name for name in la_patching.__all__ if name.startswith("get_act_patch_")]
_GROUPS = 3  # every sweep in every run, a third of them per test


@pytest.mark.parametrize("group", range(_GROUPS))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
@HEAVY
@given(data=st.data())
def test_patching_matches(model_type: str, group: int, data: st.DataObject) -> None:
    import transformer_lens.patching as tl_patching

    with pair(data, model_type) as (hm, tl):
        length = data.draw(st.integers(2, 4), label="length")
        clean = torch.randint(3, hm.cfg.d_vocab, (1, length), generator=torch.Generator().manual_seed(length))
        corrupted = clean.clone()
        corrupted[0, 0] = (clean[0, 0] + 1) % hm.cfg.d_vocab
        _, ours = hm.run_with_cache(clean)
        _, theirs = tl.run_with_cache(clean)
        answer, other = int(clean[0, -1]), int(corrupted[0, 0])

        def metric(logits: torch.Tensor) -> torch.Tensor:
            return logits[0, -1, answer] - logits[0, -1, other]

        for name in _SWEEPS[group::_GROUPS]:
            if hm.cfg.parallel_attn_mlp and name.endswith("resid_mid"):
                continue  # parallel blocks have no resid_mid (in either library)
            a = quiet(getattr(la_patching, name), hm, corrupted, ours, metric)
            b = quiet(getattr(tl_patching, name), tl, corrupted, theirs, metric)
            assert a.shape == b.shape, name
            check(a, b, name)
        if group:
            return
        rows = [[0, 0], [hm.cfg.n_layers - 1, length - 1]]
        a = quiet(
            la_patching.generic_activation_patch,
            hm,
            corrupted,
            ours,
            metric,
            la_patching.layer_pos_patch_setter,
            "resid_pre",
            index_df=rows,
        )
        pandas = pytest.importorskip("pandas")
        b = quiet(
            tl_patching.generic_activation_patch,
            tl,
            corrupted,
            theirs,
            metric,
            tl_patching.layer_pos_patch_setter,
            "resid_pre",
            index_df=pandas.DataFrame(rows, columns=["layer", "pos"]),
        )
        check(a, b, "generic_activation_patch(index_df=...)")


@each_model_type
def test_detect_head_matches(model_type: str, data: st.DataObject) -> None:
    from transformer_lens.head_detector import detect_head as tl_detect_head

    tok = tokenizer(40)
    with pair(data, model_type, tokenizer=tok) as (hm, tl):
        if hm.cfg.d_vocab < 40:
            return
        words = data.draw(st.lists(st.integers(3, 39), min_size=2, max_size=5), label="words")
        text = " ".join(f"w{i}" for i in words * 2)
        pattern = data.draw(st.sampled_from(["previous_token_head", "duplicate_token_head", "induction_head"]))
        kw = dict(
            exclude_bos=data.draw(st.booleans(), label="exclude_bos"),
            exclude_current_token=data.draw(st.booleans(), label="exclude_current_token"),
            error_measure=data.draw(st.sampled_from(["mul", "abs"]), label="error_measure"),
        )
        heads = data.draw(st.sampled_from([None, [(0, 0), (hm.cfg.n_layers - 1, 1)]]), label="heads")
        check(
            detect_head(hm, text, pattern, heads, **kw),
            quiet(tl_detect_head, tl, text, pattern, heads, **kw),
            f"detect_head {pattern}",
        )


@each_model_type
def test_circuits_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type, max_layers=3) as (hm, tl), torch.no_grad():
        for name in ("OV", "QK"):
            ours, theirs = getattr(hm, name), getattr(tl, name)
            assert ours.shape == theirs.shape
            check(ours.AB, theirs.AB, f"{name}.AB")
            check(ours.S, theirs.S, f"{name}.S")
            check(ours.norm(), theirs.norm(), f"{name}.norm()")
        for mode in "QKV":
            check(hm.all_composition_scores(mode), tl.all_composition_scores(mode), f"composition {mode}")
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        check(
            hm.tokens_to_residual_directions(tokens),
            tl.tokens_to_residual_directions(tokens),
            "tokens_to_residual_directions",
        )
        check(
            hm.tokens_to_residual_directions(int(tokens[0, 0])),
            tl.tokens_to_residual_directions(int(tokens[0, 0])),
            "one token's direction",
        )
        for layer in range(hm.cfg.n_layers + 1):
            for mlp_input in [False, True] if layer < hm.cfg.n_layers else [False]:
                for mlp_biases in (False, True):
                    check(
                        hm.accumulated_bias(layer, mlp_input, mlp_biases),
                        tl.accumulated_bias(layer, mlp_input, mlp_biases),
                        "accumulated_bias",
                    )
        assert hm.all_head_labels() == tl.all_head_labels()


@SETTINGS
@given(
    name=st.sampled_from(
        [
            "resid_pre",
            "k",
            "q",
            "v",
            "z",
            "pattern",
            "attn",
            "attn_scores",
            "attn_logits",
            "key",
            "query",
            "value",
            "mlp_pre",
            "mlp_post",
            "pre",
            "post",
            "scale",
            "normalized",
            "resid_mid",
            "mlp_out",
            "attn_out",
            "result",
            "rot_k",
            "q_input",
            "attn_in",
            "pre_linear",
            "embed",
            "blocks.3.hook_resid_pre",
            "hook_embed",
        ]
    ),
    layer=st.one_of(st.none(), st.integers(0, 30)),
    layer_type=st.sampled_from([None, "a", "m", "b", "block", "blocks", "attention", "ln1", "ln2", "mlp", "attn"]),
    fused=st.booleans(),
)
def test_get_act_name_matches(name: str, layer: Any, layer_type: Any, fused: bool) -> None:
    from transformer_lens.utils import get_act_name as tl_get_act_name

    if fused and layer is not None and "." not in name:  # "k6", "scale4ln1": layer (and type) written into the name
        text = f"{name}{layer}{layer_type or ''}"
        assert la_utils.get_act_name(text) == tl_get_act_name(text)
    else:
        assert la_utils.get_act_name(name, layer, layer_type) == tl_get_act_name(name, layer, layer_type)
