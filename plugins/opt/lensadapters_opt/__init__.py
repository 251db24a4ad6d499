"""OPT for lensadapters (``OPTForCausalLM``, ``OPTModel``; transformers 4.57 and 5.x).

Quirks handled:

* **Learned positions with an offset of 2 rows**, derived from the attention mask
  (``cumsum(mask) * mask - 1``): left padding shifts the positions of every row, and pad tokens read
  row ``1`` of the table (position ``-1``). ``hook_pos_embed`` is ``embed_positions``' output, shown
  as ``[b, p, d_model]`` (expanded when the model broadcasts one row of user ``position_ids``);
  ``W_pos`` excludes the two offset rows, so a real token at position ``t`` has
  ``hook_pos_embed == W_pos[t]``.
* **Unscaled queries**: OPT multiplies ``q_proj``'s output by ``scaling = d_head ** -0.5`` *before*
  the attention call (in ``OPTAttention.forward``, in 4.57 and 5.x alike) and calls the attention
  function with ``scaling=1.0``. ``hook_q`` is ``q_proj``'s output (unscaled, TransformerLens'
  ``hook_q``); ``hook_attn_scores`` is ``(q * scaling) @ k^T`` exactly as HF computes it.
* **No MLP module**: ``fc1`` → ``activation_fn`` → ``fc2`` live in the decoder layer. ``mlp.hook_pre``
  is ``fc1``'s output, ``mlp.hook_post`` ``fc2``'s input, ``hook_mlp_out`` ``fc2``'s output (OPT's
  residual dropout comes after it; the identity in eval mode). The layer flattens tokens to
  ``[b*p, d]`` around the MLP; these hook points are shown as ``[b, p, ...]``.
* **Both layer-norm placements.** ``do_layer_norm_before=True`` (125m, 1.3b, ...): standard pre-LN
  block, ``ln1 = self_attn_layer_norm``, ``ln2`` = the layer's ``final_layer_norm``, ``ln_final`` =
  ``decoder.final_layer_norm``. ``do_layer_norm_before=False`` (350m) is post-LN, see
  :data:`POST_LN_DOC`; such models have no ``decoder.final_layer_norm`` and hence no ``ln_final``.
* **project_in / project_out** (``word_embed_proj_dim != hidden_size``): ``hook_embed`` is the
  token embedding *after* ``project_in`` (``[b, p, d_model]``); ``W_E = embed_tokens.weight @
  project_in`` (``[d_vocab, d_model]``) and ``W_U = project_out @ lm_head`` (``[d_model, d_vocab]``).
  ``cfg.d_model`` is ``hidden_size``; ``cfg.extra["word_embed_proj_dim"]`` keeps the other width.
* ``enable_bias=False``: biases read as zeros; ``layer_norm_elementwise_affine=False`` is supported.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters import (
    Architecture,
    BlockLayout,
    HookPoint,
    MLPLayout,
    ModelLayout,
    SeparateQKV,
    UnsupportedModelError,
    hf,
    hookimpl,
    live_parameters,
)
from lensadapters.sites import Site, first_output, replace_first_output

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
ARCH = hf.architecture("opt", "OPT (OPTForCausalLM, OPTModel), pre-LN and post-LN, with or without project_in/out")
hf.plugin_module(globals(), ARCH, hookspec="1", contract="OPTContract")

POST_LN_DOC = """\
Post-LN blocks (do_layer_norm_before=False, OPT-350m) compute
    mid = self_attn_layer_norm(x + attn(x));  out = final_layer_norm(mid + fc2(act(fc1(mid))))
and their hook points, in execution order, are
    hook_resid_pre        x, the block input (attention reads it directly: there is no norm before attention)
    attn.hook_q/k/v ...   from x (hook_q == x @ W_Q + b_Q)
    hook_attn_out         attention output
    hook_resid_mid        x + attn_out, the input of self_attn_layer_norm (TransformerLens' post-LN BertBlock)
    ln1.hook_scale/normalized   self_attn_layer_norm
    hook_mlp_in           fc1's input = ln1's output; an edit changes only the MLP branch
    mlp.hook_pre/post, hook_mlp_out
    ln2.hook_scale/normalized   the layer's final_layer_norm, applied to ln1 output + mlp_out
    hook_resid_post       the block output (= ln2's output = next block's hook_resid_pre)
An edit of hook_resid_mid changes self_attn_layer_norm's input, so the MLP input *and* the residual
that the MLP output is added to both follow it; an edit of hook_resid_post is the next block's input.
"""


# --- layout helpers ------------------------------------------------------------------------------


def _decoder_path(model: PreTrainedModel) -> str:
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "decoder"):
        return "model.decoder"
    if hasattr(model, "decoder"):
        return "decoder"
    raise UnsupportedModelError(
        f"lensadapters-opt expects an OPT model with a `decoder` (OPTModel) or `model.decoder` (OPTForCausalLM); "
        f"{type(model).__name__} has neither"
    )


def _decoder(model: PreTrainedModel) -> nn.Module:
    return model.get_submodule(_decoder_path(model))


def _pre_ln(model: PreTrainedModel, layer: int = 0) -> bool:
    block = _decoder(model).layers[layer]
    return bool(getattr(block, "do_layer_norm_before", getattr(model.config, "do_layer_norm_before", True)))


def _offset(module: nn.Module) -> int:
    return int(getattr(module, "offset", 2))


# --- adapter hooks -----------------------------------------------------------------------------------


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    decoder = _decoder(model)
    missing = [name for name in ("embed_tokens", "embed_positions", "layers") if not hasattr(decoder, name)]
    if missing:
        raise UnsupportedModelError(f"this OPT decoder ({type(decoder).__name__}) has no {', '.join(missing)}")
    c = model.config
    wide = getattr(c, "word_embed_proj_dim", c.hidden_size) or c.hidden_size
    if wide != c.hidden_size and (
        getattr(decoder, "project_in", None) is None or getattr(decoder, "project_out", None) is None
    ):
        raise UnsupportedModelError(
            f"word_embed_proj_dim={wide} != hidden_size={c.hidden_size} but the decoder lacks project_in/project_out"
        )
    placements = {_pre_ln(model, i) for i in range(len(decoder.layers))}
    if len(placements) > 1:
        raise UnsupportedModelError("OPT layers mix pre-LN and post-LN (do_layer_norm_before differs per layer)")
    for i, layer in enumerate(decoder.layers):
        for name in ("self_attn", "self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"):
            if not hasattr(layer, name):
                raise UnsupportedModelError(f"OPT layer {i} ({type(layer).__name__}) has no {name}")
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            if not hasattr(layer.self_attn, name):
                raise UnsupportedModelError(f"OPT attention {i} ({type(layer.self_attn).__name__}) has no {name}")
    if getattr(c, "layerdrop", 0.0):
        warnings.warn(
            f"OPT layerdrop={c.layerdrop}: in training mode, the hook points of a dropped layer do not fire",
            stacklevel=3,
        )


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """OPT's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): LayerNorm before or after each branch,
    learned positions with their offset, the optional projections and final norm."""
    c = model.config
    decoder = _decoder(model)
    ln = decoder.layers[0].self_attn_layer_norm
    return dict(
        d_head=c.hidden_size // c.num_attention_heads,
        d_mlp=c.ffn_dim,
        act_fn=c.activation_function,
        normalization_type="LN",
        positional_embedding_type="standard",
        eps=float(getattr(ln, "eps", 1e-5)),
        extra={
            "do_layer_norm_before": _pre_ln(model),
            "word_embed_proj_dim": decoder.embed_tokens.weight.shape[-1],
            "project_in": getattr(decoder, "project_in", None) is not None,
            "final_layer_norm": getattr(decoder, "final_layer_norm", None) is not None,
            "pos_embed_offset": _offset(decoder.embed_positions),
        },
    )


lensadapters_config = hf.hooked_config(_config_fields)


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    path = _decoder_path(model)
    decoder = model.get_submodule(path)
    embed = "project_in" if getattr(decoder, "project_in", None) is not None else "embed_tokens"
    ln_final = path + ".final_layer_norm" if getattr(decoder, "final_layer_norm", None) is not None else None
    # pos_embed is served by this plugin's own site (OPTPositionSite, see lensadapters_extra_sites): the core's
    # site reads the batch size from the token embedding, which runs *after* embed_positions when project_in exists.
    return ModelLayout(
        blocks=path + ".layers",
        embed=f"{path}.{embed}",
        ln_final=ln_final,
        unembed="lm_head" if hasattr(model, "lm_head") else None,
    )


def _block(model: PreTrainedModel, layer: int) -> BlockLayout:
    return BlockLayout(
        ln1="self_attn_layer_norm",
        attn="self_attn",
        o_proj="self_attn.out_proj",
        ln2="final_layer_norm",
        mlp=None,
        post_norm=not _pre_ln(model, layer),
        flat_mlp=True,
    )


# hook_q is q_proj's output, before OPTAttention multiplies it by `scaling`; the attention function is then called
# with scaling=1.0, so the core's scores (query @ key^T * 1.0) are HF's scaled scores.
QKV = SeparateQKV("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
globals().update(hf.layer_hooks(_block, QKV, MLPLayout(pre="fc1", out="fc2")))


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Optional[torch.Tensor]:
    decoder = _decoder(hooked.hf_model)
    if name == "W_E":
        with live_parameters(decoder.embed_tokens) as embed_tokens:
            W_E = embed_tokens.weight
        if getattr(decoder, "project_in", None) is not None:
            W_E = W_E @ hooked.read_linear(decoder.project_in).W.to(W_E.dtype)
        return W_E
    if name == "W_pos":
        with live_parameters(decoder.embed_positions) as embed_positions:
            return embed_positions.weight[_offset(embed_positions) :]
    if name == "W_U":
        if hooked.layout.unembed is None:
            raise AttributeError(f"{type(hooked.hf_model).__name__} has no lm_head (W_U)")
        W_U = hooked.read_linear(hooked.hf_model.get_submodule(hooked.layout.unembed)).W
        if getattr(decoder, "project_out", None) is not None:
            W_U = hooked.read_linear(decoder.project_out).W.to(W_U.dtype) @ W_U
        return W_U
    return None


class OPTPositionSite(Site):
    """``hook_pos_embed``: ``embed_positions``' output as ``[b, p, d_model]``.

    The batch size is read from the module's first input (the ``[b, past + p]`` attention mask that OPT
    derives positions from), so a broadcast row of user ``position_ids`` is shown per batch element.
    """

    def __init__(self, module: nn.Module, point: HookPoint) -> None:
        self.module, self.point = module, point
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        value = first_output(output)
        mask = args[0] if args else kwargs.get("attention_mask")
        batch = mask.shape[0] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else value.shape[0]
        shaped = value.expand(batch, *value.shape[1:]) if value.shape[0] == 1 and batch > 1 else value
        shaped, changed = self.point.apply(shaped, protect=shaped is not value)  # an expanded view: edit a copy
        return replace_first_output(output, shaped) if changed else None


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    decoder = _decoder(hooked.hf_model)
    # OPT looks up positions before project_in runs: with a projection, hook_pos_embed fires before hook_embed
    placement = (
        {"before": "hook_embed"} if getattr(decoder, "project_in", None) is not None else {"after": "hook_embed"}
    )
    return [OPTPositionSite(decoder.embed_positions, hooked.new_point("hook_pos_embed", **placement))]


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 64, vocabulary 512. Seed 0 is the demo's model (2 pre-LN layers of 4 heads, OPT-125m's shape);
    other seeds vary the depth (1-3), the heads (2, 4 or 8) and the shape: pre-LN, or OPT-350m's post-LN with
    ``project_in``/``project_out`` (embeddings 32 wide), deterministically."""
    import random

    from transformers import OPTConfig

    rng = random.Random(seed)
    layers, heads, post_ln = (
        (2, 4, False) if seed == 0 else (rng.choice([1, 2, 3]), rng.choice([2, 4, 8]), rng.random() < 0.5)
    )
    return hf.without_dropout(
        OPTConfig,
        **hf.size_fields(vocab=512, hidden=64, layers=layers, heads=heads, positions=128),
        ffn_dim=128,
        word_embed_proj_dim=32 if post_ln else 64,
        do_layer_norm_before=not post_ln,
        **OPT_TOKENS,
    )


#: OPT's special tokens (pad 1, bos and eos 2), in every toy config
OPT_TOKENS = {"pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}
