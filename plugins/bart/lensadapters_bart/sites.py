"""The BART family's own sites: the embeddings where each stack adds token embeddings and positions
(``hook_embed``/``hook_pos_embed``), the residual points of pre-LN blocks, and attention scores and patterns computed
written out while hooked; the declarations that use them are in the package's ``__init__``."""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lensadapters.plugin_api import (
    ForwardState,
    HookPoint,
    Site,
    UnsupportedModelError,
    current_recompute_token,
    explicit_attention,
    first_input,
    first_output,
    is_recomputing,
    override_instance_method,
    replace_first_output,
)


def position_offset(stack: Any) -> int:
    """The rows before position 0 of a stack's position table (BART's learned positions: 2)."""
    return int(getattr(stack.embed_positions, "offset", 0))


def outside_scale(stack: Any) -> Optional[float]:
    """The factor a stack multiplies ``embed_tokens``' output by itself (``None`` where the module applies it)."""
    return None if hasattr(stack.embed_tokens, "embed_scale") else float(getattr(stack, "embed_scale", 1.0))


class EmbedSumSite(Site):
    """A stack's ``hook_embed`` and ``hook_pos_embed``, served where the stack adds them: the input of the module
    that reads ``embeddings + positions`` (``layernorm_embedding``, or the first block where there is none).

    ``hook_embed`` is ``embed_tokens``' output times the stack's own factor where the stack applies it (Marian,
    Pegasus: ``embed_tokens(ids) * embed_scale``, computed here as the stack does), ``hook_pos_embed`` the position
    module's output shown ``[batch, pos, d_model]``. Each forward checks that the sum the stack passes on is theirs
    (it is not in training mode with dropout after it: refused by name); an edit of either is the sum the next
    module gets, as the stack computes it. Told apart by the stack that runs (both stacks may call one shared
    embedding module, as after ``set_input_embeddings``). What a forward records is its own (``state``'s site
    values: another thread's forward, or one a hook runs inside it, has its own)."""

    def __init__(
        self, stack: Any, consumer: nn.Module, embed: HookPoint, pos: HookPoint, label: str, state: ForwardState
    ) -> None:
        self.stack: Any
        self.stack, self.consumer, self.embed, self.pos, self.label = stack, consumer, embed, pos, label
        self.points = (embed, pos)
        self.scale = outside_scale(stack)
        self.state = state

    @property
    def values(self) -> dict[str, Any]:
        """This forward's records (``"running"``: the stack runs; ``"embed"``, ``"pos"``: the modules' outputs)."""
        return self.state.site_values(self)

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
        values = self.values
        values.clear()
        values["running"] = True

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.values.clear()

    def _record(self, key: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            # the token embeddings are those before the positions: a later call is not the input's (BigBird's
            # encoder embeds its pad tokens after them, to pad the input to a multiple of block_size)
            values = self.values
            if values.get("running") and not (key == "embed" and "pos" in values):
                values[key] = output

        return hook

    def _serve(self, module: nn.Module, args: tuple) -> Any:
        values = self.values
        embed, pos = values.pop("embed", None), values.pop("pos", None)
        if embed is None or pos is None or is_recomputing():  # inputs_embeds given: no token embeddings here
            return None
        total = args[0]
        if self.scale is not None:
            embed = embed * self.scale
        # the input's positions: BigBird's block-sparse encoder appends its pad tokens' embeddings after them
        length = embed.shape[1]
        padded = total.shape[1] != length
        real = total[:, :length] if padded else total
        shown = pos.expand_as(embed)
        if not torch.equal(real, embed + pos):
            raise UnsupportedModelError(
                f"{self.label}: the stack passes on something other than its embeddings + positions (dropout in "
                f"training mode?): hook_embed and hook_pos_embed are served in eval mode or without dropout"
            )
        embed, changed = self.embed.apply(embed, protect=True)  # the stack has added it already
        shown, moved = self.pos.apply(shown, protect=True)
        if not (changed or moved):
            return None
        total = torch.cat([embed + shown, total[:, length:]], dim=1) if padded else embed + shown
        return (total, *args[1:])


class NormFirstEmbedSite(EmbedSumSite):
    """A stack's ``hook_embed`` and ``hook_pos_embed`` where it normalizes its token embeddings before adding the
    positions (BlenderbotSmall's decoder: ``layernorm_embedding(embed_tokens(ids)) + positions``): served at the
    outputs of ``embed_tokens`` and ``embed_positions`` (while this stack runs: both stacks may call one shared
    embedding module), so an edit is what the norm, or the sum, reads. ``hook_pos_embed`` is shown ``[batch, pos,
    d_model]``. Each forward checks that the norm reads the token embeddings as ``embed_tokens`` gave them (a stack
    that scales them between is not this one: refused by name)."""

    def __init__(
        self, stack: Any, norm: nn.Module, embed: HookPoint, pos: HookPoint, label: str, state: ForwardState
    ) -> None:
        super().__init__(stack, norm, embed, pos, label, state)

    def install(self) -> list[Any]:
        s = self.stack
        return [
            s.register_forward_pre_hook(self._enter, with_kwargs=True),
            s.register_forward_hook(self._leave),
            s.embed_tokens.register_forward_hook(self._embed),
            s.embed_positions.register_forward_hook(self._pos),
            self.consumer.register_forward_pre_hook(self._check, prepend=True),
        ]

    def _embed(self, module: nn.Module, args: tuple, output: Tensor) -> Optional[Tensor]:
        values = self.values
        if not values.get("running") or is_recomputing():
            return None
        value, changed = self.embed.apply(output)
        values["embed"] = value
        return value if changed else None

    def _pos(self, module: nn.Module, args: tuple, output: Tensor) -> Optional[Tensor]:
        values = self.values
        embed = values.get("embed")  # None: inputs_embeds given, no token embeddings here
        if not values.get("running") or embed is None or is_recomputing():
            return None
        value, changed = self.pos.apply(output.expand_as(embed), protect=True)
        return value if changed else None

    def _check(self, module: nn.Module, args: tuple) -> None:
        embed = self.values.pop("embed", None)
        if embed is not None and not torch.equal(args[0], embed):
            raise UnsupportedModelError(
                f"{self.label}: its embedding norm reads something other than the token embeddings embed_tokens "
                f"gave: lensadapters-bart describes this stack as normalizing them, unscaled, before the positions"
            )


class PreLNResidualSite(Site):
    """The residual stream of one pre-LN block (mBART, Pegasus, Blenderbot): ``hook_attn_out``, ``hook_resid_mid``,
    (decoder: ``hook_cross_attn_out``, ``hook_resid_mid_cross``), ``hook_mlp_out`` and ``hook_resid_post``.

    The block adds each branch to the residual in its own forward (no module computes ``resid_mid``): this site
    follows the residual itself, from the first norm's input (``resid_pre``), adding each branch's output
    (``out_proj``'s, ``fc2``'s) as the block does; ``hook_resid_mid``... are served at the input of the norm that
    reads them, and the block output is recomputed as ``resid_mid + mlp_out``, so an edit reaches the norm and the
    residual both, exactly as the block computes them. Refused by name in training mode with dropout (the block's
    dropouts sit between the branches and the residual). The residual followed is the forward's own (``state``'s
    site values: another thread's forward, or one a hook runs inside it, follows its own).

    While the block trains with gradient checkpointing, its output is not rebuilt (transformers 5.x runs a layer's
    own forward hooks outside the checkpointed function: a reentrant checkpoint's first forward runs without
    gradients, and only the layer's inside is recomputed with them). An edit of ``hook_resid_mid``... is then
    carried into the block's own residual add instead: the norm reads the edited value, and its difference
    ``edited - resid_mid`` is added to the next branch's output (the cross-attention's ``out_proj``, or ``fc2``),
    so the block's ``residual + branch`` carries it and the recomputation recomputes it with gradients. The
    residual followed is then the block's own (``resid_mid + (branch + difference)``: the edited stream up to
    float rounding)."""

    def __init__(
        self,
        block: nn.Module,
        stages: list[tuple[nn.Module, HookPoint, nn.Module, HookPoint]],
        mlp_out: HookPoint,
        resid_post: HookPoint,
        label: str,
        state: ForwardState,
    ) -> None:
        self.block: Any = block
        self.stages, self.mlp_out, self.resid_post, self.label = stages, mlp_out, resid_post, label
        self.points = tuple(p for s in stages for p in (s[1], s[3])) + (mlp_out, resid_post)
        self.state = state

    @property
    def values(self) -> dict[str, Any]:
        """This forward's residual (``"resid"``), the branch output to add next (``"branch"``), whether an edit of a
        residual point changed it (``"edited"``) and, while checkpointed, the difference the next branch adds
        (``"carry"``)."""
        return self.state.site_values(self)

    def _carried(self) -> bool:
        """Whether edits of the residual points are carried into the block's own residual add (while the block trains
        with gradient checkpointing) rather than rebuilt at its output."""
        return bool(self.block.training and getattr(self.block, "gradient_checkpointing", False))

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
        values = self.values
        values.clear()
        values["resid"] = first_input(args, {})

    def _branch(self, point: HookPoint) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Optional[Any]:
            values = self.values
            value, changed = point.apply(first_output(output))
            carry = values.pop("carry", None)
            if carry is not None:  # the previous residual point's edit, into the block's own residual add
                value, changed = value + carry, True
            values["branch"] = value
            return replace_first_output(output, value) if changed else None

        return hook

    def _mid(self, point: HookPoint) -> Any:
        def hook(module: nn.Module, args: tuple) -> Any:
            values = self.values
            branch = values.pop("branch")
            # the block's own residual (the norm's input), or after an edit rebuilt here the edited stream's
            mid = values["resid"] + branch if values.get("edited") else args[0]
            edited, changed = point.apply(mid)
            if changed and self._carried():
                values["resid"], values["carry"] = mid, edited - mid
            elif changed:
                values["resid"], values["edited"] = edited, True
            else:
                values["resid"] = mid
            # the norm reads the edited stream (rebuilt after an earlier edit: not the block's own residual)
            return (edited, *args[1:]) if changed or values.get("edited") else None

        return hook

    def _end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        values = self.values
        resid, branch, edited = values.pop("resid"), values.pop("branch"), values.pop("edited", False)
        if edited:  # rebuilt: the edited residual plus the MLP's output, as the block adds them
            out, changed = resid + branch, True
        else:  # the block's own output (edits carried into its residual add, or none)
            out, changed = first_output(output), False
        out, post_changed = self.resid_post.apply(out)
        return replace_first_output(output, out) if changed or post_changed else None


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


def full_attention(stack: Any, length: int) -> bool:
    """Whether a BigBird encoder computes full attention for an input of ``length`` tokens: its
    ``attention_type`` is ``"original_full"``, or block-sparse with an input too short for it (the stack then
    switches to full attention: ``length <= (5 + 2 * num_random_blocks) * block_size``, as transformers decides)."""
    c = stack.config
    return stack.attention_type == "original_full" or length <= (5 + 2 * c.num_random_blocks) * c.block_size


def _input_length(args: tuple, kwargs: dict) -> Optional[int]:
    for value in (kwargs.get("input_ids", args[0] if args else None), kwargs.get("inputs_embeds")):
        if isinstance(value, Tensor):
            return int(value.shape[1])
    return None


class BlockSparsePadding(Site):
    """Every point of a BigBird encoder (``points``) in a block-sparse forward whose input is not a multiple of
    ``block_size``, shown on the input's positions only.

    The stack then appends pad tokens' embeddings (``pad_token_id``'s, without positions) to the residual stream,
    with attention mask 0, runs its blocks on the padded length and strips the pad positions after its final norm.
    They cannot change the input's positions: as keys they get transformers' additive mask (-10000, so a softmax
    weight of exactly 0 unless a query's score for them exceeded its largest unmasked one by thousands), in the
    global, sliding and random blocks alike; as queries their attention output is zeroed (``from_mask``), so they
    depend on nothing but their own embedding. A point therefore shows ``[batch, input_len, ...]``, as on any
    other model (its value: those positions of the module's padded tensor), and an edit is written into those
    positions of the padded tensor, the pad positions left as transformers computes them: exactly what a plain
    PyTorch hook editing those positions of the module's tensor does. Served while one of the points is hooked:
    each point's ``apply`` is overridden for this instance.

    The stack's pre-hook notes the lengths of each forward in that forward's own values (``state``'s site values:
    two threads running the model, or a forward a hook runs inside another, each have theirs), and, where gradient
    checkpointing may recompute the forward's layers during backward (after the forward ended, possibly on another
    thread), by the forward's recompute token, which the recomputation reads them back by (kept as long as the
    token: the forward's autograd graph)."""

    def __init__(self, stack: Any, points: tuple[HookPoint, ...], label: str, state: ForwardState) -> None:
        self.stack: Any = stack
        self.points, self.label, self.state = points, label, state
        # (input, padded) of each forward that may be recomputed, by its recompute token (None: not padded)
        self.kept: "weakref.WeakKeyDictionary[Any, Optional[tuple[int, int]]]" = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()

    def install(self) -> list[Any]:
        handles: list[Any] = [self.stack.register_forward_pre_hook(self._enter, with_kwargs=True)]
        for point in self.points:
            handles.append(override_instance_method(point, "apply", self._apply(point)))  # type: ignore[arg-type]
        return handles

    def _enter(self, module: Any, args: tuple, kwargs: dict) -> None:
        length, size = _input_length(args, kwargs), module.config.block_size
        if length is None or full_attention(module, length) or length % size == 0:
            lengths = None
        else:
            lengths = (length, length + size - length % size)
        values = self.state.site_values(self)
        values["lengths"], values["in_backward"] = lengths, is_recomputing()
        token = self.state.frame.token
        if token is not None:
            with self.lock:
                self.kept[token] = lengths

    def lengths(self) -> Optional[tuple[int, int]]:
        """(input, padded) of the forward running now: the one whose layers a backward recomputes now, else the one
        this thread runs (a forward started inside a backward, as from a backward hook, is that one)."""
        values = self.state.site_values(self)
        if is_recomputing() and not values.get("in_backward", False):
            token = current_recompute_token()
            if token is not None:
                with self.lock:
                    if token in self.kept:
                        return self.kept[token]
        return values.get("lengths")

    def _apply(self, point: HookPoint) -> Any:
        def apply(value: Tensor, protect: bool = False) -> tuple[Tensor, bool]:
            lengths = self.lengths()
            if lengths is None or value.dim() < 2 or value.shape[1] != lengths[1]:
                return HookPoint.apply(point, value, protect)
            length = lengths[0]
            shown, changed = HookPoint.apply(point, value[:, :length], protect)
            if not changed:
                return value, False
            return torch.cat([shown, value[:, length:]], dim=1), True

        return apply


class BigBirdPatternSite(Site):
    """``attn.hook_attn_scores``/``attn.hook_pattern`` of one BigBird encoder attention (``*EncoderAttention``):
    while hooked, the instance's ``forward`` computes ``BigBirdPegasusSelfAttention``'s full attention written out
    (``q kᵀ / sqrt(d_head)`` plus the stack's additive padding mask, the softmax, the attention's dropout), with the
    module's own ``query``/``key``/``value``/``output`` linears, in the order transformers computes it. Overridden
    on the wrapper, which the model keeps when it switches its inner module between full and block-sparse. In a
    block-sparse forward (``attention_type="block_sparse"`` for this input) they are refused by name: that
    attention computes no ``[query, key]`` scores (blocks of global, sliding and random keys)."""

    def __init__(self, module: nn.Module, scores: HookPoint, pattern: HookPoint, label: str) -> None:
        self.module, self.scores, self.pattern, self.label = module, scores, pattern, label
        self.points = (scores, pattern)

    def install(self) -> list[Any]:
        return [override_instance_method(self.module, "forward", self._forward)]

    def _forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Any:
        m: Any = self.module
        if m.attention_type != "original_full":
            raise UnsupportedModelError(
                f"{self.label}.hook_attn_scores/hook_pattern: this forward's encoder attention is block-sparse "
                f"(attention_type='block_sparse', {hidden_states.shape[1]} tokens > (5 + 2 * num_random_blocks) * "
                f"block_size): it computes scores only for blocks of global, sliding and random keys, no "
                f"[query, key] matrix; hook them on full-attention forwards (attention_type='original_full', or "
                f"inputs short enough that transformers switches to it); every other point is served"
            )
        if kwargs.get("head_mask") is not None:
            raise UnsupportedModelError(
                "lensadapters-bart's attention scores and patterns do not take a head mask (head_mask=...): "
                "call without it, or unhook the scores and patterns"
            )
        inner = m.self
        shape = (*hidden_states.shape[:-1], -1, inner.attention_head_size)
        q, k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (inner.query, inner.key, inner.value))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(inner.attention_head_size)
        if attention_mask is not None:
            scores = scores + attention_mask
        scores, _ = self.scores.apply(scores)
        pattern = nn.functional.softmax(scores, dim=-1)
        pattern = inner.dropout(pattern)
        pattern, _ = self.pattern.apply(pattern)
        z = torch.matmul(pattern, v).permute(0, 2, 1, 3).contiguous()
        z = z.view(*z.shape[:-2], inner.all_head_size)
        return m.output(z), pattern


class SharedLinearSite(Site):
    """A point at a linear under BigBird's encoder attention wrapper (``owner``, at ``path``: ``self.query``...),
    served by ``inner`` (an ``OutputSite`` on it). The wrapper replaces its inner module ``self`` when the stack
    switches between block-sparse and full attention, handing the new one the same ``query``/``key``/``value``
    linears: this site holds the wrapper, not the inner module (whose replacement is the model's own), and each
    forward of the wrapper checks that the linear at ``path`` is still the one hooked (a linear replaced after
    wrapping is refused by name)."""

    def __init__(self, owner: nn.Module, path: str, inner: Any, label: str) -> None:
        self.owner, self.path, self.label = owner, path, label
        self.inner = inner  # not a module: its linear is reached through the wrapper
        self.points = tuple(inner.points)

    def signature(self) -> tuple[bool, ...]:
        return self.inner.signature()

    def install(self) -> list[Any]:
        return [self.owner.register_forward_pre_hook(self._check), *self.inner.install()]

    def _check(self, module: nn.Module, args: tuple) -> None:
        try:
            current = self.owner.get_submodule(self.path)
        except AttributeError:
            current = None
        if current is not self.inner.module:
            raise UnsupportedModelError(
                f"{self.label}.{self.path} was replaced after HookedModel.wrap (the hooks are on the old linear): "
                f"call hm.unwrap() and HookedModel.wrap(model) again after changing the model's modules"
            )
