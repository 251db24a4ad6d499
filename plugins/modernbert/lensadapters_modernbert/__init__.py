"""ModernBERT encoders for lensadapters (``ModernBertForMaskedLM``, ``ModernBertModel``,
``ModernBertForSequenceClassification``, ``ModernBertForTokenClassification``, ``ModernBertForQuestionAnswering`` and
``ModernBertForMultipleChoice`` with their heads, the body of any other task model; transformers 4.57 and 5.x),
with TransformerLens ``HookedEncoder``-style names.

The blocks are pre-LN, rotary and bidirectional; layers alternate global and sliding-window (local) attention::

    mid = x + attn(ln1(x));  out = mid + mlp(ln2(mid))      mlp(h) = Wo(act(h Wi_0) * (h Wi_1))

Layer 0 has no attention norm (its ``attn_norm`` is ``nn.Identity``): it has no ``blocks.0.ln1.*`` points and its
attention reads ``hook_resid_pre`` itself. Points, in execution order:

    hook_embed                          tok_embeddings' output
    embed.ln.hook_scale/hook_normalized the embeddings' norm; hook_full_embed the embeddings' output (the first
                                        block's input)
    blocks.L.hook_resid_pre, ln1.*      (not on layer 0), attn.hook_q/k/v (the fused Wqkv's thirds, per head),
    attn.hook_rot_q/rot_k               rotated with the layer's own (cos, sin) (local layers have their own base)
    attn.hook_attn_scores/hook_pattern  bidirectional; padding keys -inf, and on local layers keys farther than
                                        local_attention // 2 too
    attn.hook_z/hook_result, hook_attn_out, hook_resid_mid, ln2.*, mlp.hook_pre (Wi's first half, the activation's
    input), mlp.hook_pre_linear (its second half), mlp.hook_post (Wo's input), hook_mlp_out, hook_resid_post
    ln_final.hook_scale/hook_normalized the final norm (the base model's last hidden state)
    mlm_head.hook_pre/hook_post         the masked-LM prediction head's dense output and its activation's output
    mlm_head.ln.hook_scale/hook_normalized  the prediction head's norm (after its dense layer and activation);
                                        W_U/b_U are the decoder
    cls_head.hook_pooled                ``ModernBertForSequenceClassification``: the pooled final hidden state the
                                        head reads ([batch, d_model]: the first token's, or the mean over the real
                                        tokens, as ``classifier_pooling`` says); cls_head.hook_pre (the head's dense
                                        output), cls_head.hook_post (its activation's output), cls_head.ln.* (its
                                        norm), cls_head.hook_out (the classifier's input, after the head's dropout)
    cls_head.hook_pre/hook_post/ln.*/hook_out  ``ModernBertForTokenClassification`` and
                                        ``ModernBertForQuestionAnswering`` (whose classifier's two outputs are the
                                        start and end logits): the same head on every token ([batch, pos, d_model];
                                        no pooling, so no cls_head.hook_pooled)
    cls_head.*                          ``ModernBertForMultipleChoice``: the sequence classifier's points (pooled as
                                        ``classifier_pooling`` says; ``cls`` pooling takes each row's first real
                                        token), with a one-logit classifier

``ModernBertForMultipleChoice`` flattens its ``[batch, num_choices, pos]`` input to ``[batch * num_choices, pos]``
before the encoder, as transformers does; every point sees those flattened rows (row ``b * num_choices + c`` is
choice ``c`` of batch row ``b``: ``hook_embed`` is ``[batch * num_choices, pos, d_model]``, ``cls_head.hook_pooled``
``[batch * num_choices, d_model]``) and only the logits are ``[batch, num_choices]``. TransformerLens has no such
model; the points follow what the HF modules see.

Under transformers 4.x ModernBERT runs attention from a table of its own (``MODERNBERT_ATTENTION_FUNCTION``), with a
rotary module in each attention module: the patterns are served by running that module's attention written out
(the core's ``explicit_attention``) while they are hooked, and each layer's (cos, sin) are computed from its own
rotary module. Flash attention (which unpads the batch) and ``reference_compile=True`` are refused there.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lensadapters import hf
from lensadapters.plugin_api import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    InputSite,
    ModelLayout,
    NormSite,
    OutputSite,
    Site,
    UnsupportedModelError,
    cat_gate_up,
    chunk_gate_up,
    hookimpl,
    override_instance_method,
    rotate_half,
    rotate_half_spec,
    site_attention,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
ARCH = hf.architecture(
    "modernbert",
    "ModernBERT encoders (pre-LN, rotary, global/sliding-window bidirectional attention, GeGLU; masked-LM head) "
    "with HookedEncoder-style points",
)
hf.plugin_module(globals(), ARCH, hookspec="1", contract="ModernBertContract")
LAYER_PATHS = ("attn_norm", "attn.Wqkv", "attn.Wo", "mlp_norm", "mlp.Wi", "mlp.Wo")


# the base model's path inside a head model (with a trailing dot; "" for the base model) and the base model
_prefix, _base = hf.base_prefix, hf.base_model


def _mlm(model: PreTrainedModel) -> bool:
    """Whether ``model`` has the masked-LM head (``head`` then ``decoder`` on every token)."""
    return isinstance(getattr(model, "head", None), nn.Module) and isinstance(
        getattr(model, "decoder", None), nn.Linear
    )


# transformers' ModernBERT task models whose head (``head``: dense, act, norm; ``drop``; a linear ``classifier``) is
# served as the ``cls_head.*`` points, and whether that head reads a pooled vector (``cls_head.hook_pooled``) or every
# token (no pool); multiple choice's points see its flattened rows (the module docstring). A class the installed
# transformers lacks is left out.
CLASSIFICATION_HEADS = {
    "ModernBertForSequenceClassification": True,
    "ModernBertForTokenClassification": False,
    "ModernBertForQuestionAnswering": False,  # the classifier's two outputs per token: start and end logits
    "ModernBertForMultipleChoice": True,  # one logit per (batch row, choice)
}


def _head_pooling(model: PreTrainedModel) -> Optional[bool]:
    """Whether ``model``'s classification head reads a pooled vector (``True``) or every token (``False``), where
    ``model`` is one of :data:`CLASSIFICATION_HEADS`' classes with a ``head`` (dense, act, norm) and a linear
    ``classifier``; ``None`` for every other model."""
    import transformers

    head = getattr(model, "head", None)
    if not isinstance(getattr(model, "classifier", None), nn.Linear) or not all(
        isinstance(getattr(head, n, None), nn.Module) for n in ("dense", "act", "norm")
    ):
        return None
    for name, pooled in CLASSIFICATION_HEADS.items():
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return pooled
    return None


def _own_attention(module: nn.Module) -> bool:
    """Whether this attention module runs ModernBERT's own attention table (transformers 4.x) rather than
    transformers' attention interface (5.x)."""
    return hasattr(sys.modules[type(module).__module__], "MODERNBERT_ATTENTION_FUNCTION")


# --- adapter hooks -----------------------------------------------------------------------------------


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    c = model.config
    base = _base(model)
    for name in ("embeddings", "layers", "final_norm"):
        if not isinstance(getattr(base, name, None), nn.Module):
            raise UnsupportedModelError(f"{type(base).__name__} has no {name!r}: not transformers' ModernBERT layout")
    for i, layer in enumerate(base.layers):
        missing = hf.missing_paths(layer, LAYER_PATHS)
        if missing:
            raise UnsupportedModelError(f"layer {i} ({type(layer).__name__}) has no {missing[0]}")
    if _own_attention(base.layers[0].attn):
        implementation = getattr(c, "_attn_implementation", "eager")
        if implementation not in ("eager", "sdpa"):
            raise UnsupportedModelError(
                f"attn_implementation={implementation!r}: under transformers 4.x ModernBERT unpads the batch for it; "
                f"lensadapters-modernbert serves 'eager' and 'sdpa'"
            )
        if getattr(c, "reference_compile", None):
            raise UnsupportedModelError(
                "reference_compile=True (torch.compile'd embeddings and MLPs): load the model with "
                "reference_compile=False"
            )


def _windows(model: PreTrainedModel) -> tuple[str, ...]:
    return tuple("local" if _local(layer.attn) else "global" for layer in _base(model).layers)


def _local(attention: Any) -> bool:
    if _own_attention(attention):
        return tuple(attention.local_attention) != (-1, -1)
    return getattr(attention, "sliding_window", None) is not None


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """ModernBERT's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): rotary, GeGLU, global and local
    bidirectional attention."""
    c = model.config
    d_head = c.hidden_size // c.num_attention_heads
    return dict(
        d_head=d_head,
        act_fn=str(c.hidden_activation),
        normalization_type="LN",
        positional_embedding_type="rotary",
        rotary_dim=d_head,
        gated_mlp=True,
        eps=float(c.norm_eps),
        attention_dir="bidirectional",
        window_size=int(c.local_attention),
        attn_types=_windows(model),
        extra={"mlm_head": _mlm(model), "cls_head": _classification_head(model), "first_layer_attn_norm": False},
    )


lensadapters_config = hf.hooked_config(_config_fields)


def _rotary_from_attention(module: Any, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    """A 4.x attention module's (cos, sin), from its own rotary module and the positions it is called with."""
    hidden = args[0] if args else kwargs["hidden_states"]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
    return module.rotary_emb(hidden, position_ids=positions)


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    p = _prefix(model)
    shared: dict[str, Any] = dict(blocks=f"{p}layers", embed=f"{p}embeddings.tok_embeddings", ln_final=f"{p}final_norm")
    shared["unembed"] = "decoder" if _mlm(model) else None
    if _own_attention(_base(model).layers[0].attn):  # 4.x: a rotary module in every attention module
        return ModelLayout(**shared, rotary=f"{p}layers.0.attn", rotary_from_inputs=_rotary_from_attention)
    return ModelLayout(**shared, rotary_input="position_embeddings")


def _block(model: PreTrainedModel, layer: int) -> BlockLayout:
    identity = isinstance(_base(model).layers[layer].attn_norm, nn.Identity)  # layer 0
    return BlockLayout(ln1=None if identity else "attn_norm", attn="attn", o_proj="attn.Wo", ln2="mlp_norm", mlp="mlp")


def _qkv(model: PreTrainedModel, layer: int) -> FusedQKV:
    c = model.config
    d_head = c.hidden_size // c.num_attention_heads
    split, merge = hf.fused_qkv_split(c.num_attention_heads, c.num_attention_heads, d_head)
    return FusedQKV("attn.Wqkv", split, merge, rotary=rotate_half_spec(d_head))


globals().update(hf.layer_hooks(_block, _qkv, FusedGateUp("mlp.Wi", "mlp.Wo", chunk_gate_up, cat_gate_up)))


class LayerRotarySite(Site):
    """Under transformers 4.x: each layer's (cos, sin) for its hook_rot_q/rot_k, from its attention module's own
    rotary module (local layers have another base), computed in a pre-hook on that attention module."""

    def __init__(self, attention: nn.Module, points: list, state: Any) -> None:
        self.attention, self.state = attention, state
        self.points = tuple(points)

    def install(self) -> list[Any]:
        return [self.attention.register_forward_pre_hook(self._pre, with_kwargs=True)]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.state.rotary = _rotary_from_attention(module, args, kwargs)


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Site]:
    model = hooked.hf_model
    base = _base(model)
    embeddings = base.embeddings
    sites: list[Site] = [
        _norm_site(hooked, embeddings.norm, "embed.ln", after="hook_embed"),
        OutputSite(embeddings, hooked.new_point("hook_full_embed", after="embed.ln.hook_normalized")),
    ]
    pooled = _head_pooling(model)
    if _mlm(model):
        sites += _mlm_head_sites(hooked, model.head)
    elif pooled is not None:
        sites += _classification_head_sites(hooked, model, pooled)
    if _own_attention(base.layers[0].attn):
        for i, attention in enumerate(hooked.attention_modules):
            names = (f"blocks.{i}.attn.hook_rot_q", f"blocks.{i}.attn.hook_rot_k")
            points = [hooked.point(n) for n in names if n in hooked.hook_names]
            if i and points:
                sites.append(LayerRotarySite(attention, points, hooked.forward_state))
    return sites


def _classification_head(model: PreTrainedModel) -> bool:
    """Whether ``model`` has a classification head whose points are served (:data:`CLASSIFICATION_HEADS`)."""
    return _head_pooling(model) is not None


def _mlm_head_sites(hooked: Any, head: Any) -> list[Site]:
    """The masked-LM prediction head's points, after ``ln_final``'s: its dense layer's output, its activation's
    output and its norm (the decoder's input)."""
    chain = hf.PointChain(hooked, "ln_final.hook_normalized")
    return [
        OutputSite(head.dense, chain.new("mlm_head.hook_pre")),
        OutputSite(head.act, chain.new("mlm_head.hook_post")),
        chain.norm(head.norm, "mlm_head.ln"),
    ]


def _classification_head_sites(hooked: Any, model: Any, pooled: bool) -> list[Site]:
    """A classification head's points, after ``ln_final``'s: its input where it is pooled (sequence classification's
    and multiple choice's pooled vector; the per-token heads read ``ln_final``'s output itself), its dense
    layer's output, its activation's output, its norm and the classifier's input (the norm's output after the
    head's dropout)."""
    head, chain = model.head, hf.PointChain(hooked, "ln_final.hook_normalized")
    sites: list[Site] = [InputSite(head, chain.new("cls_head.hook_pooled"))] if pooled else []
    sites.append(OutputSite(head.dense, chain.new("cls_head.hook_pre")))
    sites.append(OutputSite(head.act, chain.new("cls_head.hook_post")))
    return [*sites, chain.norm(head.norm, "cls_head.ln"), InputSite(model.classifier, chain.new("cls_head.hook_out"))]


def _norm_site(hooked: Any, module: nn.Module, prefix: str, after: str) -> NormSite:
    """``{prefix}.hook_scale`` and ``hook_normalized`` of ``module``, after point ``after``."""
    return hf.PointChain(hooked, after).norm(module, prefix)


# --- patterns under transformers 4.x ---------------------------------------------------------------------------


def _eager_scores(module: Any, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
    """Pre-mask scores as 4.x's eager ModernBERT attention computes them: ``q @ kᵀ · d_head^-0.5``."""
    return torch.matmul(query, key.transpose(2, 3)) * module.head_dim**-0.5


class OwnAttentionPatternBackend:
    """Serves ``hook_attn_scores``/``hook_pattern`` where ModernBERT's attention module runs its own attention table
    (transformers 4.x): ``activate(layer, site)`` stores a ``forward`` in that module instance's ``__dict__`` that
    runs its ``Wqkv`` (so ``hook_q``... fire as always), its rotary module and the core's explicit attention, then
    ``Wo``; the handle deletes it again."""

    def __init__(self, hooked: Any) -> None:
        self.modules: list[nn.Module] = list(hooked.attention_modules)

    def activate(self, layer: int, site: Any) -> Any:
        module: Any = self.modules[layer]
        attend = site_attention(site, module, _eager_scores)

        def forward(hidden_states: Tensor, output_attentions: Optional[bool] = False, **kwargs: Any) -> tuple:
            implementation = module.config._attn_implementation
            if implementation not in ("eager", "sdpa"):
                raise UnsupportedModelError(
                    f"lensadapters-modernbert's patterns need eager or sdpa, not {implementation}"
                )
            b = hidden_states.shape[0]
            qkv = module.Wqkv(hidden_states).view(b, -1, 3, module.num_heads, module.head_dim)
            cos, sin = _rotary_from_attention(module, (hidden_states,), kwargs)
            query, key, value = qkv.transpose(3, 1).unbind(dim=2)  # [b, h, p, d]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # 4.x's apply_rotary_pos_emb on [b, h, p, d]
            query = (query * cos) + (rotate_half(query) * sin)
            key = (key * cos) + (rotate_half(key) * sin)
            local = tuple(module.local_attention) != (-1, -1)
            mask = kwargs.get("sliding_window_mask") if local else kwargs.get("attention_mask")
            dropout = module.attention_dropout if module.training else 0.0
            out, pattern = attend(
                query, key, value, mask, implementation=implementation, dropout=dropout, is_causal=False
            )
            hidden = module.out_drop(module.Wo(out.reshape(b, -1, module.all_head_size)))
            return (hidden, pattern) if output_attentions else (hidden,)

        return override_instance_method(module, "forward", forward)


# the plugin's backend where the attention modules compute attention themselves, else the core's
lensadapters_attn_pattern = hf.own_attention_patterns(_own_attention, OwnAttentionPatternBackend)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 32, vocabulary 64, 4 heads. Seed 0 has 3 layers (global, local, global; window 4); other seeds vary
    the depth (1-4) and the window (2 or 4)."""
    from transformers import ModernBertConfig

    layers, window = hf.toy_draw(seed, (3, 4), [1, 2, 3, 4], [2, 4])
    return tiny_config(ModernBertConfig, layers=layers, window=window)


def tiny_config(
    config_class: Any, layers: int = 3, window: int = 4, heads: int = 4, d_head: int = 8, **more: Any
) -> Any:
    """A tiny ModernBERT config (``hf.tiny_config_of``'s sizes, vocabulary 64, MLP 48, no dropout): ``layers``
    layers alternating global and local attention (every second layer global) with a ``window``-token window,
    ``heads`` heads of ``d_head``; ``more`` fields of transformers' names on top."""
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return hf.tiny_config_of(
        config_class,
        dropout_free=True,
        layers=layers,
        heads=heads,
        hidden=heads * d_head,
        local_attention=window,
        **{"global_attn_every_n_layers": 2, "reference_compile": False, **special, **more},  # more: on top
    )
