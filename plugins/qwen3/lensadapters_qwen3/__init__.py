"""Qwen3 (``model_type: "qwen3"``: Qwen3 0.6B-32B dense checkpoints) for lensadapters.

Quirks handled (otherwise Llama's layout: GQA, rotate-half RoPE, RMSNorm, SwiGLU):

* Per-head RMSNorm on queries and keys between projection and RoPE (``q_norm``/``k_norm``), with
  TransformerLens' hook points ``attn.q_norm.hook_scale``/``hook_normalized`` and ``attn.k_norm.*`` (editable
  like every norm): ``hook_q``/``hook_k`` are the projection output (before the norm), ``hook_rot_q``/
  ``hook_rot_k`` what attention uses (normed and rotated; an edit of ``hook_rot_k`` reaches the KV cache). The
  norm points keep lensadapters' per-head layout ``[b, p, h, 1]``/``[b, p, h, d_head]`` where TransformerLens
  flattens them to ``[b*p*h, ...]`` (the same values, in the same order).
* Optional ``attention_bias`` on q/k/v/o; tied (the small checkpoints) or untied embeddings.
* Sliding windows on the layers ``config.layer_types`` marks (``use_sliding_window`` from ``max_window_layers``
  on): the pattern points show each layer's own mask; ``cfg.window_size``/``cfg.attn_types`` name them as
  TransformerLens does.

Refused at wrap time (the family's declaration): rope types other than rotate-half ones, custom code registered as
``qwen3``, other layouts. Flash and flex attention serve every hook point but the pattern ones.
"""

from __future__ import annotations

from typing import Any

from lensadapters import hf

__version__ = "0.1.0"
# q_proj -> q_norm (per head) -> k_proj -> k_norm -> v_proj, then RoPE on the normed queries and keys
FAMILY = hf.DecoderFamily.named("Qwen3", "qwen3", qk_norms=hf.qk_norms("bphd"))
ARCH = FAMILY.architecture("Qwen3 (Qwen3ForCausalLM, Qwen3Model): per-head q/k norms before RoPE, sliding windows, GQA")


def tiny_config(seed: int) -> Any:
    """A Qwen3-like toy, width 64, vocabulary 512, head_dim 32 (Qwen3's head_dim differs from width / heads). Seed
    0 is the demo's model: 2 layers, GQA (4 query heads, 2 kv heads), tied embeddings, no window. Other seeds vary
    depth, heads, a sliding window on the layers from ``max_window_layers`` on and the embedding tie."""
    from transformers import Qwen3Config

    layers, (heads, kv), window_from, tied = hf.toy_draw(
        seed, (2, (4, 2), 9, True), [1, 2, 3], [(4, 2), (4, 4), (4, 1), (8, 2)], [0, 1, 9], 0.5
    )
    return hf.toy_config(
        Qwen3Config,
        layers,
        heads,
        kv,
        head_dim=32,
        sliding_window=4,
        use_sliding_window=window_from < layers,
        max_window_layers=window_from,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
    )


def config_fields(model: Any) -> dict[str, Any]:
    return {
        **hf.window_fields(hf.layer_windows(model.config)),
        "extra": {"use_qk_norm": True, "attention_bias": bool(getattr(model.config, "attention_bias", False))},
    }


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields).export(globals())
