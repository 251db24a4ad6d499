"""The generic adapter: TransformerLens hook points for a decoder-only model that no plugin describes.

It is part of the core and names no architecture. The registry selects it when no installed plugin claims a
model's ``model_type`` (with a :class:`GenericAdapterWarning` that lists the points the model gets, why others
are absent, and how to write a plugin), or when ``HookedModel.wrap(model, adapter="generic")`` asks for it; a
``model_type`` that a plugin claims is never handled generically otherwise.

What it serves, and the rules that decide it for each model (:mod:`.identify`, from the model's structure
(:mod:`.structure`) and one probe forward pass (:mod:`.probe`)):

* ``hook_embed`` (times a constant the model multiplies the embeddings by), ``blocks.{i}.hook_resid_pre`` /
  ``hook_resid_post`` (the decoder layers' input and output, where the model continues with each layer's output);
* ``blocks.{i}.hook_attn_out`` / ``hook_mlp_out`` where the layer's attention and MLP modules are identified and the
  layer's output is exactly its input plus their outputs;
* ``blocks.{i}.attn.hook_z`` where the layer calls transformers' attention interface (the attention function's
  output), and ``attn.hook_attn_scores`` / ``hook_pattern`` where the core's explicit attention reproduces the
  model's own eager attention on that call;
* ``ln_final.hook_normalized`` where the module producing the last hidden state is a LayerNorm or an RMSNorm;
* weights ``W_E`` and ``W_U`` (times a constant logit scale, so that ``final @ W_U`` is the logits), where the probe
  verified them; the other accessors raise an error that points at plugin authoring.

Points it cannot identify for a model are absent from ``hook_names``, never approximated.
"""

from lensadapters.adapters.generic.identify import Findings, identify
from lensadapters.adapters.generic.plugin import ARCH, NAME, GenericAdapterWarning, findings, summary

__all__ = ["ARCH", "NAME", "Findings", "GenericAdapterWarning", "findings", "identify", "summary"]
