"""The user API: :class:`~lensadapters.api.hooked_model.HookedModel` and the TransformerLens conventions on it.

``hooked_model`` (wrap, hooks, ``run_with_cache``), ``tl_api``/``tl_call`` (TransformerLens' methods and call
conventions), ``tokens`` (tokenizer methods), ``hook_namespace`` (``hm.blocks[0].attn.hook_z``), ``arguments``
(argument checks), ``saes`` (``HookedSAETransformer``'s SAE methods). Built on the analysis layer below it.
"""
