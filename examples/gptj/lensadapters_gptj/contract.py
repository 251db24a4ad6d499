"""The contract suite for GPT-J (``lensadapters check gptj`` runs it; so does ``tests/test_gptj.py``).

Importing this module needs the test kit: ``pip install lensadapters-gptj[testing]``.
"""

from __future__ import annotations

from hypothesis import strategies as st
from transformers import GPTJConfig

import lensadapters_gptj
from lensadapters import hf
from lensadapters.testing import AdapterContract


@st.composite
def gptj_configs(draw: st.DrawFn) -> GPTJConfig:
    """Tiny GPT-J configs: minimal, partial and full rotary, 1-2 layers."""
    n_head = draw(st.sampled_from([1, 2, 4]))
    d_head = draw(st.sampled_from([4, 8, 16]))
    # rotary_dim=None (rotate everything) is refused by transformers 5 and, in 4.57, builds a sin/cos table
    # n_embd wide that only fits one head: rotary_dim=d_head is the working spelling of full rotary
    rotary_dim = draw(st.sampled_from([2, d_head // 2, d_head]))
    return hf.without_dropout(
        GPTJConfig,
        n_layer=draw(st.integers(1, 2)),
        n_head=n_head,
        n_embd=n_head * d_head,
        rotary_dim=rotary_dim,
        n_inner=draw(st.sampled_from([None, 24, 48])),
        vocab_size=draw(st.integers(16, 160)),
        n_positions=32,
        activation_function=draw(st.sampled_from(["gelu_new", "gelu", "relu", "silu"])),
        layer_norm_epsilon=draw(st.sampled_from([1e-5, 1e-3])),
        tie_word_embeddings=draw(st.booleans()),
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


class GPTJContract(AdapterContract):
    """Every generic adapter property, on tiny GPT-J models (eager attention; from transformers 5.24, which gives
    GPT-J the attention interface, sdpa and eager).

    Declared capabilities: rotary embeddings (``hook_rot_q``/``hook_rot_k`` in every block), parallel blocks
    (no ``hook_resid_mid``), no learned position table, no gated MLP.
    """

    plugin = lensadapters_gptj
    config_strategy = gptj_configs
    attn_implementations = ("eager",) if lensadapters_gptj._own_attention() else ("sdpa", "eager")
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, False, True
