"""T5 encoder-decoders for lensadapters (``T5ForConditionalGeneration``, the original T5's ReLU MLP and T5 v1.1's
gated-GELU one; transformers 4.57 and 5.x), with TransformerLens 2.18 ``HookedEncoderDecoder``'s points.

Both stacks are pre-norm with T5's RMS norms (no bias, no mean subtraction) and no positional embedding: every
attention adds a relative position bias (layer 0's table of each stack, shared by the stack's layers) and does not
scale ``q kᵀ``. In execution order (``hm.hook_names``)::

    hook_embed                              the encoder's embeddings (what encoder block 0 reads)
    encoder.{i}.hook_resid_pre
    encoder.{i}.ln1.hook_scale/normalized   layer[0].layer_norm (hook_normalized: before the weight, as TL's RMSNorm)
    encoder.{i}.attn.hook_q/k/v             SelfAttention.q/k/v outputs per head
    encoder.{i}.attn.hook_attn_scores       q kᵀ + the relative position bias + the mask (finfo.min at padding keys)
    encoder.{i}.attn.hook_pattern           the softmax
    encoder.{i}.attn.hook_z                 the heads' mix (the input of SelfAttention.o)
    encoder.{i}.hook_attn_out               SelfAttention.o's output through layer[0]'s dropout
    encoder.{i}.hook_resid_mid              resid_pre + attn_out (layer[0]'s output)
    encoder.{i}.ln2.hook_scale/normalized   layer[1].layer_norm
    encoder.{i}.mlp.hook_pre                wi's output (gated: wi_0's, before the activation)
    encoder.{i}.mlp.hook_pre_linear         gated only: wi_1's output
    encoder.{i}.mlp.hook_post               the input of wo (act(pre), gated: act(pre) * pre_linear)
    encoder.{i}.hook_mlp_out                wo's output through layer[1]'s dropout
    encoder.{i}.hook_resid_post             the block output
    encoder_final_ln.hook_scale/normalized  encoder.final_layer_norm (its output, through the encoder's dropout, is
                                            what every cross-attention reads)
    decoder.hook_embed                      the decoder's embeddings (what decoder block 0 reads; lensadapters' own)
    decoder.{i}.hook_resid_pre ... hook_resid_mid   as the encoder's, causal self-attention
    decoder.{i}.ln2.hook_scale/normalized   layer[1].layer_norm (before cross-attention)
    decoder.{i}.cross_attn.hook_q/k/v/attn_scores/pattern/z   EncDecAttention (keys and values from the encoder
                                            output, no position bias, the encoder's padding masked)
    decoder.{i}.hook_cross_attn_out         EncDecAttention.o's output through layer[1]'s dropout
    decoder.{i}.hook_resid_mid_cross        resid_mid + cross_attn_out
    decoder.{i}.ln3.hook_scale/normalized   layer[2].layer_norm
    decoder.{i}.mlp.* ... hook_resid_post   as the encoder's
    decoder_final_ln.hook_scale/normalized  decoder.final_layer_norm

The logits are ``lm_head(decoder_final_ln(x) * d_model**-0.5)`` when the model rescales its decoder output (tied
embeddings: ``config.tie_word_embeddings`` in transformers 4.x, ``config.scale_decoder_outputs`` in 5.x), else
``lm_head(decoder_final_ln(x))``; the factor is applied in ``T5ForConditionalGeneration.forward`` between the final
norm and ``lm_head`` (``cfg.extra["unembed_scale"]``). ``W_U`` is ``lm_head``'s weight.

Scores and patterns are served per hooked attention module: while one of them has a hook, that instance's
``forward`` (only that instance's: the class is untouched) computes attention written out, with the module's own
``q``/``k``/``v``/``o`` layers and the model's key/value cache.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lensadapters import hf
from lensadapters.plugin_api import (
    Architecture,
    HookPoint,
    InputSite,
    ModelLayout,
    NormSpec,
    OutputSite,
    Site,
    UnsupportedModelError,
    WeightUnavailableError,
    first_input,
    hookimpl,
    override_instance_method,
    replace_first_input,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
#: what every tiny T5 config of the plugin, its test kit and its tests sets: no dropout, T5's generation ids
TINY_FIELDS: dict[str, Any] = dict(dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
#: transformers 4.x's T5 computes attention in its own code (eager only); 5.x's through the attention interface
TRANSFORMERS_4 = __import__("transformers").__version__.startswith("4.")
ARCH = hf.architecture(
    "t5",
    "T5 encoder-decoders (relative position bias, RMS norms, ReLU or gated-GELU MLPs) with HookedEncoderDecoder's "
    "points",
    encoder_decoder=True,
)
hf.plugin_module(globals(), ARCH, hookspec="1", contract="T5Contract")
STACKS = ("encoder", "decoder")


# --- description ---------------------------------------------------------------------------------------------


def unembed_scale(model: Any) -> float:
    """The factor ``T5ForConditionalGeneration.forward`` multiplies the decoder output by before ``lm_head``."""
    c = model.config
    scales = getattr(c, "scale_decoder_outputs", None)  # transformers 5.x
    if scales is None:
        scales = getattr(c, "tie_word_embeddings", False)  # transformers 4.x
    return float(c.d_model**-0.5) if scales else 1.0


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    for stack in STACKS:
        if not isinstance(getattr(model, stack, None), nn.Module):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no {stack!r} stack: lensadapters-t5 serves encoder-decoders "
                f"(T5ForConditionalGeneration, HookedEncoderDecoder's points)"
            )
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no lm_head: lensadapters-t5 serves T5ForConditionalGeneration"
        )
    c = model.config
    if c.num_decoder_layers != c.num_layers:
        raise UnsupportedModelError(
            f"num_layers={c.num_layers} encoder blocks but num_decoder_layers={c.num_decoder_layers}: "
            f"HookedEncoderDecoder's cfg.n_layers counts both stacks; lensadapters-t5 serves equal depths"
        )
    encoder: Any = model.encoder
    if getattr(encoder.block[0].layer[0].SelfAttention, "pruned_heads", None):
        raise UnsupportedModelError("pruned attention heads: lensadapters-t5 serves unpruned models")


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """T5's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): RMS norms, relative position bias, the
    encoder-decoder's settings."""
    c = model.config
    return dict(
        # transformers' usual size names, which T5's config maps to its own (num_layers, d_model, num_heads, d_kv)
        d_mlp=c.d_ff,
        n_ctx=int(getattr(c, "n_positions", 512) or 512),
        act_fn=str(c.dense_act_fn),
        normalization_type="RMS",
        positional_embedding_type="relative_positional_bias",  # TransformerLens' value
        gated_mlp=bool(c.is_gated_act),
        eps=float(c.layer_norm_epsilon),
        attention_dir="bidirectional",  # HookedEncoderDecoder's; the decoder's self-attention is causal
        extra={
            "encoder_decoder": True,
            "relative_attention_num_buckets": c.relative_attention_num_buckets,
            "relative_attention_max_distance": c.relative_attention_max_distance,
            "unembed_scale": unembed_scale(model),
            "decoder_start_token_id": c.decoder_start_token_id,
        },
    )


lensadapters_config = hf.hooked_config(_config_fields)


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    # the encoder's blocks are the model's blocks (opaque: this plugin serves every point); hook_embed is served
    # at encoder block 0's input (the shared embedding module runs for the decoder as well)
    return ModelLayout(blocks="encoder.block", embed="shared", unembed="lm_head")


# every block is opaque: the points are this plugin's (HookedEncoderDecoder's names)
lensadapters_block, lensadapters_attn_qkv, lensadapters_mlp_act = hf.opaque_blocks()


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    """``T5LayerNorm``: an RMS norm (``x * rsqrt(mean(x²) + eps) * weight``, the mean in float32)."""
    if type(module).__name__ == "T5LayerNorm":
        return NormSpec("RMS", float(module.variance_epsilon), module.weight)  # type: ignore[arg-type]
    return None


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Any:
    """``W_E`` (the shared embeddings) and ``W_U``/``b_U`` (``lm_head``) are the core's; the per-block weights are
    refused by name: HookedModel's ``W_Q``... stack one stack of blocks, and T5 has two."""
    if name in ("W_E", "W_U", "b_U"):
        return None
    raise WeightUnavailableError(
        f"{name}: the stacked per-block weights (W_Q, W_O, W_in...) index one stack of blocks; "
        f"{type(hooked.hf_model).__name__} is an encoder-decoder with two: read a block's modules "
        f"(hm.hf_model.encoder.block[i].layer[0].SelfAttention.q.weight...)"
    )


# --- sites -----------------------------------------------------------------------------------------------------


class FirstBlockInputSite(Site):
    """A stack's embeddings at its first block's input (a forward pre-hook placed before every other one, so
    ``hook_embed`` fires before the block's ``hook_resid_pre``)."""

    def __init__(self, block: nn.Module, point: HookPoint) -> None:
        self.block, self.point = block, point
        self.points = (point,)

    def install(self) -> list[Any]:
        return [self.block.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value, changed = self.point.apply(first_input(args, kwargs))
        return replace_first_input(args, kwargs, value) if changed else None


def _legacy(module: nn.Module) -> bool:
    """Whether the attention module has transformers 4.x's signature (``past_key_values``, the mask folded into
    the position bias it returns) rather than 5.x's (``cache``, the mask passed on separately)."""
    return "past_key_values" in inspect.signature(type(module).forward).parameters


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """An attention mask as the additive float mask eager attention uses (``finfo.min`` where masked)."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


class T5PatternSite(Site):
    """``attn.hook_attn_scores``/``attn.hook_pattern`` (or ``cross_attn.``'s) of one ``T5Attention``: while hooked,
    the instance's ``forward`` computes attention written out (see the module docstring)."""

    def __init__(self, module: nn.Module, scores: HookPoint, pattern: HookPoint) -> None:
        self.module, self.scores, self.pattern = module, scores, pattern
        self.points = (scores, pattern)

    def install(self) -> list[Any]:
        return [
            override_instance_method(
                self.module, "forward", self._forward_legacy if _legacy(self.module) else self._forward
            )
        ]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        m: Any = self.module
        scores = torch.matmul(q, k.transpose(3, 2)) + bias
        if mask is not None:
            scores = scores + mask
        scores, _ = self.scores.apply(scores)
        pattern = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        pattern = nn.functional.dropout(
            pattern, p=m.dropout if isinstance(m.dropout, float) else 0.0, training=m.training
        )
        pattern, _ = self.pattern.apply(pattern)
        return torch.matmul(pattern, v), pattern

    def _kv(self, current: Tensor, cache: Any, is_cross: bool, update: Any) -> tuple[Tensor, Tensor]:
        """Keys and values, through the model's cache as ``T5Attention.forward`` uses it."""
        from transformers.cache_utils import EncoderDecoderCache

        m: Any = self.module
        b = current.shape[0]
        curr = cache
        if isinstance(cache, EncoderDecoderCache):
            curr = cache.cross_attention_cache if is_cross else cache.self_attention_cache
            if is_cross and cache.is_updated.get(m.layer_idx):
                return curr.layers[m.layer_idx].keys, curr.layers[m.layer_idx].values
        k = m.k(current).view(b, -1, m.n_heads, m.key_value_proj_dim).transpose(1, 2)
        v = m.v(current).view(b, -1, m.n_heads, m.key_value_proj_dim).transpose(1, 2)
        if cache is not None:
            k, v = update(curr, k, v)
            if is_cross and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[m.layer_idx] = True
        return k, v

    def _queries(self, hidden_states: Tensor) -> Tensor:
        m: Any = self.module
        b = hidden_states.shape[0]
        return m.q(hidden_states).view(b, -1, m.n_heads, m.key_value_proj_dim).transpose(1, 2)

    def _out(self, z: Tensor, shape: tuple[int, ...]) -> Tensor:
        m: Any = self.module
        return m.o(z.transpose(1, 2).contiguous().reshape(*shape, -1).contiguous())

    def _forward(
        self,
        hidden_states: Tensor,
        mask: Optional[Tensor] = None,
        key_value_states: Optional[Tensor] = None,
        position_bias: Optional[Tensor] = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """transformers 5.x's ``T5Attention.forward``, attention written out."""
        m: Any = self.module
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        shape = tuple(hidden_states.shape[:-1])
        past = cache.get_seq_length(m.layer_idx) if cache is not None else 0
        past = past.clone() if isinstance(past, Tensor) else past
        is_cross = key_value_states is not None
        q = self._queries(hidden_states)
        k, v = self._kv(
            hidden_states if key_value_states is None else key_value_states,
            cache,
            is_cross,
            lambda curr, k, v: curr.update(k, v, m.layer_idx, kwargs=kwargs),
        )
        if position_bias is None:
            if not m.has_relative_attention_bias:
                position_bias = torch.zeros((1, m.n_heads, shape[1], k.shape[-2]), device=q.device, dtype=q.dtype)
            else:
                position_bias = m.compute_bias(shape[1], k.shape[-2], device=q.device, past_seen_tokens=past)
        if mask is None and m.is_causal and not is_cross and shape[1] > 1:  # sdpa's implicit causal mask
            keys = torch.arange(k.shape[-2], device=q.device)
            queries = torch.arange(shape[1], device=q.device)[:, None] + (k.shape[-2] - shape[1])
            mask = keys[None, :] <= queries
        additive = None if mask is None else _additive(mask, q.dtype)
        z, pattern = self._attend(q, k, v, position_bias, additive)
        return self._out(z, shape), position_bias, pattern

    def _forward_legacy(
        self,
        hidden_states: Tensor,
        mask: Optional[Tensor] = None,
        key_value_states: Optional[Tensor] = None,
        position_bias: Optional[Tensor] = None,
        past_key_values: Any = None,
        layer_head_mask: Optional[Tensor] = None,
        query_length: Optional[int] = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        cache_position: Optional[Tensor] = None,
    ) -> tuple[Tensor, ...]:
        """transformers 4.x's ``T5Attention.forward`` (the mask folded into the position bias it returns), attention
        written out."""
        m: Any = self.module
        shape = tuple(hidden_states.shape[:-1])
        is_cross = key_value_states is not None
        q = self._queries(hidden_states)
        position = None if is_cross else cache_position
        k, v = self._kv(
            hidden_states if key_value_states is None else key_value_states,
            past_key_values,
            is_cross,
            lambda curr, k, v: curr.update(k, v, m.layer_idx, {"cache_position": position}),
        )
        if position_bias is None:
            key_length = k.shape[-2]
            if not m.has_relative_attention_bias:
                position_bias = torch.zeros((1, m.n_heads, shape[1], key_length), device=q.device, dtype=q.dtype)
            else:
                real = query_length if query_length is not None else cache_position[-1] + 1  # type: ignore[index]
                position_bias = m.compute_bias(real, key_length, device=q.device, cache_position=cache_position)
                position_bias = position_bias[:, :, -shape[1] :, :]
            if mask is not None:
                position_bias = position_bias + mask[:, :, :, :key_length]
        if layer_head_mask is not None:
            raise UnsupportedModelError(
                "lensadapters-t5's attention scores and patterns do not take a head mask (head_mask=...): "
                "call without it, or unhook the scores and patterns"
            )
        z, pattern = self._attend(q, k, v, position_bias, None)
        out = (self._out(z, shape), position_bias)
        return out + (pattern,) if output_attentions else out


def _attention_sites(p: hf.PointChain, attn: Any, prefix: str, heads: int) -> list[Site]:
    sites: list[Site] = [OutputSite(getattr(attn, x), p.new(f"{prefix}.hook_{x}"), heads=heads) for x in "qkv"]
    sites.append(T5PatternSite(attn, p.new(f"{prefix}.hook_attn_scores"), p.new(f"{prefix}.hook_pattern")))
    sites.append(InputSite(attn.o, p.new(f"{prefix}.hook_z"), heads=heads))
    return sites


def _mlp_sites(p: hf.PointChain, ff: Any, prefix: str) -> list[Site]:
    dense = ff.DenseReluDense
    if hasattr(dense, "wi_0"):  # T5 v1.1's gated MLP: act(wi_0 x) * wi_1 x
        sites: list[Site] = [OutputSite(dense.wi_0, p.new(f"{prefix}.mlp.hook_pre"))]
        sites.append(OutputSite(dense.wi_1, p.new(f"{prefix}.mlp.hook_pre_linear")))
    else:
        sites = [OutputSite(dense.wi, p.new(f"{prefix}.mlp.hook_pre"))]
    sites.append(InputSite(dense.dropout, p.new(f"{prefix}.mlp.hook_post")))
    sites.append(OutputSite(ff.dropout, p.new(f"{prefix}.hook_mlp_out")))
    return sites


def _block_sites(p: hf.PointChain, block: Any, prefix: str, heads: int, decoder: bool) -> list[Site]:
    self_attn = block.layer[0]
    sites: list[Site] = [InputSite(block, p.new(f"{prefix}.hook_resid_pre"))]
    sites.append(p.norm(self_attn.layer_norm, f"{prefix}.ln1"))
    sites += _attention_sites(p, self_attn.SelfAttention, f"{prefix}.attn", heads)
    sites.append(OutputSite(self_attn.dropout, p.new(f"{prefix}.hook_attn_out")))
    sites.append(OutputSite(self_attn, p.new(f"{prefix}.hook_resid_mid")))
    if decoder:
        cross = block.layer[1]
        sites.append(p.norm(cross.layer_norm, f"{prefix}.ln2"))
        sites += _attention_sites(p, cross.EncDecAttention, f"{prefix}.cross_attn", heads)
        sites.append(OutputSite(cross.dropout, p.new(f"{prefix}.hook_cross_attn_out")))
        sites.append(OutputSite(cross, p.new(f"{prefix}.hook_resid_mid_cross")))
    ff = block.layer[-1]
    sites.append(p.norm(ff.layer_norm, f"{prefix}.ln3" if decoder else f"{prefix}.ln2"))
    sites += _mlp_sites(p, ff, prefix)
    sites.append(OutputSite(block, p.new(f"{prefix}.hook_resid_post")))
    return sites


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    model: Any = hooked.hf_model
    heads = hooked.cfg.n_heads
    sites: list[Site] = [FirstBlockInputSite(model.encoder.block[0], hooked.claim_point("hook_embed"))]
    p = hf.PointChain(hooked, "hook_embed")
    for stack in STACKS:
        module = getattr(model, stack)
        if stack == "decoder":
            sites.append(FirstBlockInputSite(module.block[0], p.new("decoder.hook_embed")))
        for i, block in enumerate(module.block):
            sites += _block_sites(p, block, f"{stack}.{i}", heads, decoder=stack == "decoder")
        sites.append(p.norm(module.final_layer_norm, f"{stack}_final_ln"))
    return sites


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 32, vocabulary 64, 4 heads of 8; seed 0 is a 2-layer T5 (ReLU MLP), other seeds vary the depth (1-3),
    the MLP (T5 v1.1's gated GELU) and the relative-position buckets, deterministically. (``ARCH`` is declared
    ``encoder_decoder``: the core's single-stack matrices and demo leave it out.)"""
    from transformers import T5Config

    layers, gated, buckets = hf.toy_draw(seed, (2, False, 8), [1, 2, 3], 0.5, [4, 8, 16])
    return hf.tiny_config_of(  # TINY_SIZES' width 32, 4 heads, vocabulary 64 under T5's names (d_model...)
        T5Config,
        layers=layers,
        d_kv=8,
        d_ff=64,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu" if gated else "relu",
        **TINY_FIELDS,
    )
