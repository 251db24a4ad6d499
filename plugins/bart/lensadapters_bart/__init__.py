"""The BART family for lensadapters (transformers 4.57 and 5.x): BART, PLBart, mBART, Marian, Pegasus, Blenderbot,
Blenderbot-Small, MVP and BigBird-Pegasus, declared by what each changes of BART (``FAMILIES``).
Their ``*ForConditionalGeneration`` get TransformerLens 2.18 ``HookedEncoderDecoder``'s names (TransformerLens 2.18
has none of them); their ``*ForCausalLM`` (the decoder alone) the core's decoder-only points, described by
``lensadapters_block``... (post-LN with ``BertBlock``'s points).

BART's stacks read token embeddings (times ``sqrt(d_model)`` where ``config.scale_embedding``) plus learned positions
(the table's row ``position + 2``: BART's offset), through a LayerNorm (``layernorm_embedding``); their blocks are
post-LN, as TransformerLens' ``BertBlock``, with biases everywhere and ``q kᵀ`` scaled by ``d_head**-0.5``. In
execution order (``hm.hook_names``)::

    hook_embed                              encoder.embed_tokens' output (scaled where scale_embedding)
    hook_pos_embed                          encoder.embed_positions' output (rows position + 2 of its table)
    embed.ln.hook_scale/normalized          encoder.layernorm_embedding (its output is what encoder block 0 reads)
    encoder.{i}.hook_resid_pre              the block input
    encoder.{i}.attn.hook_q/k/v             self_attn.q_proj/k_proj/v_proj outputs per head
    encoder.{i}.attn.hook_attn_scores       q kᵀ * d_head**-0.5 + the mask (finfo.min at padding keys)
    encoder.{i}.attn.hook_pattern           the softmax
    encoder.{i}.attn.hook_z                 the heads' mix (the input of self_attn.out_proj)
    encoder.{i}.hook_attn_out               self_attn.out_proj's output
    encoder.{i}.hook_resid_mid              resid_pre + attn_out, the input of self_attn_layer_norm
    encoder.{i}.ln1.hook_scale/normalized   self_attn_layer_norm (its output is the MLP's input and residual)
    encoder.{i}.mlp.hook_pre/hook_post      fc1's output / fc2's input (the activation of hook_pre)
    encoder.{i}.hook_mlp_out                fc2's output
    encoder.{i}.hook_resid_post             ln1's output + mlp_out, the input of final_layer_norm
    encoder.{i}.ln2.hook_scale/normalized   final_layer_norm
    encoder.{i}.hook_normalized_resid_post  the block output (ln2's output)
    decoder.hook_embed, decoder.hook_pos_embed, decoder.embed.ln.*   the decoder's (lensadapters' own names)
    decoder.{i}.hook_resid_pre ... ln1.*    as the encoder's, causal self-attention
    decoder.{i}.cross_attn.hook_q/k/v/attn_scores/pattern/z   encoder_attn (keys and values from the encoder
                                            output, the encoder's padding masked)
    decoder.{i}.hook_cross_attn_out         encoder_attn.out_proj's output
    decoder.{i}.hook_resid_mid_cross        ln1's output + cross_attn_out, the input of encoder_attn_layer_norm
    decoder.{i}.ln2.hook_scale/normalized   encoder_attn_layer_norm
    decoder.{i}.mlp.* ... hook_resid_post   as the encoder's (hook_resid_post: ln2's output + mlp_out)
    decoder.{i}.ln3.hook_scale/normalized   final_layer_norm
    decoder.{i}.hook_normalized_resid_post  the block output

BART has no final norm after either stack (``encoder_final_ln``/``decoder_final_ln`` are not served): the logits
are ``lm_head(decoder block output) + final_logits_bias`` (``W_U`` is ``lm_head``'s weight, ``b_U`` the bias).
BART's dropouts are functional (no module to hook): in training mode ``hook_attn_out``, ``hook_cross_attn_out`` and
``hook_mlp_out`` are the values before the dropout the model applies next (in eval mode it is the identity).

Pre-LN families (mBART, Pegasus, Blenderbot) have T5's block points instead (``ln1`` before attention, ``ln2``
before cross-attention, ``ln3`` before the MLP, ``hook_resid_mid``/``hook_resid_mid_cross`` the residual between,
``hook_resid_post`` the block output; :class:`PreLNResidualSite`) and final norms (``encoder_final_ln``,
``decoder_final_ln``). ``hook_embed`` and ``hook_pos_embed`` are served where a stack adds them
(:class:`EmbedSumSite`), so a family whose stack applies the embedding scale itself (Marian, Pegasus, MVP) shows
the scaled embeddings too.

BigBird-Pegasus (pre-LN, Pegasus' names) has BigBird's encoder attention (``encoder_attention``,
``block_sparse_encoder``): its points are decided per forward as transformers decides the attention, full (every
point; :class:`BigBirdPatternSite`) or block-sparse (every point but the encoder's scores and patterns, refused by
name); its q/k/v points hold the wrapper and the linears its inner modules share (:class:`SharedLinearSite`), which
transformers' switch to full attention keeps. A block-sparse input that is not a multiple of ``block_size`` the
stack pads with pad tokens' embeddings (mask 0, no positions) and strips after its final norm: every encoder point
still shows the input's positions only (``[batch, input_len, ...]``; the pad positions, masked as keys and with
their attention output zeroed as queries, cannot change them), and an edit is made in those positions of the
padded tensor, as a plain PyTorch hook editing them would (:class:`BlockSparsePadding`).

Scores and patterns are served per hooked attention module: while one of them has a hook, that instance's
``forward`` (only that instance's: the class is untouched) computes attention written out, with the module's own
projections and the model's key/value cache.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lensadapters import hf
from lensadapters.plugin_api import (
    Architecture,
    BlockLayout,
    HookedConfig,
    InputSite,
    MLPLayout,
    ModelLayout,
    OutputSite,
    SeparateQKV,
    Site,
    UnsupportedModelError,
    WeightUnavailableError,
    hookimpl,
)
from lensadapters_bart.families import FAMILIES, Family
from lensadapters_bart.sites import (  # noqa: F401  (their old import path)
    BartPatternSite,
    BigBirdPatternSite,
    BlockSparsePadding,
    EmbedSumSite,
    NormFirstEmbedSite,
    PreLNResidualSite,
    SharedLinearSite,
    position_offset,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"


ARCH = hf.architecture(
    "bart",
    "BART-shaped encoder-decoders (BART, PLBart, mBART, Marian, Pegasus, Blenderbot, Blenderbot-Small, MVP, "
    "BigBird-Pegasus with BigBird's full or block-sparse encoder attention: learned or sinusoidal "
    "positions, post- or pre-LN blocks, biases, final_logits_bias) with HookedEncoderDecoder's names, and their "
    "*ForCausalLM (the decoder alone) with TransformerLens' decoder-only names",
    model_types=tuple(FAMILIES),
    encoder_decoder=True,
)
hf.plugin_module(globals(), ARCH, hookspec="1", contract="BartContract")
STACKS = ("encoder", "decoder")


def family(model: Any) -> Family:
    return FAMILIES[model.config.model_type]


def causal(model: Any) -> bool:
    """A ``*ForCausalLM``: the decoder alone (``model.decoder``), no encoder."""
    return not getattr(model.config, "is_encoder_decoder", True) and not hasattr(_stacks(model), "encoder")


def _stacks(model: Any) -> Any:
    return getattr(model, "model", None)


def _stack_names(model: Any) -> tuple[str, ...]:
    return ("decoder",) if causal(model) else STACKS


def embed_scale(model: Any, stack: str = "encoder") -> float:
    """The factor ``stack``'s token embeddings are multiplied by (a decoder that never applies its own: 1)."""
    if stack == "decoder" and not family(model).decoder_scaled:
        return 1.0
    return math.sqrt(model.config.d_model) if model.config.scale_embedding else 1.0


# --- description ---------------------------------------------------------------------------------------------


def _check_family(model: Any, fam: Family, stack_name: str, stack: nn.Module) -> None:
    """The family's declared differences, checked against the stack's modules."""
    found = {
        "embed_ln": fam.final_norm != "layernorm_embedding"
        and isinstance(getattr(stack, "layernorm_embedding", None), nn.LayerNorm),
        "final_norms": isinstance(getattr(stack, fam.final_norm, None), nn.LayerNorm),
        "positions": "sinusoidal" if "Sinusoidal" in type(stack.embed_positions).__name__ else "learned",
        "scale_in_module": hasattr(stack.embed_tokens, "embed_scale"),
    }
    for field, value in found.items():
        if getattr(fam, field) != value:
            raise UnsupportedModelError(
                f"{type(model).__name__}: its {stack_name} has {field}={value}, but lensadapters-bart describes "
                f"{model.config.model_type} with {field}={getattr(fam, field)} (transformers' {fam.name} code): "
                f"this model is not the family it is declared to be"
            )


def _check_encoder_attention(model: Any, fam: Family, encoder: nn.Module) -> None:
    """The encoder self-attention's projections where the family declares them (``encoder_attention``), and, for
    BigBird's, the ``attention_type`` it switches on."""
    for i, block in enumerate(getattr(encoder, "layers", ())):
        attn = block.self_attn
        try:
            found = [attn.get_submodule(path) for path in fam.encoder_attention]
        except AttributeError:
            found = []
        if not found or not all(isinstance(m, nn.Linear) for m in found):
            raise UnsupportedModelError(
                f"{type(model).__name__}: encoder block {i}'s self-attention ({type(attn).__name__}) has no linear "
                f"{', '.join(fam.encoder_attention)}, which lensadapters-bart describes {fam.name}'s with"
            )
        if fam.block_sparse_encoder and getattr(attn, "attention_type", None) not in ("original_full", "block_sparse"):
            raise UnsupportedModelError(
                f"{type(model).__name__}: encoder block {i}'s self-attention ({type(attn).__name__}) has no "
                f"attention_type 'original_full' or 'block_sparse' (BigBird's full or block-sparse attention)"
            )


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    fam = family(model)
    base = _stacks(model)
    names = _stack_names(model)
    kind = "ForCausalLM" if causal(model) else "ForConditionalGeneration"
    for stack in names:
        if not isinstance(getattr(base, stack, None), nn.Module):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no model.{stack}: lensadapters-bart serves encoder-decoders "
                f"({fam.name}ForConditionalGeneration, HookedEncoderDecoder's names) and decoders "
                f"({fam.name}ForCausalLM)"
            )
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise UnsupportedModelError(f"{type(model).__name__} has no lm_head: lensadapters-bart serves {fam.name}{kind}")
    if not type(model).__module__.startswith(f"transformers.models.{model.config.model_type.replace('-', '_')}."):
        raise UnsupportedModelError(
            f"{type(model).__module__}.{type(model).__name__}: lensadapters-bart serves transformers' own "
            f"{fam.name} classes"
        )
    c = model.config
    if not causal(model) and (c.encoder_layers, c.encoder_attention_heads, c.encoder_ffn_dim) != (
        c.decoder_layers,
        c.decoder_attention_heads,
        c.decoder_ffn_dim,
    ):
        raise UnsupportedModelError(
            f"encoder (layers, heads, ffn) = {(c.encoder_layers, c.encoder_attention_heads, c.encoder_ffn_dim)} but "
            f"decoder {(c.decoder_layers, c.decoder_attention_heads, c.decoder_ffn_dim)}: HookedEncoderDecoder's cfg "
            f"describes both stacks at once; lensadapters-bart serves equal stacks"
        )
    for stack in names:
        _check_family(model, fam, stack, getattr(base, stack))
    if not causal(model):
        _check_encoder_attention(model, fam, base.encoder)
    if getattr(c, "use_prompt", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} with use_prompt=True: the prompts' keys and values (MvpPrompt) have no points; "
            f"lensadapters-bart serves MVP without them"
        )


@hookimpl
def lensadapters_config(arch: Architecture, model: PreTrainedModel) -> HookedConfig:
    c = model.config
    fam = family(model)
    stack = getattr(_stacks(model), _stack_names(model)[0])
    prefix = "decoder" if causal(model) else "encoder"
    return HookedConfig(
        n_layers=getattr(c, f"{prefix}_layers"),
        d_model=c.d_model,
        n_heads=getattr(c, f"{prefix}_attention_heads"),
        d_head=c.d_model // getattr(c, f"{prefix}_attention_heads"),
        d_mlp=getattr(c, f"{prefix}_ffn_dim"),
        d_vocab=c.vocab_size,
        n_ctx=int(c.max_position_embeddings),
        act_fn=str(c.activation_function),
        normalization_type="LN",
        positional_embedding_type="standard",
        model_type=c.model_type,
        eps=float(stack.layers[0].self_attn_layer_norm.eps),
        original_architecture=type(model).__name__,
        # HookedEncoderDecoder's; the decoder's self-attention is causal
        attention_dir="causal" if causal(model) else "bidirectional",
        extra={
            "encoder_decoder": not causal(model),
            "post_ln": not fam.pre_ln,
            "positions": fam.positions,
            "position_offset": position_offset(stack),
            "embed_scale": embed_scale(model),
            "decoder_start_token_id": getattr(c, "decoder_start_token_id", None),
        },
    )


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    fam = family(model)
    if causal(model):  # the core's decoder-only points; hook_embed and hook_pos_embed are this plugin's
        decoder = model.model.decoder
        return ModelLayout(
            blocks="model.decoder.layers",
            embed="model.decoder.embed_tokens",
            pos_embed="model.decoder.embed_positions",
            pos_embed_offset=position_offset(decoder),
            ln_final=f"model.decoder.{fam.final_norm}" if fam.final_norms else None,
            unembed="lm_head",
            embed_scale=embed_scale(model, "decoder"),
            embed_scale_after_module=not fam.scale_in_module,
            embed_scale_rounded=fam.scale_in_module,
        )
    # the encoder's blocks are the model's blocks (opaque: this plugin serves every point)
    return ModelLayout(
        blocks="model.encoder.layers",
        embed="model.shared",
        unembed="lm_head",
        embed_scale=embed_scale(model),
        embed_scale_after_module=not fam.scale_in_module,
        embed_scale_rounded=fam.scale_in_module,
    )


#: a causal LM's decoder layers (``ln1``: ``self_attn_layer_norm``, ``ln2``: ``final_layer_norm``, the MLP's ``fc1``
#: and ``fc2`` in the layer); post-LN with TransformerLens' ``BertBlock`` points
PRE_LN_BLOCK = BlockLayout("self_attn_layer_norm", "self_attn", "self_attn.out_proj", "final_layer_norm")
POST_LN_BLOCK = replace(PRE_LN_BLOCK, post_norm=True, resid_post_before_norm=True)


@hookimpl
def lensadapters_block(arch: Architecture, model: Any, layer: int) -> Optional[BlockLayout]:
    """A causal LM's blocks are the core's (post-LN with TransformerLens' ``BertBlock`` points, or pre-LN); an
    encoder-decoder's are opaque (this plugin serves their points, HookedEncoderDecoder's names)."""
    if not causal(model):
        return None
    return PRE_LN_BLOCK if family(model).pre_ln else POST_LN_BLOCK


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: Any, layer: int) -> Optional[SeparateQKV]:
    return SeparateQKV("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if causal(model) else None


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: Any, layer: int) -> Optional[MLPLayout]:
    return MLPLayout(pre="fc1", out="fc2") if causal(model) else None


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Any:
    """``W_E`` (the shared embeddings, times the embedding scale) and ``W_U`` (``lm_head``) are the core's; ``b_U``
    is ``final_logits_bias``, ``W_pos`` the encoder's position table without its offset rows; the per-block weights
    are refused by name: HookedModel's ``W_Q``... stack one stack of blocks, and an encoder-decoder has two. A
    causal LM's weights are all the core's."""
    model: Any = hooked.hf_model
    if causal(model) or name in ("W_E", "W_U"):
        return None
    if name == "b_U":
        return model.final_logits_bias[0]
    if name == "W_pos":
        encoder = model.model.encoder
        return encoder.embed_positions.weight[position_offset(encoder) :]
    raise WeightUnavailableError(
        f"{name}: the stacked per-block weights (W_Q, W_O, W_in...) index one stack of blocks; "
        f"{type(model).__name__} is an encoder-decoder with two: read a block's modules "
        f"(hm.hf_model.model.encoder.layers[i].self_attn.q_proj.weight...)"
    )


# --- sites -----------------------------------------------------------------------------------------------------


def _projections(attn: Any, prefix: str, fam: Family) -> list[nn.Module]:
    """An attention's query, key, value and output linears (an encoder's self-attention: the family's
    ``encoder_attention``)."""
    paths = fam.encoder_attention if prefix.startswith("encoder") else ("q_proj", "k_proj", "v_proj", "out_proj")
    return [attn.get_submodule(path) for path in paths]


def _attention_sites(p: hf.PointChain, attn: Any, prefix: str, heads: int, fam: Family) -> list[Site]:
    *projections, out = _projections(attn, prefix, fam)
    sites: list[Site] = [OutputSite(m, p.new(f"{prefix}.hook_{x}"), heads=heads) for x, m in zip("qkv", projections)]
    scores, pattern = p.new(f"{prefix}.hook_attn_scores"), p.new(f"{prefix}.hook_pattern")
    if fam.block_sparse_encoder and prefix.startswith("encoder"):  # q/k/v: linears the wrapper's inner module shares
        paths = fam.encoder_attention[:3]
        sites = [SharedLinearSite(attn, path, site, prefix) for path, site in zip(paths, sites)]
        sites.append(BigBirdPatternSite(attn, scores, pattern, prefix.removesuffix(".attn")))
    else:
        sites.append(BartPatternSite(attn, scores, pattern, fam.scale_queries_first))
    sites.append(InputSite(out, p.new(f"{prefix}.hook_z"), heads=heads))
    return sites


def _post_ln_block_sites(p: hf.PointChain, block: Any, prefix: str, heads: int, fam: Family) -> list[Site]:
    """A post-LN block: ``mid = ln1(x + attn(x))``, (decoder: ``mid = ln2(mid + cross_attn(mid))``), ``out =
    ln(mid + mlp(mid))``; the residual points are the norms' inputs, as in TransformerLens' ``BertBlock``."""
    decoder = prefix.startswith("decoder")
    sites: list[Site] = [InputSite(block, p.new(f"{prefix}.hook_resid_pre"))]
    sites += _attention_sites(p, block.self_attn, f"{prefix}.attn", heads, fam)
    sites.append(OutputSite(block.self_attn.out_proj, p.new(f"{prefix}.hook_attn_out")))
    sites.append(InputSite(block.self_attn_layer_norm, p.new(f"{prefix}.hook_resid_mid")))
    sites.append(p.norm(block.self_attn_layer_norm, f"{prefix}.ln1"))
    if decoder:
        sites += _attention_sites(p, block.encoder_attn, f"{prefix}.cross_attn", heads, fam)
        sites.append(OutputSite(block.encoder_attn.out_proj, p.new(f"{prefix}.hook_cross_attn_out")))
        sites.append(InputSite(block.encoder_attn_layer_norm, p.new(f"{prefix}.hook_resid_mid_cross")))
        sites.append(p.norm(block.encoder_attn_layer_norm, f"{prefix}.ln2"))
    sites.append(OutputSite(block.fc1, p.new(f"{prefix}.mlp.hook_pre")))
    sites.append(InputSite(block.fc2, p.new(f"{prefix}.mlp.hook_post")))
    sites.append(OutputSite(block.fc2, p.new(f"{prefix}.hook_mlp_out")))
    sites.append(InputSite(block.final_layer_norm, p.new(f"{prefix}.hook_resid_post")))
    sites.append(p.norm(block.final_layer_norm, f"{prefix}.ln3" if decoder else f"{prefix}.ln2"))
    sites.append(OutputSite(block, p.new(f"{prefix}.hook_normalized_resid_post")))
    return sites


def _pre_ln_block_sites(p: hf.PointChain, block: Any, prefix: str, heads: int, fam: Family) -> list[Site]:
    """A pre-LN block: ``mid = x + attn(ln1(x))``, (decoder: ``mid = mid + cross_attn(ln2(mid))``), ``out = mid +
    mlp(ln(mid))``, with T5's (HookedEncoderDecoder's) names; the residual is :class:`PreLNResidualSite`'s."""
    decoder = prefix.startswith("decoder")
    sites: list[Site] = [InputSite(block, p.new(f"{prefix}.hook_resid_pre"))]
    sites.append(p.norm(block.self_attn_layer_norm, f"{prefix}.ln1"))
    sites += _attention_sites(p, block.self_attn, f"{prefix}.attn", heads, fam)
    attn_out, mid = p.new(f"{prefix}.hook_attn_out"), p.new(f"{prefix}.hook_resid_mid")
    out = _projections(block.self_attn, prefix, fam)[-1]
    if decoder:
        stages = [(out, attn_out, block.encoder_attn_layer_norm, mid)]
        sites.append(p.norm(block.encoder_attn_layer_norm, f"{prefix}.ln2"))
        sites += _attention_sites(p, block.encoder_attn, f"{prefix}.cross_attn", heads, fam)
        cross_out, mid_cross = p.new(f"{prefix}.hook_cross_attn_out"), p.new(f"{prefix}.hook_resid_mid_cross")
        stages.append((block.encoder_attn.out_proj, cross_out, block.final_layer_norm, mid_cross))
    else:
        stages = [(out, attn_out, block.final_layer_norm, mid)]
    sites.append(p.norm(block.final_layer_norm, f"{prefix}.ln3" if decoder else f"{prefix}.ln2"))
    sites.append(OutputSite(block.fc1, p.new(f"{prefix}.mlp.hook_pre")))
    sites.append(InputSite(block.fc2, p.new(f"{prefix}.mlp.hook_post")))
    mlp_out, post = p.new(f"{prefix}.hook_mlp_out"), p.new(f"{prefix}.hook_resid_post")
    sites.append(PreLNResidualSite(block, stages, mlp_out, post, prefix, p.hooked.forward_state))
    return sites


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    model: Any = hooked.hf_model
    fam = family(model)
    embeds = [hooked.claim_point("hook_embed")]
    if causal(model):  # the core serves the blocks; the embeddings' sum and its norm are this plugin's
        decoder = model.model.decoder
        pos = hooked.claim_point("hook_pos_embed")
        state = hooked.forward_state
        sites: list[Site] = [_embed_site(fam, "decoder", decoder, embeds[0], pos, type(model).__name__, state)]
        if fam.embed_ln:
            sites.append(hf.PointChain(hooked, "hook_pos_embed").norm(decoder.layernorm_embedding, "embed.ln"))
        if fam.scale_queries_first:  # MVP's own attention code: scores and patterns written out here
            for i, block in enumerate(decoder.layers):
                scores, pattern = (hooked.claim_point(f"blocks.{i}.attn.hook_{n}") for n in ("attn_scores", "pattern"))
                sites.append(BartPatternSite(block.self_attn, scores, pattern, True, core_attention=True))
        return sites
    base: Any = model.model
    heads = hooked.cfg.n_heads
    p = hf.PointChain(hooked, "hook_embed")
    block_sites = _pre_ln_block_sites if fam.pre_ln else _post_ln_block_sites
    sites = []
    for stack in STACKS:
        module = getattr(base, stack)
        lead = "" if stack == "encoder" else "decoder."
        embed = embeds[0] if stack == "encoder" else p.new("decoder.hook_embed")
        pos = p.new(f"{lead}hook_pos_embed")
        sites.append(_embed_site(fam, stack, module, embed, pos, f"model.{stack}", hooked.forward_state))
        if fam.embed_ln:
            sites.append(p.norm(module.layernorm_embedding, f"{lead}embed.ln"))
        for i, block in enumerate(module.layers):
            sites += block_sites(p, block, f"{stack}.{i}", heads, fam)
        if fam.final_norms:
            sites.append(p.norm(getattr(module, fam.final_norm), f"{stack}_final_ln"))
        if stack == "encoder" and fam.block_sparse_encoder:  # every encoder point: the sites since the stack's
            points = tuple(dict.fromkeys(pt for site in sites for pt in site.points))
            sites.append(BlockSparsePadding(module, points, "model.encoder", hooked.forward_state))
    return sites


def _embed_site(fam: Family, name: str, stack: Any, embed: Any, pos: Any, label: str, state: Any) -> Site:
    """Where ``stack`` adds its token embeddings and positions: the input of the module that reads the sum (its
    embedding norm, or its first block), or, where it normalizes the token embeddings first, their outputs."""
    if name == "decoder" and fam.decoder_norm_first:
        return NormFirstEmbedSite(stack, stack.layernorm_embedding, embed, pos, label, state)
    consumer = stack.layernorm_embedding if fam.embed_ln else stack.layers[0]
    return EmbedSumSite(stack, consumer, embed, pos, label, state)


#: what every tiny config of ``bart_config`` shares: 32 positions, BART's special tokens, no dropout
TINY_FIXED: dict[str, Any] = {"max_position_embeddings": 32, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
TINY_FIXED |= {"decoder_start_token_id": 2, "forced_eos_token_id": None}
TINY_FIXED |= dict.fromkeys(("dropout", "attention_dropout", "activation_dropout"), 0.0)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 32, vocabulary 64, 4 heads of 8; seed 0 is a 2-layer BART, other seeds vary the depth (1-3), the
    embedding scale and the activation, deterministically. (``ARCH`` is declared ``encoder_decoder``: the core's
    single-stack matrices and demo leave it out.)"""
    layers, scaled, act = hf.toy_draw(seed, (2, False, "gelu"), [1, 2, 3], 0.5, ["gelu", "relu"])
    return bart_config(layers=layers, heads=4, d_model=32, ffn=64, vocab=64, scale_embedding=scaled, act=act)


def bart_config(
    *,
    layers: int,
    heads: int,
    d_model: int,
    ffn: int,
    vocab: int,
    scale_embedding: bool = False,
    act: str = "gelu",
    model_type: str = "bart",
) -> Any:
    """A config of this family (``model_type``: one of ``FAMILIES``) of these sizes (both stacks alike), no
    dropout, 32 positions."""
    from transformers import AutoConfig

    sizes = {"layers": layers, "attention_heads": heads, "ffn_dim": ffn}
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        d_model=d_model,
        activation_function=act,
        scale_embedding=scale_embedding,
        **{f"{stack}_{k}": v for stack in STACKS for k, v in sizes.items()},
        **TINY_FIXED,
    )
