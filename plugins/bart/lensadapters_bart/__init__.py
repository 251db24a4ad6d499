"""The BART family for lensadapters (transformers 4.57 and 5.x): BART, PLBart, mBART, Marian, Pegasus, Blenderbot
and MVP, declared by what each changes of BART (``FAMILIES``). Their ``*ForConditionalGeneration`` get TransformerLens
2.18 ``HookedEncoderDecoder``'s names (TransformerLens 2.18 has none of them); their ``*ForCausalLM`` (the decoder
alone) the core's decoder-only points, described by ``lensadapters_block``... (post-LN with ``BertBlock``'s points).

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

Scores and patterns are served per hooked attention module: while one of them has a hook, that instance's
``forward`` (only that instance's: the class is untouched) computes attention written out, with the module's own
projections and the model's key/value cache.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lensadapters import hf
from lensadapters.plugin_api import (
    Architecture,
    BlockLayout,
    HookedConfig,
    HookPoint,
    InputSite,
    MLPLayout,
    ModelLayout,
    OutputSite,
    SeparateQKV,
    Site,
    UnsupportedModelError,
    WeightUnavailableError,
    explicit_attention,
    first_input,
    first_output,
    hookimpl,
    is_recomputing,
    override_instance_method,
    replace_first_output,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
# the contract suite `lensadapters check bart` runs (imported only then: it needs lensadapters[testing])
LENSADAPTERS_CONTRACT = "lensadapters_bart.testing:BartContract"


@dataclass(frozen=True)
class Family:
    """What a BART-shaped family changes of BART, as transformers' modelling code builds it (checked against the
    modules at wrap time)."""

    name: str
    """The class prefix (``MBart``: ``MBartForConditionalGeneration``, ``MBartForCausalLM``)."""
    pre_ln: bool
    """Pre-LN blocks (``x + attn(ln1(x))``...) instead of BART's post-LN ones (``ln1(x + attn(x))``...)."""
    embed_ln: bool
    """A LayerNorm (``layernorm_embedding``) on token embeddings + positions, before the first block."""
    final_norms: bool
    """A LayerNorm (``layer_norm``) after each stack's last block."""
    positions: str
    """``"learned"`` (a table with BART's offset of 2 rows) or ``"sinusoidal"`` (a fixed table, no offset)."""
    scale_in_module: bool
    """``embed_tokens`` itself multiplies by the embedding scale (``*ScaledWordEmbedding``); otherwise the stack
    multiplies its output (``embed_tokens(ids) * self.embed_scale``)."""
    scale_queries_first: bool = False
    """The attention multiplies the queries by ``d_head**-0.5`` before ``q kᵀ`` (MVP's own attention code) instead of
    scaling the product (the attention functions BART calls)."""


#: the families served, by ``model_type``; ``offset`` of learned positions is the module's own
FAMILIES = {
    "bart": Family("Bart", pre_ln=False, embed_ln=True, final_norms=False, positions="learned", scale_in_module=True),
    "plbart": Family("PLBart", False, True, False, "learned", True),
    "mbart": Family("MBart", True, True, True, "learned", True),
    "marian": Family("Marian", False, False, False, "sinusoidal", False),
    "pegasus": Family("Pegasus", True, False, True, "sinusoidal", False),
    "blenderbot": Family("Blenderbot", True, False, True, "learned", True),
    # MVP without its prompts (use_prompt=False)
    "mvp": Family("Mvp", False, True, False, "learned", False, scale_queries_first=True),
}
ARCH = hf.architecture(
    "bart",
    "BART-shaped encoder-decoders (BART, PLBart, mBART, Marian, Pegasus, Blenderbot, MVP: learned or sinusoidal "
    "positions, post- or pre-LN blocks, biases, final_logits_bias) with HookedEncoderDecoder's names, and their "
    "*ForCausalLM (the decoder alone) with TransformerLens' decoder-only names",
    model_types=tuple(FAMILIES),
    encoder_decoder=True,
)
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


def position_offset(stack: Any) -> int:
    """The rows before position 0 of a stack's position table (BART's learned positions: 2)."""
    return int(getattr(stack.embed_positions, "offset", 0))


def outside_scale(stack: Any) -> Optional[float]:
    """The factor a stack multiplies ``embed_tokens``' output by itself (``None`` where the module applies it)."""
    return None if hasattr(stack.embed_tokens, "embed_scale") else float(getattr(stack, "embed_scale", 1.0))


def embed_scale(model: Any) -> float:
    return math.sqrt(model.config.d_model) if model.config.scale_embedding else 1.0


# --- description ---------------------------------------------------------------------------------------------


lensadapters_architectures = hf.claims(ARCH)


def _check_family(model: Any, fam: Family, stack_name: str, stack: nn.Module) -> None:
    """The family's declared differences, checked against the stack's modules."""
    found = {
        "embed_ln": isinstance(getattr(stack, "layernorm_embedding", None), nn.LayerNorm),
        "final_norms": isinstance(getattr(stack, "layer_norm", None), nn.LayerNorm),
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
            ln_final="model.decoder.layer_norm" if fam.final_norms else None,
            unembed="lm_head",
            embed_scale=embed_scale(model),
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


class EmbedSumSite(Site):
    """A stack's ``hook_embed`` and ``hook_pos_embed``, served where the stack adds them: the input of the module
    that reads ``embeddings + positions`` (``layernorm_embedding``, or the first block where there is none).

    ``hook_embed`` is ``embed_tokens``' output times the stack's own factor where the stack applies it (Marian,
    Pegasus: ``embed_tokens(ids) * embed_scale``, computed here as the stack does), ``hook_pos_embed`` the position
    module's output shown ``[batch, pos, d_model]``. Each forward checks that the sum the stack passes on is theirs
    (it is not in training mode with dropout after it: refused by name); an edit of either is the sum the next
    module gets, as the stack computes it. Told apart by the stack that runs (both stacks may call one shared
    embedding module, as after ``set_input_embeddings``)."""

    def __init__(self, stack: Any, consumer: nn.Module, embed: HookPoint, pos: HookPoint, label: str) -> None:
        self.stack: Any
        self.stack, self.consumer, self.embed, self.pos, self.label = stack, consumer, embed, pos, label
        self.points = (embed, pos)
        self.scale = outside_scale(stack)
        self.running = False
        self.values: dict[str, Tensor] = {}

    def install(self) -> list[Any]:
        s = self.stack
        return [
            s.register_forward_pre_hook(self._enter, with_kwargs=True),
            s.register_forward_hook(self._leave),
            s.embed_tokens.register_forward_hook(self._record("embed")),
            s.embed_positions.register_forward_hook(self._record("pos")),
            self.consumer.register_forward_pre_hook(self._serve, prepend=True),
        ]

    def _enter(self, module: Any, args: tuple, kwargs: dict) -> None:
        if kwargs.get("encoder_hidden_states") is not None and not module.config.is_encoder_decoder:
            raise UnsupportedModelError(
                f"{self.label}: this *ForCausalLM is served as a decoder alone; encoder_hidden_states= runs its "
                f"cross-attention, which has no points here (wrap the *ForConditionalGeneration instead)"
            )
        self.running, self.values = True, {}

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.running = False

    def _record(self, key: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if self.running:
                self.values[key] = output

        return hook

    def _serve(self, module: nn.Module, args: tuple) -> Any:
        embed, pos = self.values.pop("embed", None), self.values.pop("pos", None)
        if embed is None or pos is None or is_recomputing():  # inputs_embeds given: no token embeddings here
            return None
        total = args[0]
        if self.scale is not None:
            embed = embed * self.scale
        shown = pos.expand_as(total)
        if not torch.equal(total, embed + pos):
            raise UnsupportedModelError(
                f"{self.label}: the stack passes on something other than its embeddings + positions (dropout in "
                f"training mode?): hook_embed and hook_pos_embed are served in eval mode or without dropout"
            )
        embed, changed = self.embed.apply(embed, protect=True)  # the stack has added it already
        shown, moved = self.pos.apply(shown, protect=True)
        return (embed + shown, *args[1:]) if changed or moved else None


class PreLNResidualSite(Site):
    """The residual stream of one pre-LN block (mBART, Pegasus, Blenderbot): ``hook_attn_out``, ``hook_resid_mid``,
    (decoder: ``hook_cross_attn_out``, ``hook_resid_mid_cross``), ``hook_mlp_out`` and ``hook_resid_post``.

    The block adds each branch to the residual in its own forward (no module computes ``resid_mid``): this site
    follows the residual itself, from the first norm's input (``resid_pre``), adding each branch's output
    (``out_proj``'s, ``fc2``'s) as the block does; ``hook_resid_mid``... are served at the input of the norm that
    reads them, and the block output is recomputed as ``resid_mid + mlp_out``, so an edit reaches the norm and the
    residual both, exactly as the block computes them. Refused by name in training mode with dropout (the block's
    dropouts sit between the branches and the residual)."""

    def __init__(
        self,
        block: nn.Module,
        stages: list[tuple[nn.Module, HookPoint, nn.Module, HookPoint]],
        mlp_out: HookPoint,
        resid_post: HookPoint,
        label: str,
    ) -> None:
        self.block: Any = block
        self.stages, self.mlp_out, self.resid_post, self.label = stages, mlp_out, resid_post, label
        self.points = tuple(p for s in stages for p in (s[1], s[3])) + (mlp_out, resid_post)
        self.values: dict[str, Tensor] = {}

    def install(self) -> list[Any]:
        b = self.block
        handles = [b.self_attn_layer_norm.register_forward_pre_hook(self._start, prepend=True)]
        for branch, out_point, norm, mid_point in self.stages:
            handles.append(branch.register_forward_hook(self._branch(out_point)))
            handles.append(norm.register_forward_pre_hook(self._mid(mid_point), prepend=True))
        handles.append(b.fc2.register_forward_hook(self._branch(self.mlp_out)))
        handles.append(b.register_forward_hook(self._end))
        return handles

    def _start(self, module: nn.Module, args: tuple) -> None:
        if self.block.training and (self.block.dropout > 0 or getattr(self.block, "activation_dropout", 0) > 0):
            raise UnsupportedModelError(
                f"{self.label}: the residual points of a pre-LN block are served in eval mode or without dropout "
                f"(the block's dropouts sit between its branches and the residual): call model.eval()"
            )
        self.values = {"resid": first_input(args, {})}

    def _branch(self, point: HookPoint) -> Any:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Optional[Tensor]:
            value, changed = point.apply(first_output(output))
            self.values["branch"] = value
            return replace_first_output(output, value) if changed else None

        return hook

    def _mid(self, point: HookPoint) -> Any:
        def hook(module: nn.Module, args: tuple) -> Any:
            mid = self.values["resid"] + self.values.pop("branch")
            mid, _ = point.apply(mid)
            self.values["resid"] = mid
            return (mid, *args[1:])

        return hook

    def _end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        out = self.values.pop("resid") + self.values.pop("branch")
        out, _ = self.resid_post.apply(out)
        return replace_first_output(output, out)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """An attention mask as the additive float mask eager attention uses (``finfo.min`` where masked)."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def _scores(module: nn.Module, q: Tensor, k: Tensor, scaling: float) -> Tensor:
    return torch.matmul(q, k.transpose(2, 3)) * scaling


def _scores_queries_first(module: nn.Module, q: Tensor, k: Tensor, scaling: float) -> Tensor:
    """MVP's: ``(q * scaling) kᵀ``."""
    return torch.matmul(q * scaling, k.transpose(2, 3))


class BartPatternSite(Site):
    """``attn.hook_attn_scores``/``attn.hook_pattern`` (or ``cross_attn.``'s) of one ``BartAttention``: while
    hooked, the instance's ``forward`` computes attention written out (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        scores: HookPoint,
        pattern: HookPoint,
        scale_queries_first: bool = False,
        core_attention: bool = False,
    ) -> None:
        self.module, self.scores, self.pattern = module, scores, pattern
        self.points = (scores, pattern)
        # transformers 5.x's signature takes ``cache`` (and passes the cache's keywords on); 4.x's
        # ``past_key_values``, ``layer_head_mask`` and ``cache_position``
        self.legacy = "cache" not in inspect.signature(type(module).forward).parameters
        self.scale_queries_first, self.core_attention = scale_queries_first, core_attention

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
        if kwargs.pop("attn_prompt", None) is not None:  # MVP's prompts (refused at wrap time)
            raise UnsupportedModelError("lensadapters-bart serves MVP without prompts (use_prompt=False)")
        position = kwargs.pop("cache_position", None)
        shape = tuple(hidden_states.shape[:-1])
        is_cross = key_value_states is not None
        q = m.q_proj(hidden_states).view(*shape, -1, m.head_dim).transpose(1, 2)
        extra = {"position": position} if self.legacy else kwargs
        k, v = self._kv(hidden_states if key_value_states is None else key_value_states, cache, is_cross, extra)
        if self.core_attention:  # a causal LM's points follow the core's conventions (masked scores -inf...)
            z, pattern = explicit_attention(
                m,
                q,
                k,
                v,
                attention_mask,
                scores_fn=_scores_queries_first if self.scale_queries_first else _scores,
                scores_point=self.scores,
                pattern_point=self.pattern,
                implementation="eager",
                dropout=m.dropout if m.training else 0.0,
                scaling=m.scaling,
                is_causal=getattr(m, "is_causal", False) and not is_cross,
            )
            return m.out_proj(z.reshape(*shape, -1).contiguous()), pattern
        mask = attention_mask
        if (
            mask is None and getattr(m, "is_causal", False) and not is_cross and shape[1] > 1
        ):  # sdpa's implicit causal mask
            keys = torch.arange(k.shape[-2], device=q.device)
            queries = torch.arange(shape[1], device=q.device)[:, None] + (k.shape[-2] - shape[1])
            mask = keys[None, :] <= queries
        scores = (_scores_queries_first if self.scale_queries_first else _scores)(m, q, k, m.scaling)
        if mask is not None:
            scores = scores + _additive(mask, q.dtype)[..., : k.shape[-2]]
        scores, _ = self.scores.apply(scores)
        pattern = nn.functional.softmax(scores, dim=-1)
        pattern = nn.functional.dropout(pattern, p=m.dropout, training=m.training)
        pattern, _ = self.pattern.apply(pattern)
        z = torch.matmul(pattern, v).transpose(1, 2).contiguous()
        return m.out_proj(z.reshape(*shape, -1).contiguous()), pattern


def _attention_sites(p: hf.PointChain, attn: Any, prefix: str, heads: int, fam: Family) -> list[Site]:
    projections = [getattr(attn, f"{x}_proj") for x in "qkv"]
    sites: list[Site] = [OutputSite(m, p.new(f"{prefix}.hook_{x}"), heads=heads) for x, m in zip("qkv", projections)]
    scores, pattern = p.new(f"{prefix}.hook_attn_scores"), p.new(f"{prefix}.hook_pattern")
    sites.append(BartPatternSite(attn, scores, pattern, fam.scale_queries_first))
    sites.append(InputSite(attn.out_proj, p.new(f"{prefix}.hook_z"), heads=heads))
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
    if decoder:
        stages = [(block.self_attn.out_proj, attn_out, block.encoder_attn_layer_norm, mid)]
        sites.append(p.norm(block.encoder_attn_layer_norm, f"{prefix}.ln2"))
        sites += _attention_sites(p, block.encoder_attn, f"{prefix}.cross_attn", heads, fam)
        cross_out, mid_cross = p.new(f"{prefix}.hook_cross_attn_out"), p.new(f"{prefix}.hook_resid_mid_cross")
        stages.append((block.encoder_attn.out_proj, cross_out, block.final_layer_norm, mid_cross))
    else:
        stages = [(block.self_attn.out_proj, attn_out, block.final_layer_norm, mid)]
    sites.append(p.norm(block.final_layer_norm, f"{prefix}.ln3" if decoder else f"{prefix}.ln2"))
    sites.append(OutputSite(block.fc1, p.new(f"{prefix}.mlp.hook_pre")))
    sites.append(InputSite(block.fc2, p.new(f"{prefix}.mlp.hook_post")))
    mlp_out, post = p.new(f"{prefix}.hook_mlp_out"), p.new(f"{prefix}.hook_resid_post")
    sites.append(PreLNResidualSite(block, stages, mlp_out, post, prefix))
    return sites


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    model: Any = hooked.hf_model
    fam = family(model)
    embeds = [hooked.claim_point("hook_embed")]
    if causal(model):  # the core serves the blocks; the embeddings' sum and its norm are this plugin's
        decoder = model.model.decoder
        pos = hooked.claim_point("hook_pos_embed")
        consumer = decoder.layernorm_embedding if fam.embed_ln else decoder.layers[0]
        sites: list[Site] = [EmbedSumSite(decoder, consumer, embeds[0], pos, type(model).__name__)]
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
        consumer = module.layernorm_embedding if fam.embed_ln else module.layers[0]
        sites.append(EmbedSumSite(module, consumer, embed, p.new(f"{lead}hook_pos_embed"), f"model.{stack}"))
        if fam.embed_ln:
            sites.append(p.norm(module.layernorm_embedding, f"{lead}embed.ln"))
        for i, block in enumerate(module.layers):
            sites += block_sites(p, block, f"{stack}.{i}", heads, fam)
        if fam.final_norms:
            sites.append(p.norm(module.layer_norm, f"{stack}_final_ln"))
    return sites


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
