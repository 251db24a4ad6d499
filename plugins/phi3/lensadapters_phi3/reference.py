"""TransformerLens 2.x's ``HookedTransformer`` for a Phi3 model, for comparisons (needs ``transformer_lens``,
transformers 4.x). Not imported by the plugin itself."""

from __future__ import annotations

from typing import Any


def to_hooked_transformer(hf_model: Any) -> Any:
    """TL's model with ``hf_model``'s weights: TL's own config conversion (``convert_hf_model_config``) and weight
    conversion (``convert_phi3_weights``), no weight processing. ``n_ctx`` is the HF model's (TL caps it at 2048
    for memory)."""
    from transformer_lens.pretrained.weight_conversions import convert_phi3_weights

    from lensadapters.testing.tl_compare import hooked_transformer, tl_config_from_hf

    fields = tl_config_from_hf(hf_model)
    fields["n_ctx"] = hf_model.config.max_position_embeddings
    return hooked_transformer(hf_model, convert_phi3_weights, fields)
