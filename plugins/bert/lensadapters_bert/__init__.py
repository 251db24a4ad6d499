"""BERT and RoBERTa encoders for lensadapters (``BertModel``, ``BertForMaskedLM``, ``RobertaModel``,
``RobertaForMaskedLM``...; transformers 4.57 and 5.x), with TransformerLens 2.18 ``HookedEncoder``'s points.

The blocks are post-LN and bidirectional::

    mid = ln1(x + attn(x));  out = ln2(mid + mlp(mid))

and their points, in execution order, are TransformerLens' ``BertBlock``'s:

    hook_resid_pre                  x, the block input
    attn.hook_q/k/v                 the query/key/value projections of x, per head
    attn.hook_attn_scores/pattern   bidirectional: padding keys (attention_mask 0) are -inf, nothing else
    attn.hook_z, attn.hook_result   the heads' mix, and each head's share of the output projection
    hook_attn_out                   attention.output.dense's output, through its dropout (the identity in eval mode),
                                    before the residual add inside BertSelfOutput
    hook_resid_mid                  x + attn_out, the input of ln1 (attention.output.LayerNorm)
    ln1.hook_scale/hook_normalized  ln1
    hook_mlp_in                     the MLP's input (ln1's output); an edit changes only the MLP branch
    mlp.hook_pre/hook_post          intermediate.dense's output / output.dense's input
    hook_mlp_out                    output.dense's output
    hook_resid_post                 ln1 output + mlp_out, the input of ln2 (output.LayerNorm)
    ln2.hook_scale/hook_normalized  ln2
    hook_normalized_resid_post      the block output (ln2's output, the next block's hook_resid_pre)

Embeddings: ``hook_embed`` (word embeddings), ``embed.hook_token_type_embed``, ``hook_pos_embed`` (in the order
the model computes them), ``embed.ln.hook_scale/hook_normalized`` and ``hook_full_embed`` (what the first block
reads). TransformerLens calls the first two ``embed.hook_embed``/``embed.hook_pos_embed``; here they keep the
names every lensadapters model has (the analysis layer reads them). The masked-LM head's norm is
``mlm_head.ln.hook_scale/hook_normalized``; ``W_U``/``b_U`` are its decoder.

RoBERTa differs from BERT in its positions (from the *token ids*: padding tokens read row ``padding_idx`` of the
table, real tokens rows ``padding_idx + 1 + t``; ``W_pos`` excludes the first ``padding_idx + 1`` rows, so a real
token at position ``t`` has ``hook_pos_embed == W_pos[t]``), in its head's module names (``lm_head.dense``,
``lm_head.layer_norm``, ``lm_head.decoder``) and in usually having one token type.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lensadapters import hf
from lensadapters.plugin_api import (
    Architecture,
    BlockLayout,
    MLPLayout,
    ModelLayout,
    NormSite,
    OutputSite,
    SeparateQKV,
    Site,
    UnsupportedModelError,
    hookimpl,
    live_parameters,
    override_instance_method,
    site_attention,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
ARCH = hf.architecture(
    "bert",
    "BERT and RoBERTa encoders (post-LN, bidirectional; masked-LM head) with HookedEncoder's points",
    model_types=("bert", "roberta"),
)
hf.plugin_module(globals(), ARCH, hookspec="1", contract="BertContract")
#: the modules every encoder layer has
LAYER_PATHS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "attention.output.LayerNorm",
    "intermediate.dense",
    "output.dense",
    "output.LayerNorm",
)


# --- layout helpers ------------------------------------------------------------------------------


# the base model's path inside a head model (with a trailing dot; "" for the base model) and the base model
_prefix, _base = hf.base_prefix, hf.base_model


def _head(model: PreTrainedModel) -> Optional[tuple[str, str]]:
    """``(path of the head's LayerNorm, path of its decoder)`` of a masked-LM head, or ``None`` without one."""
    if isinstance(getattr(getattr(model, "cls", None), "predictions", None), nn.Module):  # BERT
        return "cls.predictions.transform.LayerNorm", "cls.predictions.decoder"
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, nn.Module) and hasattr(lm_head, "layer_norm") and hasattr(lm_head, "decoder"):  # RoBERTa
        return "lm_head.layer_norm", "lm_head.decoder"
    return None


def _position_offset(model: PreTrainedModel) -> int:
    """Rows of the position table before position 0: RoBERTa's ``padding_idx + 1``, BERT's none."""
    embeddings = _base(model).embeddings
    if model.config.model_type == "roberta":
        return int(embeddings.padding_idx) + 1
    return 0


# --- adapter hooks -----------------------------------------------------------------------------------


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    c = model.config
    if getattr(c, "is_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} has is_decoder=True (causal self-attention, a KV cache): lensadapters-bert serves "
            f"encoders (bidirectional attention, TransformerLens' HookedEncoder); load it with is_decoder=False"
        )
    if getattr(c, "add_cross_attention", False):
        raise UnsupportedModelError(f"{type(model).__name__} has cross-attention layers, which lensadapters-bert lacks")
    position_type = getattr(c, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type={position_type!r}: lensadapters-bert serves absolute (learned) positions only"
        )
    base = _base(model)
    for name in ("embeddings", "encoder"):
        if not isinstance(getattr(base, name, None), nn.Module):
            raise UnsupportedModelError(f"{type(base).__name__} has no {name!r} module: not transformers' BERT layout")
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"):
        if not isinstance(getattr(base.embeddings, name, None), nn.Module):
            raise UnsupportedModelError(f"{type(base.embeddings).__name__} has no {name!r}")
    for i, layer in enumerate(base.encoder.layer):
        missing = hf.missing_paths(layer, LAYER_PATHS)
        if missing:
            raise UnsupportedModelError(f"layer {i} ({type(layer).__name__}) has no {missing[0]}")


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """BERT's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): post-LN blocks, learned positions
    (after the model's offset), bidirectional attention."""
    c = model.config
    act = c.hidden_act if isinstance(c.hidden_act, str) else type(c.hidden_act).__name__
    return dict(
        d_head=c.hidden_size // c.num_attention_heads,
        n_ctx=c.max_position_embeddings - _position_offset(model),
        act_fn=act,
        normalization_type="LN",
        positional_embedding_type="standard",
        eps=float(c.layer_norm_eps),
        attention_dir="bidirectional",
        extra={
            "post_ln": True,
            "type_vocab_size": c.type_vocab_size,
            "pos_embed_offset": _position_offset(model),
            "mlm_head": _head(model) is not None,
        },
    )


lensadapters_config = hf.hooked_config(_config_fields)


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    p = _prefix(model)
    head = _head(model)
    return ModelLayout(
        blocks=f"{p}encoder.layer",
        embed=f"{p}embeddings.word_embeddings",
        pos_embed=f"{p}embeddings.position_embeddings",
        pos_embed_offset=_position_offset(model),
        unembed=head[1] if head else None,
    )


# attn is the self-attention module (the one transformers' attention function receives); hook_attn_out is served by
# this plugin (BertSelfOutput adds the residual inside its forward)
BLOCK = BlockLayout(
    ln1="attention.output.LayerNorm",
    attn="attention.self",
    o_proj="attention.output.dense",
    ln2="output.LayerNorm",
    mlp=None,
    post_norm=True,
    resid_post_before_norm=True,
)
QKV = SeparateQKV("attention.self.query", "attention.self.key", "attention.self.value")
globals().update(hf.layer_hooks(BLOCK, QKV, MLPLayout(pre="intermediate.dense", out="output.dense")))


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    model = hooked.hf_model
    embeddings = _base(model).embeddings
    sites: list[Site] = []
    for i, block in enumerate(hooked.block_modules):
        # what BertSelfOutput adds to the residual: its dropout's output (the dense layer's in eval mode), a module
        # of its own, so that attn.hook_result's edits (on the dense layer's output) are always in it
        sites.append(OutputSite(block.attention.output.dropout, hooked.claim_point(f"blocks.{i}.hook_attn_out")))
    # BERT computes word, token-type, then position embeddings, sums them and normalizes the sum
    sites.append(
        OutputSite(
            embeddings.token_type_embeddings, hooked.new_point("embed.hook_token_type_embed", after="hook_embed")
        )
    )
    sites.append(_norm_site(hooked, embeddings.LayerNorm, "embed.ln", after="hook_pos_embed"))
    sites.append(OutputSite(embeddings, hooked.new_point("hook_full_embed", after="embed.ln.hook_normalized")))
    head = _head(model)
    if head is not None:
        last = f"blocks.{len(hooked.block_modules) - 1}.hook_normalized_resid_post"
        sites.append(_norm_site(hooked, model.get_submodule(head[0]), "mlm_head.ln", after=last))
    return sites


def _norm_site(hooked: Any, module: nn.Module, prefix: str, after: str) -> NormSite:
    """``{prefix}.hook_scale`` and ``hook_normalized`` of ``module``, after point ``after``."""
    return hf.PointChain(hooked, after).norm(module, prefix)


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Optional[Tensor]:
    if name == "W_pos":  # the rows real tokens read: RoBERTa's padding rows are left out
        table = _base(hooked.hf_model).embeddings.position_embeddings
        with live_parameters(table) as live:
            weight: Any = live.weight
            return weight[hooked.layout.pos_embed_offset :]
    return None


# --- patterns under transformers 4.x (BERT computes attention in its own modules there) --------------


def _own_attention(module: nn.Module) -> bool:
    """Whether this self-attention module computes attention itself (transformers 4.x's ``BertSelfAttention`` and
    ``BertSdpaSelfAttention``) rather than through transformers' attention interface (5.x)."""
    return not hasattr(sys.modules[type(module).__module__], "eager_attention_forward")


def _eager_scores(module: Any, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
    """Pre-mask scores as 4.x's eager ``BertSelfAttention`` computes them: ``q @ kᵀ / sqrt(d_head)``."""
    return torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(module.attention_head_size)


class EncoderPatternBackend:
    """Serves ``hook_attn_scores``/``hook_pattern`` where the self-attention module computes attention in its own
    ``forward`` (transformers 4.x).

    ``activate(layer, site)`` stores a ``forward`` in *that module instance's* ``__dict__`` (the class and other
    instances are untouched): it runs the module's own ``query``/``key``/``value`` layers (so ``hook_q``... fire
    as always) and the core's explicit attention (scores → mask → ``hook_attn_scores`` → softmax → ``hook_pattern``
    → values), and returns what the module returns. The handle deletes it again.
    """

    def __init__(self, hooked: Any) -> None:
        self.modules: list[nn.Module] = list(hooked.attention_modules)

    def activate(self, layer: int, site: Any) -> Any:
        module: Any = self.modules[layer]  # BertSelfAttention (its attributes are untyped for mypy)
        implementation = "sdpa" if "Sdpa" in type(module).__name__ else "eager"
        attend = site_attention(site, module, _eager_scores)

        def forward(
            hidden_states: Tensor,
            attention_mask: Optional[Tensor] = None,
            head_mask: Optional[Tensor] = None,
            encoder_hidden_states: Optional[Tensor] = None,
            past_key_values: Any = None,
            output_attentions: Optional[bool] = False,
            cache_position: Optional[Tensor] = None,
            **kwargs: Any,
        ) -> tuple[Tensor, Optional[Tensor]]:
            if encoder_hidden_states is not None or past_key_values is not None or kwargs.get("past_key_value"):
                raise UnsupportedModelError(
                    "lensadapters-bert's attention patterns need self-attention without a cache"
                )
            b, p, _ = hidden_states.shape
            h, d = module.num_attention_heads, module.attention_head_size

            def heads(x: Tensor) -> Tensor:
                return x.view(b, -1, h, d).transpose(1, 2)

            q, k, v = (
                heads(module.query(hidden_states)),
                heads(module.key(hidden_states)),
                heads(module.value(hidden_states)),
            )
            dropout = module.dropout.p if module.training else 0.0
            out, pattern = attend(
                q,
                k,
                v,
                attention_mask,
                implementation=implementation,
                dropout=dropout,
                head_mask=head_mask,
                is_causal=False,
            )
            context = out.reshape(b, p, h * d)
            return context, (pattern if implementation == "eager" else None)

        return override_instance_method(module, "forward", forward)  # a copy of the model gets the class's forward


# the plugin's backend where the attention modules compute attention themselves, else the core's
lensadapters_attn_pattern = hf.own_attention_patterns(_own_attention, EncoderPatternBackend)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 32, vocabulary 64, 2 token types. Seed 0 is a 2-layer BERT of 4 heads; other seeds vary the depth
    (1-3), the heads (2 or 4) and the family (BERT or RoBERTa), deterministically."""
    from transformers import BertConfig, RobertaConfig

    layers, heads, roberta = hf.toy_draw(seed, (2, 4, False), [1, 2, 3], [2, 4], 0.5)
    sizes = hf.size_fields(hidden=32, d_mlp=64, layers=layers, heads=heads, vocab=64)
    shared = {**sizes, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "type_vocab_size": 2}
    if roberta:
        return RobertaConfig(max_position_embeddings=34, pad_token_id=1, **shared)
    return BertConfig(max_position_embeddings=32, pad_token_id=0, **shared)
