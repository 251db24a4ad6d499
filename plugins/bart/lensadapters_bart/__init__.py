"""BART encoder-decoders for lensadapters (``BartForConditionalGeneration``; transformers 4.57 and 5.x), with
TransformerLens 2.18 ``HookedEncoderDecoder``'s names (TransformerLens 2.18 has no BART).

Both stacks read token embeddings (times ``sqrt(d_model)`` where ``config.scale_embedding``) plus learned positions
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

Scores and patterns are served per hooked attention module: while one of them has a hook, that instance's
``forward`` (only that instance's: the class is untouched) computes attention written out, with the module's own
projections and the model's key/value cache.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lensadapters import hf
from lensadapters.plugin_api import (
    Architecture,
    HookedConfig,
    HookPoint,
    InputSite,
    ModelLayout,
    OutputSite,
    Site,
    UnsupportedModelError,
    WeightUnavailableError,
    hookimpl,
    override_instance_method,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
# the contract suite `lensadapters check bart` runs (imported only then: it needs lensadapters[testing])
LENSADAPTERS_CONTRACT = "lensadapters_bart.testing:BartContract"
ARCH = Architecture(
    name="bart",
    model_types=("bart",),
    description="BART encoder-decoders (learned positions with BART's offset of 2, post-LN blocks, biases, "
    "final_logits_bias) with HookedEncoderDecoder's names",
    transformers=">=4.57,<6",
    attn_implementations=("eager", "sdpa"),
    encoder_decoder=True,
)
STACKS = ("encoder", "decoder")
#: BartLearnedPositionalEmbedding reads row ``position + 2`` of its table
POSITION_OFFSET = 2


# --- description ---------------------------------------------------------------------------------------------


lensadapters_architectures = hf.claims(ARCH)


def _stacks(model: Any) -> Any:
    return getattr(model, "model", None)


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    base = _stacks(model)
    for stack in STACKS:
        if not isinstance(getattr(base, stack, None), nn.Module):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no model.{stack}: lensadapters-bart serves encoder-decoders "
                f"(BartForConditionalGeneration, HookedEncoderDecoder's names)"
            )
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no lm_head: lensadapters-bart serves BartForConditionalGeneration"
        )
    c = model.config
    if (c.encoder_layers, c.encoder_attention_heads, c.encoder_ffn_dim) != (
        c.decoder_layers,
        c.decoder_attention_heads,
        c.decoder_ffn_dim,
    ):
        raise UnsupportedModelError(
            f"encoder (layers, heads, ffn) = {(c.encoder_layers, c.encoder_attention_heads, c.encoder_ffn_dim)} but "
            f"decoder {(c.decoder_layers, c.decoder_attention_heads, c.decoder_ffn_dim)}: HookedEncoderDecoder's cfg "
            f"describes both stacks at once; lensadapters-bart serves equal stacks"
        )
    if not isinstance(base.encoder.embed_positions, nn.Embedding):
        raise UnsupportedModelError(
            f"{type(base.encoder.embed_positions).__name__}: lensadapters-bart serves learned positions"
        )


@hookimpl
def lensadapters_config(arch: Architecture, model: PreTrainedModel) -> HookedConfig:
    c = model.config
    return HookedConfig(
        n_layers=c.encoder_layers,
        d_model=c.d_model,
        n_heads=c.encoder_attention_heads,
        d_head=c.d_model // c.encoder_attention_heads,
        d_mlp=c.encoder_ffn_dim,
        d_vocab=c.vocab_size,
        n_ctx=int(c.max_position_embeddings),
        act_fn=str(c.activation_function),
        normalization_type="LN",
        positional_embedding_type="standard",
        model_type=c.model_type,
        eps=float(_stacks(model).encoder.layernorm_embedding.eps),
        original_architecture=type(model).__name__,
        attention_dir="bidirectional",  # HookedEncoderDecoder's; the decoder's self-attention is causal
        extra={
            "encoder_decoder": True,
            "post_ln": True,
            "position_offset": POSITION_OFFSET,
            "embed_scale": math.sqrt(c.d_model) if c.scale_embedding else 1.0,
            "decoder_start_token_id": c.decoder_start_token_id,
        },
    )


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    # the encoder's blocks are the model's blocks (opaque: this plugin serves every point)
    c = model.config
    scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
    return ModelLayout(blocks="model.encoder.layers", embed="model.shared", unembed="lm_head", embed_scale=scale)


# every block is opaque: the points are this plugin's (HookedEncoderDecoder's names)
lensadapters_block, lensadapters_attn_qkv, lensadapters_mlp_act = hf.opaque_blocks()


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Any:
    """``W_E`` (the shared embeddings, times the embedding scale) and ``W_U`` (``lm_head``) are the core's; ``b_U``
    is ``final_logits_bias``, ``W_pos`` the encoder's position table without its first two rows (BART's offset);
    the per-block weights are refused by name: HookedModel's ``W_Q``... stack one stack of blocks, and BART has
    two."""
    model: Any = hooked.hf_model
    if name in ("W_E", "W_U"):
        return None
    if name == "b_U":
        return model.final_logits_bias[0]
    if name == "W_pos":
        return model.model.encoder.embed_positions.weight[POSITION_OFFSET:]
    raise WeightUnavailableError(
        f"{name}: the stacked per-block weights (W_Q, W_O, W_in...) index one stack of blocks; "
        f"{type(model).__name__} is an encoder-decoder with two: read a block's modules "
        f"(hm.hf_model.model.encoder.layers[i].self_attn.q_proj.weight...)"
    )


# --- sites -----------------------------------------------------------------------------------------------------


class StackEmbedSite(Site):
    """Each stack's token embeddings (``hook_embed``, ``decoder.hook_embed``): the output of the stack's
    ``embed_tokens``, told apart by the stack that is running (both stacks may call one shared module, as after
    ``set_input_embeddings``)."""

    def __init__(self, base: Any, points: dict[str, HookPoint]) -> None:
        self.base, self.by_stack = base, points
        self.points = tuple(points.values())
        self.running: Optional[str] = None

    def install(self) -> list[Any]:
        handles = []
        for stack in STACKS:
            handles.append(getattr(self.base, stack).register_forward_pre_hook(self._enter(stack)))
        embeds = {id(getattr(self.base, s).embed_tokens): getattr(self.base, s).embed_tokens for s in STACKS}
        handles += [module.register_forward_hook(self._hook) for module in embeds.values()]
        return handles

    def _enter(self, stack: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.running = stack

        return hook

    def _hook(self, module: nn.Module, args: tuple, output: Tensor) -> Optional[Tensor]:
        if self.running is None:
            return None
        value, changed = self.by_stack[self.running].apply(output)
        return value if changed else None


class PositionSite(Site):
    """``hook_pos_embed`` (``decoder.hook_pos_embed``): ``embed_positions``' output, shown ``[batch, pos, d_model]``
    (the module returns one row for the whole batch when it is given the cache positions, as the decoder does in
    transformers 5.x); an edit is added per row."""

    def __init__(self, module: nn.Module, point: HookPoint) -> None:
        self.module, self.point = module, point
        self.points = (point,)

    def install(self) -> list[Any]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Tensor) -> Optional[Tensor]:
        batch = args[0].shape[0]
        shown = output.expand(batch, *output.shape[1:]) if output.shape[0] != batch else output
        value, changed = self.point.apply(shown)
        return value if changed else None


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """An attention mask as the additive float mask eager attention uses (``finfo.min`` where masked)."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


class BartPatternSite(Site):
    """``attn.hook_attn_scores``/``attn.hook_pattern`` (or ``cross_attn.``'s) of one ``BartAttention``: while
    hooked, the instance's ``forward`` computes attention written out (see the module docstring)."""

    def __init__(self, module: nn.Module, scores: HookPoint, pattern: HookPoint) -> None:
        self.module, self.scores, self.pattern = module, scores, pattern
        self.points = (scores, pattern)
        # transformers 5.x's signature takes ``cache`` (and passes the cache's keywords on); 4.x's
        # ``past_key_values``, ``layer_head_mask`` and ``cache_position``
        self.legacy = "cache" not in inspect.signature(type(module).forward).parameters

    def install(self) -> list[Any]:
        return [override_instance_method(self.module, "forward", self._forward)]

    def _kv(self, current: Tensor, cache: Any, is_cross: bool, extra: dict) -> tuple[Tensor, Tensor]:
        """Keys and values, through the model's cache as ``BartAttention.forward`` uses it."""
        from transformers.cache_utils import EncoderDecoderCache

        m: Any = self.module
        curr = cache
        if isinstance(cache, EncoderDecoderCache):
            curr = cache.cross_attention_cache if is_cross else cache.self_attention_cache
            if is_cross and cache.is_updated.get(m.layer_idx):
                return curr.layers[m.layer_idx].keys, curr.layers[m.layer_idx].values
        shape = (*current.shape[:-1], -1, m.head_dim)
        k = m.k_proj(current).view(shape).transpose(1, 2)
        v = m.v_proj(current).view(shape).transpose(1, 2)
        if cache is not None:
            if self.legacy:
                k, v = curr.update(k, v, m.layer_idx, {"cache_position": None if is_cross else extra.get("position")})
            else:
                k, v = curr.update(k, v, m.layer_idx, kwargs=extra)
            if is_cross and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[m.layer_idx] = True
        return k, v

    def _forward(
        self,
        hidden_states: Tensor,
        key_value_states: Optional[Tensor] = None,
        cache: Any = None,
        attention_mask: Optional[Tensor] = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        """``BartAttention.forward`` (transformers 4.57 and 5.x), attention written out."""
        m: Any = self.module
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if kwargs.pop("layer_head_mask", None) is not None:
            raise UnsupportedModelError(
                "lensadapters-bart's attention scores and patterns do not take a head mask (head_mask=...): "
                "call without it, or unhook the scores and patterns"
            )
        kwargs.pop("output_attentions", None)
        position = kwargs.pop("cache_position", None)
        shape = tuple(hidden_states.shape[:-1])
        is_cross = key_value_states is not None
        q = m.q_proj(hidden_states).view(*shape, -1, m.head_dim).transpose(1, 2)
        extra = {"position": position} if self.legacy else kwargs
        k, v = self._kv(hidden_states if key_value_states is None else key_value_states, cache, is_cross, extra)
        mask = attention_mask
        if mask is None and m.is_causal and not is_cross and shape[1] > 1:  # sdpa's implicit causal mask
            keys = torch.arange(k.shape[-2], device=q.device)
            queries = torch.arange(shape[1], device=q.device)[:, None] + (k.shape[-2] - shape[1])
            mask = keys[None, :] <= queries
        scores = torch.matmul(q, k.transpose(2, 3)) * m.scaling
        if mask is not None:
            scores = scores + _additive(mask, q.dtype)[..., : k.shape[-2]]
        scores, _ = self.scores.apply(scores)
        pattern = nn.functional.softmax(scores, dim=-1)
        pattern = nn.functional.dropout(pattern, p=m.dropout, training=m.training)
        pattern, _ = self.pattern.apply(pattern)
        z = torch.matmul(pattern, v).transpose(1, 2).contiguous()
        return m.out_proj(z.reshape(*shape, -1).contiguous()), pattern


def _attention_sites(p: hf.PointChain, attn: Any, prefix: str, heads: int) -> list[Site]:
    projections = [getattr(attn, f"{x}_proj") for x in "qkv"]
    sites: list[Site] = [OutputSite(m, p.new(f"{prefix}.hook_{x}"), heads=heads) for x, m in zip("qkv", projections)]
    sites.append(BartPatternSite(attn, p.new(f"{prefix}.hook_attn_scores"), p.new(f"{prefix}.hook_pattern")))
    sites.append(InputSite(attn.out_proj, p.new(f"{prefix}.hook_z"), heads=heads))
    return sites


def _block_sites(p: hf.PointChain, block: Any, prefix: str, heads: int, decoder: bool) -> list[Site]:
    """A post-LN block: ``mid = ln1(x + attn(x))``, (decoder: ``mid = ln2(mid + cross_attn(mid))``), ``out =
    ln(mid + mlp(mid))``; the residual points are the norms' inputs, as in TransformerLens' ``BertBlock``."""
    sites: list[Site] = [InputSite(block, p.new(f"{prefix}.hook_resid_pre"))]
    sites += _attention_sites(p, block.self_attn, f"{prefix}.attn", heads)
    sites.append(OutputSite(block.self_attn.out_proj, p.new(f"{prefix}.hook_attn_out")))
    sites.append(InputSite(block.self_attn_layer_norm, p.new(f"{prefix}.hook_resid_mid")))
    sites.append(p.norm(block.self_attn_layer_norm, f"{prefix}.ln1"))
    if decoder:
        sites += _attention_sites(p, block.encoder_attn, f"{prefix}.cross_attn", heads)
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


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    base: Any = hooked.hf_model.model
    heads = hooked.cfg.n_heads
    embeds = {"encoder": hooked.claim_point("hook_embed")}
    p = hf.PointChain(hooked, "hook_embed")
    sites: list[Site] = []
    for stack in STACKS:
        module = getattr(base, stack)
        prefix = "" if stack == "encoder" else "decoder."
        if stack == "decoder":
            embeds["decoder"] = p.new("decoder.hook_embed")
        sites.append(PositionSite(module.embed_positions, p.new(f"{prefix}hook_pos_embed")))
        sites.append(p.norm(module.layernorm_embedding, f"{prefix}embed.ln"))
        for i, block in enumerate(module.layers):
            sites += _block_sites(p, block, f"{stack}.{i}", heads, decoder=stack == "decoder")
    return [StackEmbedSite(base, embeds), *sites]


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 32, vocabulary 64, 4 heads of 8; seed 0 is a 2-layer BART, other seeds vary the depth (1-3), the
    embedding scale and the activation, deterministically. (``ARCH`` is declared ``encoder_decoder``: the core's
    single-stack matrices and demo leave it out.)"""
    layers, scaled, act = hf.toy_draw(seed, (2, False, "gelu"), [1, 2, 3], 0.5, ["gelu", "relu"])
    return bart_config(layers=layers, heads=4, d_model=32, ffn=64, vocab=64, scale_embedding=scaled, act=act)


def bart_config(
    *, layers: int, heads: int, d_model: int, ffn: int, vocab: int, scale_embedding: bool = False, act: str = "gelu"
) -> Any:
    """A BART config of these sizes (both stacks alike), no dropout, 32 positions."""
    from transformers import BartConfig

    return BartConfig(
        vocab_size=vocab,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=32,
        activation_function=act,
        scale_embedding=scale_embedding,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
