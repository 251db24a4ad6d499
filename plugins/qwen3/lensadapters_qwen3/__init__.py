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

Also the language model of ``Qwen3VLForConditionalGeneration`` (``vision_language``; its rotary points read the
(cos, sin) the model computes from its 3-D multimodal positions, the sections interleaved). **Deepstack**: the
vision tower also projects the hidden states of some of its blocks (``visual.deepstack_merger_list[j]``), and the
language model adds the ``j``-th of them to the image tokens' hidden states right after its layer ``j`` (outside
the layer, in the text model's forward). So at the image positions ``blocks.{j}.hook_resid_post`` (the layer's
output) is not ``blocks.{j+1}.hook_resid_pre`` (what the next layer reads): the difference is
``vision_projector.deepstack.{j}.hook_out`` ``[image tokens, d_model]``, the added features (firing in the vision
tower, before ``vision_projector.hook_in``; an edit changes what is added). Transformers 4.x adds them in place
into the layer's output: while ``blocks.{j}.hook_resid_post`` is hooked the model is handed a copy, so the point
keeps the layer's output.

Refused at wrap time (the family's declaration): rope types other than rotate-half ones, custom code registered as
``qwen3``, other layouts. Flash and flex attention serve every hook point but the pattern ones.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lensadapters import Architecture, hf, hookimpl
from lensadapters.plugin_api import Hooked, OutputSite, first_output, replace_first_output

__version__ = "0.1.0"
# q_proj -> q_norm (per head) -> k_proj -> k_norm -> v_proj, then RoPE on the normed queries and keys
FAMILY = hf.DecoderFamily.named(
    "Qwen3",
    "qwen3",
    qk_norms=hf.qk_norms("bphd"),
    packages=("qwen3", "qwen3_vl"),
    norms=("Qwen3RMSNorm", "Qwen3VLTextRMSNorm"),
    multimodal_rotary=True,  # the language model of Qwen3-VL
)
ARCH = FAMILY.architecture(
    "Qwen3 (Qwen3ForCausalLM, Qwen3Model): per-head q/k norms before RoPE, sliding windows, GQA; the language model "
    "of Qwen3VLForConditionalGeneration (interleaved multimodal RoPE, deepstack visual features)",
    model_types=("qwen3", "qwen3_vl_text", "qwen3_vl"),
    vision_language=True,
)


def tiny_config(seed: int) -> Any:
    """A Qwen3-like toy, width 64, vocabulary 512, head_dim 32 (Qwen3's head_dim differs from width / heads). Seed
    0 is the demo's model: 2 layers, GQA (4 query heads, 2 kv heads), tied embeddings, no window. Other seeds vary
    depth, heads, a sliding window on the layers from ``max_window_layers`` on and the embedding tie."""
    from transformers import Qwen3Config

    layers, (heads, kv), window_from, tied = hf.toy_draw(
        seed, (2, (4, 2), 9, True), [1, 2, 3], [(4, 2), (4, 4), (4, 1), (8, 2)], [0, 1, 9], 0.5
    )
    windows = hf.window_from_fields(4, window_from, layers)
    return hf.toy_config(
        Qwen3Config, layers, heads, kv, head_dim=32, **windows, tie_word_embeddings=tied, rope_theta=10000.0
    )


def config_fields(model: Any) -> dict[str, Any]:
    return {
        **hf.window_fields(hf.layer_windows(hf.text_config(model))),
        "extra": {"use_qk_norm": True, "attention_bias": bool(getattr(hf.text_config(model), "attention_bias", False))},
    }


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields).export(globals())

#: the points of the deepstack features, one per vision block the tower projects (``j``: the language model's layer
#: after which they are added)
DEEPSTACK_POINT = "vision_projector.deepstack.{}.hook_out"


class _LayerOutputSite(OutputSite):
    """``hook_resid_post`` of a layer whose output the model then changes in place (transformers 4.x adds the
    deepstack features into it): the model gets a copy of the point's value, which keeps the layer's output."""

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value, _ = self.point.apply(first_output(output))
        return replace_first_output(output, value.clone())


def _deepstack_mergers(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        mergers = getattr(module, "deepstack_merger_list", None)
        if isinstance(mergers, nn.ModuleList):
            return list(mergers)
    return []


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Hooked) -> list[Any]:
    sites: list[Any] = []
    for j, merger in enumerate(_deepstack_mergers(hooked.hf_model)):
        point = hooked.new_point(DEEPSTACK_POINT.format(j), before="vision_projector.hook_in")
        point.fires_when = "in a forward with images (pixel_values)"
        sites.append(OutputSite(merger, point))
        post = f"blocks.{j}.hook_resid_post"
        if j < len(hooked.block_modules):
            sites.append(_LayerOutputSite(hooked.block_modules[j], hooked.claim_point(post)))
    return sites
