"""TransformerLens' ``ActivationCache`` analysis methods: residual-stream decompositions, head and neuron results,
norms applied to stacks, logit attributions. Same names, signatures, labels and shapes as TransformerLens 2.x.

Norms are the model's own (LayerNorm or RMSNorm, their live weights, Gemma-style ``1 + w``), read through the
plugins. Where TransformerLens relies on having folded the norm's weight into the next matrix (``fold_ln``,
its default), lensadapters, which never changes weights, applies the weight instead:

* ``apply_ln_to_stack`` (and ``apply_ln=True`` of the stacking methods) centers (LayerNorm), divides by the
  cached ``hook_scale`` and multiplies by the norm's weight, without its bias: the part of the norm that is
  linear in each component. ``stack @ hm.W_U`` (or ``@ hm.W_Q[L]``, ``@ hm.W_in[L]``) is then what each
  component contributes, as ``stack @ W_U`` is on a TransformerLens model with ``fold_ln=True``; values are
  TransformerLens' times the weight.
* ``logit_attrs`` equals TransformerLens' on a ``fold_ln=True`` model (the attributions add up to the logit
  difference, minus biases).
* ``accumulated_resid(apply_ln=True)`` at the final layer applies the final norm (weight and bias) to each
  stream with its own statistics, as TransformerLens does (``recompute_ln``).

Post-LN blocks (OPT-350m) normalize after each residual add, so the residual stream is not a sum of component
outputs: decompositions and norms applied to stacks at a block input are refused with an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch

from lensadapters.analysis.utils import Slice, SliceInput, as_slice, to_numpy
from lensadapters.errors import LensAdaptersError
from lensadapters.hooks.norms import apply_norm
from lensadapters.wiring import weights as _w
from lensadapters.wiring.names import non_attention_blocks

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

Tensor = torch.Tensor
SliceLike = Union[Slice, SliceInput]


class DecompositionUndefinedError(LensAdaptersError, ValueError):
    """A decomposition or norm that is not defined for this model (post-LN blocks, no resid_mid...)."""


class CacheAnalysisMixin:
    """The analysis methods of :class:`lensadapters.ActivationCache` (needs the cache's ``model``)."""

    _data: dict
    model: Optional["HookedModelLike"]
    has_batch_dim: bool

    # --- model facts --------------------------------------------------------------------------------

    def _hm(self) -> "HookedModelLike":
        if self.model is None:
            raise LensAdaptersError(
                "this ActivationCache has no model (it was built by hand): its analysis methods "
                "need one; use hm.run_with_cache or ActivationCache(data, n_layers, model=hm)"
            )
        return self.model

    @property
    def _n_layers(self) -> int:
        """The number of blocks the layer-indexed methods run over (every one of them reads it first): refused by
        name for an encoder-decoder, whose points are two stacks (``encoder.{i}.*``, ``decoder.{i}.*``)."""
        hm = self._hm()
        names = hm.hook_names
        if "blocks.0.hook_resid_pre" not in names and "decoder.0.hook_resid_pre" in names:
            raise DecompositionUndefinedError(
                "ActivationCache's layer-indexed methods (accumulated_resid, decompose_resid, stack_head_results, "
                "stack_neuron_results, apply_ln_to_stack, logit_attrs, get_full_resid_decomposition...) and the "
                "(name, layer) shorthand index one stack of blocks.{i} points; this model is an encoder-decoder "
                "(HookedEncoderDecoder's encoder.{i}.* and decoder.{i}.* points, where TransformerLens defines none "
                "of them either): read its points by name, e.g. cache['decoder.1.hook_resid_post']"
            )
        return hm.cfg.n_layers

    def _layer(self, layer: Optional[int]) -> int:
        return self._n_layers if layer is None or layer == -1 else layer

    def _post_ln(self) -> bool:
        """Post-LN blocks, or norms after the attention/MLP outputs (``ln1_post``/``ln2_post``, Gemma 2/3, OLMo 2)."""
        return any(
            bl is None or bl.post_norm or bl.ln1_post is not None or bl.ln2_post is not None
            for bl in self._hm().block_layouts
        )

    def _embed_components(self) -> list[tuple[str, Tensor]]:
        """What the embeddings write into the residual stream, as the decompositions label it: ``"embed"`` and
        ``"pos_embed"`` (those cached); where the model normalizes its embeddings before the first block (an
        ``embed.ln`` norm, ModernBERT's), the one ``"embed"`` that norm's output is (block 0's input)."""
        if "embed.ln.hook_normalized" in self._hm().hook_names:
            return [("embed", self["embed.ln.hook_normalized"])]
        return [
            (label, self[name])
            for label, name in (("embed", "hook_embed"), ("pos_embed", "hook_pos_embed"))
            if name in self._data
        ]

    def _refuse_post_ln(self, what: str) -> None:
        self._n_layers  # an encoder-decoder is refused by name first  # noqa: B018
        if self._post_ln():
            raise DecompositionUndefinedError(
                f"{what} is not defined for this model: its blocks are post-LN or have post norms (they normalize "
                f"after each residual add, or normalize the attention/MLP output before adding it), so the residual "
                f"stream is not the sum of the heads' and neurons' outputs"
            )

    def _attn_feeds_mlp(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP reads its attention output (sequential blocks; not parallel ones)."""
        if not 0 <= layer < self._n_layers:
            raise ValueError(f"mlp_input needs a block: layer must be in [0, {self._n_layers - 1}], not {layer}")
        return not self._hm().block_layouts[layer].parallel

    def _norm_prefix(self, layer: int, mlp_input: bool) -> Optional[str]:
        hm = self._hm()
        if layer == self._n_layers:
            return "ln_final" if "ln_final.hook_scale" in hm.hook_names else None
        if mlp_input and f"blocks.{layer}.ln2.hook_scale" in hm.hook_names:
            return f"blocks.{layer}.ln2"
        if hm.block_layouts[layer] is not None and hm.block_layouts[layer].ln1 is None:
            return None  # a block without a norm before its attention (ModernBERT's first) reads the stream as it is
        return f"blocks.{layer}.ln1"  # a block whose MLP shares ln1 (GPT-J) normalizes its MLP input with it

    # --- slicing -------------------------------------------------------------------------------------

    def apply_slice_to_batch_dim(self, batch_slice: SliceLike) -> Any:
        """A cache with ``batch_slice`` applied to the batch dimension of every activation."""
        batch_slice = as_slice(batch_slice)
        if not (self.has_batch_dim or batch_slice.mode == "identity"):
            raise ValueError("cannot slice the batch dimension of a cache without one")
        still = batch_slice.mode != "int" and self.has_batch_dim
        data = {name: batch_slice.apply(value, dim=0) for name, value in self._data.items()}
        return type(self)(data, self._hm().cfg.n_layers, still, model=self.model)  # type: ignore[call-arg]

    # --- stacks of the residual stream -------------------------------------------------------------------

    def accumulated_resid(
        self,
        layer: Optional[int] = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: SliceLike = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ) -> Union[Tensor, tuple[Tensor, list[str]]]:
        """The residual stream before each block up to ``layer`` (and after the last block when ``layer`` is
        ``None``/``-1``/``n_layers``): ``[components, *batch_and_pos, d_model]``; labels ``"L_pre"``, ``"L_mid"``,
        ``"final_post"``. ``apply_ln`` normalizes with the norm that reads ``layer``'s input (see the module)."""
        pos_slice = as_slice(pos_slice)
        layer = self._layer(layer)
        n = self._n_layers
        parts, labels = [], []
        for i in range(layer + 1):
            if i == n:
                parts.append(self[self._block_output(n - 1)])
                labels.append("final_post")
                continue
            parts.append(self[("resid_pre", i)])
            labels.append(f"{i}_pre")
            if (incl_mid and i < layer) or (mlp_input and i == layer):
                parts.append(self._resid_mid(i))
                labels.append(f"{i}_mid")
        components = torch.stack([pos_slice.apply(c, dim=-2) for c in parts], dim=0)
        if apply_ln:
            components = self.apply_ln_to_stack(
                components, layer, pos_slice=pos_slice, mlp_input=mlp_input, recompute_ln=layer == n
            )
        return (components, labels) if return_labels else components

    def _block_output(self, layer: int) -> str:
        """The point holding block ``layer``'s output: ``hook_resid_post``, or ``hook_normalized_resid_post`` in a
        post-LN block whose ``hook_resid_post`` is its last norm's input (TransformerLens' ``BertBlock``)."""
        name = f"blocks.{layer}.hook_normalized_resid_post"
        return name if name in self._data or name in self._hm().hook_names else f"blocks.{layer}.hook_resid_post"

    def _resid_mid(self, layer: int) -> Tensor:
        name = f"blocks.{layer}.hook_resid_mid"
        if name not in self._data and name not in self._hm().hook_names:
            raise DecompositionUndefinedError(
                f"block {layer} has no hook_resid_mid (parallel attention and MLP read "
                f"the same block input): leave out incl_mid/mlp_input"
            )
        return self[name]

    def decompose_resid(
        self,
        layer: Optional[int] = None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: SliceLike = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ) -> Union[Tensor, tuple[Tensor, list[str]]]:
        """The residual stream at block ``layer``'s input as a stack of what wrote it: ``"embed"``,
        ``"pos_embed"``, ``"L_attn_out"``, ``"L_mlp_out"`` (``mode``: ``"all"``, ``"attn"`` or ``"mlp"``).
        With ``mlp_input``, block ``layer``'s attention output too (sequential blocks only: a parallel block's
        MLP does not read it)."""
        self._refuse_post_ln("decompose_resid")
        if mode not in ("all", "mlp", "attn"):
            raise ValueError(f"mode must be 'all', 'mlp' or 'attn', not {mode!r}")
        pos_slice = as_slice(pos_slice)
        layer = self._layer(layer)
        incl_attn, incl_mlp = mode != "mlp", mode != "attn"
        parts, labels = [], []
        if incl_embeds:
            for label, value in self._embed_components():
                parts.append(value)
                labels.append(label)
        for i in range(layer):
            if incl_attn:
                parts.append(self[("attn_out", i)])
                labels.append(f"{i}_attn_out")
            if incl_mlp:
                parts.append(self[("mlp_out", i)])
                labels.append(f"{i}_mlp_out")
        if mlp_input and incl_attn and self._attn_feeds_mlp(layer):
            parts.append(self[("attn_out", layer)])
            labels.append(f"{layer}_attn_out")
        components = torch.stack([pos_slice.apply(c, dim=-2) for c in parts], dim=0)
        if apply_ln:
            components = self.apply_ln_to_stack(components, layer, pos_slice=pos_slice, mlp_input=mlp_input)
        return (components, labels) if return_labels else components

    # --- heads -------------------------------------------------------------------------------------------

    def compute_head_results(self) -> None:
        """Store each head's output ``blocks.L.attn.hook_result`` (``z @ W_O`` per head, no bias) in the cache,
        from the cached ``hook_z`` and the live ``W_O``."""
        hm = self._hm()
        mixers = non_attention_blocks(hm)
        for layer in range(self._n_layers):
            name = f"blocks.{layer}.attn.hook_result"
            if name in self._data or layer in mixers:  # a block without softmax attention has no heads
                continue
            z = self[("z", layer, "attn")]
            W_O = _w.layer_weight(hm.wiring, "W_O", layer).to(device=z.device, dtype=z.dtype)  # [h, d_head, d_model]
            self._data[name] = torch.einsum("...hd,hdm->...hm", z, W_O)

    def stack_head_results(
        self,
        layer: int = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: SliceLike = None,
        apply_ln: bool = False,
    ) -> Union[Tensor, tuple[Tensor, list[str]]]:
        """Every head's output in blocks before ``layer``: ``[layer * n_heads, *batch_and_pos, d_model]``,
        labels ``"L{l}H{h}"``; ``incl_remainder`` adds the rest of the residual stream (``"remainder"``)."""
        pos_slice = as_slice(pos_slice)
        layer = self._layer(layer)
        if incl_remainder:
            self._refuse_post_ln("stack_head_results(incl_remainder=True)")
        mixers = [i for i in non_attention_blocks(self._hm()) if i < layer]
        if mixers:
            raise DecompositionUndefinedError(
                f"stack_head_results (and get_full_resid_decomposition, which stacks the heads) up to layer {layer} "
                f"is not defined for this model: blocks {mixers} mix tokens with something other than softmax "
                f"attention (linear attention or a state-space layer), which has no heads. Use decompose_resid "
                f"(each block's hook_attn_out as a whole), or stop before block {mixers[0]}"
            )
        if layer > 0 and "blocks.0.attn.hook_result" not in self._data:
            self.compute_head_results()
        parts: list[Tensor] = []
        labels: list[str] = []
        n_heads = self._hm().cfg.n_heads
        for i in range(layer):
            parts.append(pos_slice.apply(self[("result", i, "attn")], dim=-3))
            labels.extend(f"L{i}H{h}" for h in range(n_heads))
        components = self._stack_parts(parts, labels, layer, incl_remainder, pos_slice)
        if apply_ln:
            components = self.apply_ln_to_stack(components, layer, pos_slice=pos_slice)
        return (components, labels) if return_labels else components

    def _stack_parts(
        self, parts: list[Tensor], labels: list[str], layer: int, incl_remainder: bool, pos_slice: Slice
    ) -> Tensor:
        if parts:
            components = torch.cat(parts, dim=-2).movedim(-2, 0)
            if incl_remainder:
                remainder = pos_slice.apply(self[("resid_post", layer - 1)], dim=-2) - components.sum(dim=0)
                components = torch.cat([components, remainder[None]], dim=0)
                labels.append("remainder")
            return components
        if incl_remainder:
            labels.append("remainder")
            return pos_slice.apply(self[("resid_post", layer - 1)], dim=-2)[None]
        like = pos_slice.apply(self["hook_embed"], dim=-2)
        return torch.zeros(0, *like.shape, dtype=like.dtype, device=like.device)

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: Optional[str] = None) -> Tensor:
        """``[layers, ...]``: one activation of every block before ``layer`` (all blocks for ``-1``)."""
        layer = self._layer(layer)
        return torch.stack([self[(activation_name, i, sublayer_type)] for i in range(layer)], dim=0)

    # --- neurons -------------------------------------------------------------------------------------

    def get_neuron_results(self, layer: int, neuron_slice: SliceLike = None, pos_slice: SliceLike = None) -> Tensor:
        """What each MLP neuron of ``layer`` writes: ``[*batch_and_pos, neurons, d_model]`` (no bias)."""
        neuron_slice, pos_slice = as_slice(neuron_slice), as_slice(pos_slice)
        acts = self[("post", layer, "mlp")]
        W_out = _w.layer_weight(self._hm().wiring, "W_out", layer).to(device=acts.device, dtype=acts.dtype)
        acts = pos_slice.apply(acts, dim=-2)
        acts = neuron_slice.apply(acts, dim=-1)
        W_out = neuron_slice.apply(W_out, dim=0)
        return acts[..., None] * W_out

    def stack_neuron_results(
        self,
        layer: int,
        pos_slice: SliceLike = None,
        neuron_slice: SliceLike = None,
        return_labels: bool = False,
        incl_remainder: bool = False,
        apply_ln: bool = False,
    ) -> Union[Tensor, tuple[Tensor, list[str]]]:
        """Every neuron's output in blocks before ``layer``: labels ``"L{l}N{n}"``."""
        neuron_slice, pos_slice = as_slice(neuron_slice), as_slice(pos_slice)
        layer = self._layer(layer)
        if incl_remainder:
            self._refuse_post_ln("stack_neuron_results(incl_remainder=True)")
        neurons = np.atleast_1d(to_numpy(neuron_slice.apply(torch.arange(self._hm().cfg.d_mlp), dim=0)))
        parts: list[Tensor] = []
        labels: list[str] = []
        for i in range(layer):
            parts.append(self.get_neuron_results(i, pos_slice=pos_slice, neuron_slice=neuron_slice))
            labels.extend(f"L{i}N{int(n)}" for n in neurons)
        components = self._stack_parts(parts, labels, layer, incl_remainder, pos_slice)
        if apply_ln:
            components = self.apply_ln_to_stack(components, layer, pos_slice=pos_slice)
        return (components, labels) if return_labels else components

    # --- norms ---------------------------------------------------------------------------------------

    def apply_ln_to_stack(
        self,
        residual_stack: Tensor,
        layer: Optional[int] = None,
        mlp_input: bool = False,
        pos_slice: SliceLike = None,
        batch_slice: SliceLike = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> Tensor:
        """Normalize a stack of residual components as the norm reading block ``layer``'s input does (the final
        norm for ``None``/``-1``/``n_layers``), with the cached scale of the whole stream: centered (LayerNorm),
        divided by ``hook_scale``, times the norm's weight; no bias. ``recompute_ln`` (final norm only): the whole
        norm, bias included, with each component's own statistics."""
        hm = self._hm()
        pos_slice, batch_slice = as_slice(pos_slice), as_slice(batch_slice)
        layer = self._layer(layer)
        if layer < self._n_layers:
            self._refuse_post_ln(f"apply_ln_to_stack at block {layer}'s input")
        if has_batch_dim:
            residual_stack = batch_slice.apply(residual_stack, dim=1)
        prefix = self._norm_prefix(layer, mlp_input)
        if prefix is None:  # no norm there: the unembedding (or the block) reads the residual stream as it is
            return residual_stack
        spec = hm.norm_spec(hm.norm_module(prefix))
        if recompute_ln and layer == self._n_layers:
            return apply_norm(residual_stack, spec).to(residual_stack.dtype)
        stack = residual_stack.float()
        if spec.kind == "LN":
            stack = stack - stack.mean(dim=-1, keepdim=True)
        scale = pos_slice.apply(self[prefix + ".hook_scale"], dim=-2)
        if self.has_batch_dim:
            scale = batch_slice.apply(scale, dim=0)
        stack = stack / scale.float().to(stack.device)
        if spec.weight is not None:
            stack = stack * (spec.weight.float() + spec.weight_offset).to(stack.device)
        return stack.to(residual_stack.dtype)

    def logit_attrs(
        self,
        residual_stack: Tensor,
        tokens: Any,
        incorrect_tokens: Any = None,
        pos_slice: SliceLike = None,
        batch_slice: SliceLike = None,
        has_batch_dim: bool = True,
    ) -> Tensor:
        """Each component's direct contribution to the logit of ``tokens`` (minus that of ``incorrect_tokens``):
        the final norm applied to the stack, dotted with the unembedding directions. Refused by name where a
        prediction head runs between the final norm and the unembedding (points fire after ``ln_final``: an MLM
        head's dense layer, activation and norm), whose logits are no linear function of the residual stream."""
        hm = self._hm()
        names = hm.hook_names
        head = names[names.index("ln_final.hook_normalized") + 1 :] if "ln_final.hook_normalized" in names else []
        if head:
            raise DecompositionUndefinedError(
                f"logit_attrs is not defined for this model: a prediction head runs between its final norm and the "
                f"unembedding ({', '.join(head)}), so a logit is no linear function of the residual stream; read "
                f"the head's points (or attribute to them with gradients) instead"
            )
        directions = hm.tokens_to_residual_directions(tokens)
        if incorrect_tokens is not None:
            if _token_shape(hm, tokens) != _token_shape(hm, incorrect_tokens):
                raise ValueError(
                    f"tokens and incorrect_tokens must have the same shape (got "
                    f"{_token_shape(hm, tokens)} and {_token_shape(hm, incorrect_tokens)})"
                )
            directions = directions - hm.tokens_to_residual_directions(incorrect_tokens)
        scaled = self.apply_ln_to_stack(
            residual_stack, layer=-1, pos_slice=pos_slice, batch_slice=batch_slice, has_batch_dim=has_batch_dim
        )
        return (scaled * directions.to(device=scaled.device, dtype=scaled.dtype)).sum(dim=-1)

    def get_full_resid_decomposition(
        self,
        layer: Optional[int] = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: SliceLike = None,
        return_labels: bool = False,
    ) -> Union[Tensor, tuple[Tensor, list[str]]]:
        """The residual stream at block ``layer``'s input as every head (``"L{l}H{h}"``), every neuron
        (``"L{l}N{n}"``, or each MLP with ``expand_neurons=False``), ``"embed"``, ``"pos_embed"`` and the
        accumulated biases (``"bias"``); the components add up to the stream."""
        self._refuse_post_ln("get_full_resid_decomposition")
        hm = self._hm()
        layer = self._layer(layer)
        pos_slice = as_slice(pos_slice)
        attn_in = mlp_input and self._attn_feeds_mlp(layer)
        head_stack, labels = self.stack_head_results(
            layer + (1 if attn_in else 0), pos_slice=pos_slice, return_labels=True
        )
        components = [head_stack]
        if layer > 0:
            if expand_neurons:
                stack, more = self.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True)
            else:
                stack, more = self.decompose_resid(
                    layer, mlp_input=mlp_input, pos_slice=pos_slice, incl_embeds=False, mode="mlp", return_labels=True
                )
            labels.extend(more)
            components.append(stack)
        for label, value in self._embed_components():
            labels.append(label)
            components.append(pos_slice.apply(value, -2)[None])
        bias = hm.accumulated_bias(layer, attn_in, include_mlp_biases=expand_neurons)
        bias = bias.to(device=head_stack.device, dtype=head_stack.dtype).expand((1,) + head_stack.shape[1:])
        labels.append("bias")
        components.append(bias)
        stack = torch.cat(components, dim=0)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice, mlp_input=mlp_input)
        return (stack, labels) if return_labels else stack


def _token_shape(hm: "HookedModelLike", tokens: Any) -> tuple[int, ...]:
    if isinstance(tokens, str):
        return ()
    if isinstance(tokens, int):
        return ()
    return tuple(torch.as_tensor(tokens).shape)
