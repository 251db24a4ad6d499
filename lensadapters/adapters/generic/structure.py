"""The parts of a decoder-only model found from its structure alone: embedding, decoder layers, unembedding.

Nothing here names an architecture. The rules:

* **embedding**: ``model.get_input_embeddings()``; **unembedding**: ``model.get_output_embeddings()`` (absent for
  a model without a language-model head);
* **decoder layers**: the ``nn.ModuleList`` with ``config.num_hidden_layers`` entries. When several lists have that
  length, the one whose entries are all of a class named in ``model._no_split_modules`` (the classes transformers
  keeps whole on one device: the decoder layers); anything else is ambiguous and refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from lensadapters.errors import UnsupportedModelError

WRITE_A_PLUGIN = "docs/writing-a-plugin.md"


@dataclass(frozen=True)
class Structure:
    """Dotted paths (relative to the Hugging Face model) of the parts every decoder-only model has."""

    embed: str
    layers: str
    unembed: Optional[str]


def module_path(model: nn.Module, module: nn.Module) -> Optional[str]:
    """The qualified name of ``module`` inside ``model`` (``None`` if it is not a submodule)."""
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return None


def _refuse(model: nn.Module, what: str) -> UnsupportedModelError:
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    return UnsupportedModelError(
        f"no lensadapters plugin supports model_type {model_type!r}, and the generic adapter cannot use this "
        f"{type(model).__name__}: {what}. The generic adapter serves decoder-only models built as an embedding, a "
        f"list of decoder layers and an unembedding; for anything else write a plugin (see {WRITE_A_PLUGIN})."
    )


def find_layers(model: nn.Module) -> str:
    """The path of the decoder-layer list (see the module docstring); ``UnsupportedModelError`` when there is none."""
    n = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise _refuse(model, "its config does not say how many decoder layers it has (num_hidden_layers)")
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(lists) > 1:
        no_split = set(getattr(model, "_no_split_modules", None) or ())
        lists = [(name, m) for name, m in lists if all(type(layer).__name__ in no_split for layer in m)]
    if len(lists) != 1:
        found = "no" if not lists else f"{len(lists)} candidate"
        raise _refuse(
            model,
            f"it has {found} module list(s) of its {n} decoder layers (config.num_hidden_layers) "
            f"that the generic adapter can tell apart",
        )
    return lists[0][0]


def find_structure(model: nn.Module) -> Structure:
    """Embedding, decoder layers and unembedding of ``model`` (``UnsupportedModelError`` if they cannot be found)."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise _refuse(model, "it is an encoder-decoder model")
    get_embed = getattr(model, "get_input_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    embed_path = module_path(model, embed) if isinstance(embed, nn.Module) else None
    if not embed_path:
        raise _refuse(model, "get_input_embeddings() gives no module of the model")
    layers = find_layers(model)
    get_unembed = getattr(model, "get_output_embeddings", None)
    unembed = get_unembed() if callable(get_unembed) else None
    unembed_path = module_path(model, unembed) if isinstance(unembed, nn.Module) else None
    return Structure(embed=embed_path, layers=layers, unembed=unembed_path or None)
