"""TransformerLens 2.x's ``HookedTransformer`` for a Qwen3 model, for comparisons (needs ``transformer_lens``,
transformers 4.x). Not imported by the plugin itself."""

from lensadapters.testing.tl_compare import converted_by_tl

#: TL's model with an HF model's weights, by TL's own config and weight conversion (``convert_qwen3_weights``)
to_hooked_transformer = converted_by_tl("convert_qwen3_weights")
