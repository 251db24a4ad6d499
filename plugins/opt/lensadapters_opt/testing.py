"""Test kit of lensadapters-opt: the config strategy and the contract class (needs ``lensadapters[testing]``).

``OPTContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check opt``
runs it); the plugin's tests subclass it, and the cross-cutting plugins' matrices put their variants in front
of it. ``opt_configs(**overrides)`` draws tiny ``OPTConfig``s (every keyword a fixed value or a strategy).

Importing ``lensadapters_opt`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from transformers import OPTConfig

import lensadapters_opt
from lensadapters import hf
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["OPTContract", "opt_configs", "non_affine_norms_build"]


@functools.lru_cache(maxsize=None)
def non_affine_norms_build() -> bool:
    """transformers 4.57's OPT ``_init_weights`` crashes on LayerNorms without weights (fixed in 5.x)."""
    from transformers import AutoModelForCausalLM

    sizes = hf.size_fields(vocab=8, hidden=4, layers=1, heads=1, positions=4)
    config = OPTConfig(**sizes, ffn_dim=4, layer_norm_elementwise_affine=False)
    try:
        AutoModelForCausalLM.from_config(config)
    except AttributeError:
        return False
    return True


@st.composite
def opt_configs(
    draw: st.DrawFn,
    pre_ln: Any = None,
    project: Any = None,
    *,
    n_heads: Any = st.integers(1, 4),
    d_head: Any = st.sampled_from([4, 8, 16]),
    d_model: Any = None,
    proj_dim: Any = st.sampled_from([8, 12, 24]),
    n_layers: Any = st.integers(1, 3),
    ffn_dim: Any = st.sampled_from([16, 32, 48]),
    vocab: Any = st.integers(16, 200),
    bias: Any = st.booleans(),
    affine: Any = None,
    act: Any = st.sampled_from(["relu", "gelu", "silu"]),
) -> OPTConfig:
    """Tiny OPT configs: pre-LN (OPT-125m, 1.3b...) and post-LN (OPT-350m), ``project_in``/``project_out``
    (``word_embed_proj_dim != hidden_size``, OPT-350m), biases on and off, LayerNorms with and without
    affine parameters, ReLU / GELU / SiLU, 1-3 layers of 1-4 heads.

    Each keyword is a value or a strategy; ``pre_ln``/``project``/``affine`` ``None`` draw a boolean (``affine``
    only where transformers can build non-affine norms). ``d_model`` fixes ``hidden_size`` (``d_head`` is then
    ignored). ``proj_dim`` is the projected embedding width, moved off ``hidden_size`` when they coincide.
    """
    heads = draw(as_strategy(n_heads), label="n_heads")
    hidden = (
        draw(as_strategy(d_model), label="d_model")
        if d_model is not None
        else heads * draw(as_strategy(d_head), label="d_head")
    )
    project = draw(st.booleans() if project is None else as_strategy(project), label="project")
    proj = draw(as_strategy(proj_dim), label="proj_dim") if project else hidden
    if proj == hidden and project:
        proj = hidden + 4
    pre_ln = draw(st.booleans() if pre_ln is None else as_strategy(pre_ln), label="pre_ln")
    bias = draw(as_strategy(bias), label="bias")
    affine = draw(
        st.booleans()
        if affine is None and non_affine_norms_build()
        else as_strategy(True if affine is None else affine),
        label="affine",
    )
    act = draw(as_strategy(act), label="act")
    if not (pre_ln or bias or affine) and act == "relu":
        # post-LN with a bias-free, homogeneous MLP and no LayerNorm affine is scale invariant: a per-token
        # rescaling of ln1's output (an ln1.hook_scale edit) provably cannot change the logits
        act = "gelu"
    vocab_size = draw(as_strategy(vocab), label="vocab")
    layers = draw(as_strategy(n_layers), label="n_layers")
    sizes = hf.size_fields(hidden=hidden, layers=layers, heads=heads, vocab=vocab_size, positions=32)
    return hf.without_dropout(
        OPTConfig,
        **sizes,
        ffn_dim=draw(as_strategy(ffn_dim), label="ffn_dim"),
        word_embed_proj_dim=proj,
        do_layer_norm_before=pre_ln,
        enable_bias=bias,
        layer_norm_elementwise_affine=affine,
        activation_function=act,
        **lensadapters_opt.OPT_TOKENS,
    )


GENERATION = ("test_generation_with_hooks_matches", "test_edits_during_generation_match_one_pass")


class OPTContract(AdapterContract):
    """Every generic adapter property on tiny OPT models (learned positions with an offset, pre- and post-LN
    blocks, projected embeddings). The OPT-350m shape (post-LN with ``project_in``/``project_out``) is a
    stratum of the generation properties: drawn on every run."""

    plugin = lensadapters_opt
    config_strategy = opt_configs
    config_strata = {"opt-350m": GENERATION}
    stratum_overrides = {"opt-350m": dict(pre_ln=False, project=True)}
    # the LoRA and 8-bit matrices build two models per example: smaller ones, at least two heads
    matrix_overrides = dict(
        n_heads=st.integers(2, 4),
        d_head=8,
        n_layers=st.integers(1, 2),
        ffn_dim=st.sampled_from([16, 24, 48]),
        vocab=st.integers(16, 96),
    )
    aligned_overrides = dict(d_model=64, ffn_dim=128, project=False, n_heads=st.sampled_from([1, 2, 4]))
    learned_positions, rotary, gated_mlp, parallel_blocks = True, False, False, False
    # with project_out, HF's last hidden state is project_out(final norm output); the plugin's tests check it
    final_hidden_is_ln_final = False

    def config_label(self, config: Any) -> Optional[str]:
        projected = config.word_embed_proj_dim != config.hidden_size
        return f"{'pre' if config.do_layer_norm_before else 'post'}-LN" + (", project_in" if projected else "")

    def pre_ln_residual(self, model: torch.nn.Module) -> bool:
        return bool(model.config.do_layer_norm_before)
