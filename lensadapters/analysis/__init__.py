"""Analysis: what TransformerLens computes from caches and weights.

``cache`` (:class:`~lensadapters.analysis.cache.ActivationCache`) and ``cache_analysis`` (its decompositions),
``circuits`` (``OV``/``QK`` and composition scores), ``factored_matrix``, ``patching`` (activation patching
sweeps), ``attribution`` and ``edge_attribution`` (attribution patching, EAP and EAP-IG: every component's or edge's
patching effect from one backward), ``head_detector`` and ``utils`` (TransformerLens' helper functions). Reads a
model through :mod:`lensadapters.wiring` (weights) and the model-facing protocols; never imports the user API above
it.
"""
