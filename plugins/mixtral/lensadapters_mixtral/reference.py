"""TransformerLens 2.x's Mixtral on the weights of a transformers Mixtral, for side-by-side comparisons.

``tl_mixtral(model)`` builds a ``HookedTransformer`` offline (no Hub access): the config from the HF config as
TransformerLens' own ``MixtralForCausalLM`` entry does, the weights by TransformerLens' ``convert_mixtral_weights``,
every processing step off (no LayerNorm folding, no centering, no value-bias folding). TransformerLens' conversion
reads transformers 4.x's Mixtral layout (``block_sparse_moe.experts.{e}.w1/w2/w3``), so this needs transformers 4.x
and ``transformer-lens`` 2.x.
"""

from __future__ import annotations

from typing import Any

import torch

from lensadapters import hf
from lensadapters.testing.tl_reference import load_unprocessed


def tl_mixtral(model: Any) -> Any:
    """TransformerLens' ``HookedTransformer`` with ``model``'s weights (float32, no weight processing)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_mixtral_weights

    c = model.config
    if getattr(c, "sliding_window", None) is not None:
        raise ValueError("TransformerLens' Mixtral config uses global attention; compare models without sliding_window")
    params = getattr(c, "rope_parameters", None) or {}
    cfg = HookedTransformerConfig(
        **hf.config_sizes(c),
        act_fn=c.hidden_act,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_base=params.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
        eps=c.rms_norm_eps,
        n_key_value_heads=c.num_key_value_heads,
        gated_mlp=True,
        use_local_attn=False,
        rotary_dim=hf.head_dim(c),
        num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok,
        final_rms=True,
        original_architecture="MixtralForCausalLM",
        device="cpu",
        dtype=torch.float32,
    )
    tl = HookedTransformer(cfg, tokenizer=None, move_to_device=False)
    return load_unprocessed(tl, convert_mixtral_weights(model, cfg))
