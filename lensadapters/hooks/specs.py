"""Declarative descriptions that plugins return from their adapter hooks.

A plugin never patches a model: it *describes* where things are (module paths relative to the
Hugging Face model or to one block) and supplies small pure functions for the quirks that cannot
be described by a path (how a fused QKV output splits into heads, how rotary embeddings rotate).
The core turns these descriptions into lazily installed PyTorch hooks. The MLP's descriptions live in
:mod:`lensadapters.hooks.mlp_specs`; this module re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch

from lensadapters.hooks.mlp_specs import FusedGateUp, MLPLayout, OpaqueMLP, cat_gate_up, chunk_gate_up
from lensadapters.hooks.mlp_specs import MLPLayouts as MLPLayouts  # the union, for annotations

Tensor = torch.Tensor

#: the description language (re-exported by :mod:`lensadapters` and :mod:`lensadapters.plugin_api`)
__all__ = [
    "Architecture",
    "BlockLayout",
    "FusedGateUp",
    "FusedQKV",
    "HookedConfig",
    "LinearWeight",
    "MLPLayout",
    "ModelLayout",
    "NormSpec",
    "OpaqueMLP",
    "ProjectionNorm",
    "ProjectionParts",
    "RotarySpec",
    "SeparateQKV",
    "cat_gate_up",
    "chunk_gate_up",
]


@dataclass(frozen=True)
class Architecture:
    """What an architecture plugin claims.

    ``model_types`` are values of ``config.model_type`` the plugin handles (several when they share modeling
    code). ``transformers`` is the range of transformers versions the plugin is tested with, a PEP 440
    specifier (``">=4.57,<6"``): wrapping a model under another version warns, naming both.
    ``attn_implementations`` are the attention implementations (``config._attn_implementation``)
    whose masks and numerics the plugin's pattern backend reproduces: with another one (flash,
    flex...) every hook point works except ``hook_attn_scores``/``hook_pattern``, which refuse
    with a clear error. ``vision_language``: the plugin also describes its model types' language model inside a
    vision-language model (a ``*ForConditionalGeneration`` whose ``config.text_config`` has one of them), its paths
    found inside the whole model and its sizes read from the text config (verified by the plugin's tests).
    """

    name: str
    model_types: tuple[str, ...]
    description: str = ""
    transformers: str = ""
    attn_implementations: tuple[str, ...] = ("eager", "sdpa")
    vision_language: bool = False
    #: an encoder-decoder (two stacks, decoder inputs): the cross-plugin test matrices and the demo, which build
    #: single-stack models and call them with token ids alone, leave it out; its plugin's own contract tests it
    encoder_decoder: bool = False

    def declared_for_installed_transformers(self) -> bool:
        """Whether the installed transformers is within ``transformers`` (always, when it is empty). A family that
        exists in newer releases only is declared ``">=5.x"``: its tiny config and contract are not built under an
        older transformers (demo, test matrices, ``lensadapters check``)."""
        if not self.transformers:
            return True
        import transformers as _transformers
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(_transformers.__version__) in SpecifierSet(self.transformers)


@dataclass(frozen=True)
class HookedConfig:
    """TransformerLens-style summary of a model's shape (``hm.cfg``)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    act_fn: str
    normalization_type: Literal["LN", "RMS"]
    positional_embedding_type: Literal["standard", "rotary"]
    model_type: str
    n_key_value_heads: Optional[int] = None
    rotary_dim: Optional[int] = None
    parallel_attn_mlp: bool = False
    gated_mlp: bool = False
    eps: float = 1e-5
    original_architecture: str = ""
    #: TransformerLens' names: the attention-logit and final-logit softcaps (``cap * tanh(x / cap)``; -1: none)
    attn_scores_soft_cap: float = -1.0
    output_logits_soft_cap: float = -1.0
    #: TransformerLens' names: the sliding window (keys a query sees, itself included) and each layer's attention
    #: type ("global", or "local" for a windowed layer); None without sliding-window layers
    window_size: Optional[int] = None
    attn_types: Optional[tuple[str, ...]] = None
    extra: dict = field(default_factory=dict, compare=False)
    #: TransformerLens' name: "causal" (each position attends to itself and earlier ones) or "bidirectional" (an
    #: encoder: every position attends to every unmasked one); what needs causality (generation) refuses the latter
    attention_dir: Literal["causal", "bidirectional"] = "causal"
    # mixture of experts (TransformerLens' names): experts per MoE layer and experts each token uses
    num_experts: Optional[int] = None
    experts_per_token: Optional[int] = None

    def __post_init__(self) -> None:
        if self.n_key_value_heads is None:
            object.__setattr__(self, "n_key_value_heads", self.n_heads)

    # TransformerLens' cfg.device / cfg.dtype, read from the wrapped model (a weak reference set by HookedModel)
    @property
    def device(self) -> Optional[torch.device]:
        """The device of the model's parameters, live (``None`` for a config not bound to a HookedModel)."""
        live = self.__dict__.get("_live")
        model = live() if live is not None else None
        return model.device if model is not None else None

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The dtype of the model's parameters, live (``None`` for a config not bound to a HookedModel)."""
        live = self.__dict__.get("_live")
        model = live() if live is not None else None
        return model.dtype if model is not None else None

    # --- fields TransformerLens clients read, live from the HookedModel (None/False for an unbound config) ----

    def _owner(self) -> Any:
        live = self.__dict__.get("_live")
        return live() if live is not None else None

    def _serves(self, suffix: str) -> bool:
        owner = self._owner()
        return owner is not None and any(name.endswith(suffix) for name in owner.hook_dict)

    @property
    def model_name(self) -> Optional[str]:
        """TransformerLens' short model name: the last part of the Hugging Face ``name_or_path`` (else the class)."""
        owner = self._owner()
        if owner is None:
            return None
        path = str(getattr(owner.hf_model.config, "name_or_path", "") or "").rstrip("/")
        return path.rsplit("/", 1)[-1] or type(owner.hf_model).__name__

    @property
    def default_prepend_bos(self) -> bool:
        """``hm.default_prepend_bos`` (whether text inputs get a BOS token in front; set it on ``hm``)."""
        owner = self._owner()
        return bool(getattr(owner, "default_prepend_bos", True))

    @property
    def tokenizer_prepends_bos(self) -> Optional[bool]:
        """Whether ``hm.tokenizer`` puts a BOS token in front by itself (``None`` without a tokenizer)."""
        tokenizer = getattr(self._owner(), "tokenizer", None)
        return None if tokenizer is None else len(tokenizer.encode("")) > 0

    # TransformerLens' switches for its optional hook points: True where the model serves them (always, on a model
    # whose blocks have those parts: unhooked points cost nothing); setting them (cfg.use_attn_result = True, or
    # hm.set_use_attn_result) changes nothing
    use_attn_result = property(lambda self: self._serves(".attn.hook_result"))
    use_split_qkv_input = property(lambda self: self._serves(".hook_q_input"))
    use_attn_in = property(lambda self: self._serves(".hook_attn_in"))
    use_hook_mlp_in = property(lambda self: self._serves(".hook_mlp_in"))

    @property
    def attn_only(self) -> bool:
        """Whether the blocks have no MLP (no ``hook_mlp_out`` is served)."""
        return self._owner() is not None and not self._serves(".hook_mlp_out")


_TL_SWITCHES = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
_frozen_setattr = HookedConfig.__setattr__


def _config_setattr(self: HookedConfig, name: str, value: Any) -> None:
    if name in _TL_SWITCHES:  # TransformerLens code switches its optional points on: here they are always there
        return
    _frozen_setattr(self, name, value)


HookedConfig.__setattr__ = _config_setattr  # type: ignore[method-assign,assignment]


@dataclass(frozen=True)
class ModelLayout:
    """Where the model-level pieces live, as dotted paths relative to the HF model.

    ``embed`` is the module whose output is ``hook_embed``; ``pos_embed`` the module whose output is
    ``hook_pos_embed`` (learned positions only); ``rotary`` a module returning ``(cos, sin)`` for the
    current positions (rotary models only).

    ``embed_scale`` is a factor the model multiplies token embeddings by (Gemma: ``sqrt(d_model)``): as in
    TransformerLens, ``hook_embed`` and ``W_E`` include it (``W_E`` is the table times the factor, in the table's
    dtype). ``embed_scale_after_module`` says the model applies it itself after the ``embed`` module returns, to the
    module's output or to the ``inputs_embeds`` it was given, and passes the product straight to the first block
    (transformers 4.x Gemma 2); ``hook_embed`` is then served at the first block's input, checked in every forward
    to be that product: the factor as a tensor of the embeddings' dtype (Gemma's ``normalizer``), or with
    ``embed_scale_rounded=False`` the Python float (``embeddings * multiplier``, computed in float32 for
    half-precision embeddings). Otherwise the module's output already includes the factor (and ``inputs_embeds``
    are used as given). A read is what the model computes and an edit of ``hook_embed`` is what the first block
    gets, exactly, in every dtype, either way. ``embed_scale_in_place`` (with ``embed_scale_after_module``) is for a
    model that multiplies the module's output tensor in place (``embeddings *= factor``) and adds more to it (positions)
    before the first block: ``hook_embed`` is that scaled tensor, read when the first block runs (checked in every
    forward to be the module's output times the factor), and an edit of it moves the first block's input by exactly
    the edit.

    ``ln_final_after_blocks`` is for a model that runs its ``ln_final`` module elsewhere in the forward too (on the
    embeddings, before the first block): its points are then served on the module's first call after the last block
    only (checked in every forward to read a tensor of the last block's output's shape); its other calls are left
    as they are.

    ``rotary_input`` names the keyword argument of each layer's *attention module* that carries that layer's
    ``(cos, sin)`` (``"position_embeddings"``): the core then reads them there, per layer, instead of from
    the ``rotary`` module — for models whose layers use different rotary sources (Gemma 3's local and global
    RoPE bases, from two modules or from one module called once per layer type).

    ``rotary_from_inputs`` is for models without such a module, which derive the rotary angles inside
    attention (GPT-J: from ``position_ids`` and a sin/cos table on each attention module). When set,
    the core calls ``rotary_from_inputs(module, args, kwargs)`` in a forward *pre*-hook on the
    ``rotary`` module (which then names the module whose inputs carry the positions, e.g. the first
    attention module) and uses the ``(cos, sin)`` it returns, in whatever layout the plugin's
    ``RotarySpec`` expects, instead of the module's output.

    ``side_inputs`` names the hook points (relative to a block: ``"hook_per_layer_input"`` is
    ``blocks.L.hook_per_layer_input``) of inputs every block reads besides the residual stream, which the model
    computes from the input itself (Gemma 4's per-layer input embeddings, looked up from the token ids). The state
    between two blocks is then not the residual stream alone, and the core says so instead of assuming it: a run
    from a residual (``start_at_layer``) needs the token ids (``tokens=``) so that the blocks it runs read the side
    inputs the model computes from them, and is refused without them; patching the residual stream leaves the side
    inputs as the patched run computes them (patch their points as well to restore another run).
    """

    blocks: str
    embed: str
    unembed: Optional[str] = None
    ln_final: Optional[str] = None
    pos_embed: Optional[str] = None
    pos_embed_offset: int = 0
    rotary: Optional[str] = None
    rotary_from_inputs: Optional[Callable[..., tuple[Tensor, Tensor]]] = None
    embed_scale: float = 1.0
    embed_scale_after_module: bool = False
    embed_scale_rounded: bool = True
    embed_scale_in_place: bool = False
    ln_final_after_blocks: bool = False
    rotary_input: Optional[str] = None
    side_inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class BlockLayout:
    """Where the pieces of one block live, as dotted paths relative to the block module.

    ``mlp`` is the module whose output is ``hook_mlp_out``; leave it ``None`` when the architecture
    has no MLP module (OPT), and ``hook_mlp_out`` is then the output of the MLP's down projection.
    ``parallel`` blocks compute ``x + attn(ln1 x) + mlp(ln2 x)`` and have no ``hook_resid_mid``.
    ``ln2`` of a parallel block may be ``None`` when both branches share ``ln1`` (GPT-J). ``ln2_before_attn``: a
    parallel block that computes ``ln2`` before it runs its attention (Falcon's new decoder architecture, whose
    ``ln_mlp`` runs beside ``ln_attn``), so ``hook_mlp_in`` and ``ln2``'s points fire before the attention's.

    ``post_norm`` blocks normalize *after* each residual add (original Transformer, OPT-350m):
    ``mid = ln1(x + attn(x))``, ``out = ln2(mid + mlp(mid))``. Their hook points are
    ``hook_resid_mid`` = ``x + attn_out`` (the input of ``ln1``, as in TransformerLens' post-LN
    ``BertBlock``), ``hook_mlp_in`` = the MLP's input (``ln1``'s output; an edit changes only the MLP
    branch) and ``hook_resid_post`` = the block output (``ln2``'s output, the next block's input).
    ``resid_post_before_norm`` gives a post_norm block TransformerLens' ``BertBlock`` points instead:
    ``hook_resid_post`` = ``ln2``'s input (``mid + mlp_out``) and ``hook_normalized_resid_post`` = the block
    output (``ln2``'s output, the next block's input).
    ``flat_mlp`` says the block reshapes hidden states to ``[b*p, d]`` around the MLP (OPT): hook
    points that see such 2-D tensors show them as ``[b, p, ...]`` and flatten edits back.
    ``mlp_residual`` names the module whose output the block adds to the residual stream after the MLP,
    when it is not ``mlp`` itself (GPT-NeoX: ``post_mlp_dropout``); an edit of ``hook_resid_mid`` is
    carried into the block's own residual add there, so it survives gradient checkpointing.

    ``ln1_post`` and ``ln2_post`` are norms applied to the attention and MLP *outputs* before each residual add
    (Gemma 2/3 "sandwich" norms, OLMo 2), with TransformerLens' hook points ``ln1_post.hook_scale``/
    ``hook_normalized``: ``hook_attn_out``/``hook_mlp_out`` are then what is added to the residual (the post
    norm's output), ``attn.hook_result`` the per-head outputs before it. ``mlp_residual`` defaults to
    ``ln2_post`` then. ``ln1`` (and ``ln2``) may be ``None`` in a sequential block without pre-norms (OLMo 2):
    attention reads ``hook_resid_pre``, the MLP reads ``hook_mlp_in`` (= ``hook_resid_mid``) directly.

    ``more_after_mlp`` says the block computes more after its ``resid_mid + mlp_out`` add before returning (a
    further residual branch, a scale on the whole output): ``hook_resid_post`` is then not ``resid_mid +
    mlp_out``, and an edit of ``hook_resid_mid`` is always carried into the block's own residual add (the
    difference added to the ``mlp_residual`` module's output), so the rest of the block sees it.

    ``attn_scale`` and ``mlp_scale`` are *branch constants*: the block adds its branches multiplied by them
    (Granite's ``residual_multiplier``), ``mid = x + attn(ln1 x) * attn_scale`` (what ``ln2`` reads) and ``out =
    mid + mlp(ln2 mid) * mlp_scale``, each product the module's output times the Python float, as the model computes
    it. ``hook_attn_out`` and ``hook_mlp_out`` are then what the block adds (the products, TransformerLens'
    ``resid_mid = resid_pre + attn_out``), read where the block adds them and edited there (the middle ``ln2`` reads
    and the block's output are recomputed from the edited contributions; no edit is divided back by a constant); the
    constants are folded into the weights as TransformerLens folds such constants: ``W_O``, ``b_O`` times
    ``attn_scale``, ``W_out``, ``b_out`` times ``mlp_scale`` (``hook_attn_out = sum(attn.hook_result) + b_O``,
    ``hook_result = hook_z @ W_O`` per head). Only a sequential pre-norm block (no post norms, ``mlp`` set) may have
    them.

    ``attn_in_scale`` is a constant the block multiplies ``ln1``'s output by before its attention module reads it
    (``attn(ln1(x) * c)``, the product the norm's output times the Python float, as the model computes it; a module
    beside the attention reading ``ln1``'s output gets it as it is). ``ln1.hook_normalized`` stays the norm's
    output (an edit of it is what the block multiplies, exactly as if the norm had computed it); ``W_Q``, ``W_K``
    and ``W_V`` include the constant, their biases do not, so TransformerLens' ``hook_q = ln1.hook_normalized @ W_Q
    + b_Q`` holds (``hook_q_input``/``hook_k_input``/``hook_v_input`` edits, projected by those weights, reach the
    projections exactly). Only a sequential block with ``ln1`` (no ``post_norm``) may have it.
    ``no_mlp`` blocks have one branch, their attention: ``out = x + attn(ln1 x)`` (``hook_resid_post = hook_resid_pre
    + hook_attn_out``), with no ``hook_resid_mid``, ``hook_mlp_in``/``hook_mlp_out``, ``ln2`` or ``mlp.*`` point and no
    MLP weight (the block's MLP layout is an ``OpaqueMLP`` saying so); ``mlp``, ``ln2`` and ``ln2_post`` are ``None``,
    and the block is sequential, pre-norm, without branch constants.
    """

    ln1: Optional[str]
    attn: str
    o_proj: str
    ln2: Optional[str]
    mlp: Optional[str] = None
    parallel: bool = False
    post_norm: bool = False
    flat_mlp: bool = False
    mlp_residual: Optional[str] = None
    ln1_post: Optional[str] = None
    ln2_post: Optional[str] = None
    more_after_mlp: bool = False
    resid_post_before_norm: bool = False
    ln2_before_attn: bool = False
    attn_scale: float = 1.0
    mlp_scale: float = 1.0
    attn_in_scale: float = 1.0
    no_mlp: bool = False

    @property
    def scaled(self) -> bool:
        """Whether the block multiplies a branch by a constant (``attn_scale`` or ``mlp_scale`` not 1)."""
        return self.attn_scale != 1.0 or self.mlp_scale != 1.0


@dataclass(frozen=True)
class RotarySpec:
    """How rotary embeddings are applied to queries and keys of shape ``[b, p, h, d_head]``.

    ``apply(x, cos, sin)`` rotates, ``invert(x, cos, sin)`` undoes it (used to turn an edit of
    ``hook_rot_q``/``hook_rot_k`` into the projection output that produces it, so the KV cache
    stores the edited key). ``cos``/``sin`` are what the model's rotary module returned (or what
    ``ModelLayout.rotary_from_inputs`` computed).
    """

    rotary_dim: int
    apply: Callable[[Tensor, Tensor, Tensor], Tensor]
    invert: Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ProjectionNorm:
    """A norm between a query/key projection and rotary embeddings (``q_norm``/``k_norm``).

    ``module`` is its path relative to the block; ``layout`` how the module sees its input:

    * ``"bphd"``: ``[b, p, heads, d_head]``, normalized per head (Qwen3);
    * ``"bhpd"``: ``[b, heads, p, d_head]``, per head, after the attention module's transpose (Gemma 3);
    * ``"bpf"``: ``[b, p, heads * d_head]``, over the whole projection width (OLMo 2).

    Its hook points (``attn.q_norm.hook_scale``/``hook_normalized``) are ``[b, p, heads, 1]``/``[b, p, heads,
    d_head]`` for per-head norms and ``[b, p, 1]``/``[b, p, heads * d_head]`` for whole-width ones.
    """

    module: str
    layout: Literal["bphd", "bhpd", "bpf"] = "bphd"


@dataclass(frozen=True)
class SeparateQKV:
    """Queries, keys and values come from three projections (paths relative to the block).

    ``q_norm``/``k_norm`` are norms between the projection and rotary (Qwen3, Gemma 3, OLMo 2): ``hook_q``/
    ``hook_k`` stay the projection output, ``attn.q_norm.*`` are the norm's points, and ``hook_rot_q``/
    ``hook_rot_k`` are the normed and rotated values attention uses. ``norms_after_projections`` says the
    attention module runs all three projections before the norms (Gemma 3) rather than normalizing each
    projection right after it (Qwen3, OLMo 2); it orders ``hook_names`` as the points fire.

    ``v_norm`` is a norm on the value projection's output, whose output attention mixes (``attn.v_norm.*``;
    ``hook_v`` stays the projection output). The model runs the key and value projections, then the key norm,
    then the value norm (Gemma 4).

    ``kv_from`` is the earlier layer whose keys and values this layer's attention reads (key/value sharing across
    layers, Gemma 4's last layers): the layer has no key and value projections of its own (``k``/``v`` are then
    unused), so no ``hook_k``/``hook_v``/``k_norm``/``hook_rot_k``/``v_norm`` points, no ``hook_k_input``/
    ``hook_v_input`` and no ``W_K``/``W_V``; an edit of layer ``kv_from``'s key and value points reaches this
    layer's attention too.

    ``kv_heads`` is this layer's number of key/value heads where it is not ``cfg.n_key_value_heads``.
    ``values_from_keys`` says the values are the key projection's output (``v`` names the same module as ``k``),
    normalized apart by ``k_norm`` and ``v_norm`` (both ``"bphd"``): ``hook_k`` is then ``k_norm``'s input and
    ``hook_v`` ``v_norm``'s, so an edit of one leaves the other as it was; the layer has no ``hook_k_input``/
    ``hook_v_input`` (one projection feeds both), and ``W_V`` is ``W_K``.

    ``head_inputs=False`` says the projections do not map the normalized residual linearly to the heads (multi-head
    latent attention normalizes a latent between its down- and up-projections): the layer then has no
    ``hook_attn_in``/``hook_q_input``/``hook_k_input``/``hook_v_input``, whose edits the core turns into
    ``norm(edit) @ W_Q/W_K/W_V``.

    ``q_scale``/``k_scale`` are constants the attention module multiplies the query/key projection's output by
    before rotary (a key multiplier, ``k_proj(x) * c``), with no q/k norm: ``hook_q``/``hook_k`` are then the
    scaled values, the queries and keys rotary and the scores are computed from (TransformerLens' ``hook_k``: the key
    the scores use), ``W_Q``/``b_Q`` and ``W_K``/``b_K`` include the constant (``hook_k = hook_k_input @ W_K + b_K``),
    and an edit reaches the projection's output as its difference divided by the constant (the model multiplies it
    back: exact up to one rounding).

    ``shared_key_columns=n`` says the last ``n`` columns of every head's key are one key that every head shares,
    computed before the heads exist (multi-head latent attention's rope key). The model's own tensors cannot change
    them for one head alone; the site that serves such keys makes a per-head edit of ``hook_k``/``hook_rot_k`` on the
    keys the attention function gets (and reads the per-head gradient there), so one head's keys are patched and
    attributed like any other's. It describes the layer; nothing refuses it.
    """

    q: str
    k: str
    v: str
    rotary: Optional[RotarySpec] = None
    q_norm: Optional[ProjectionNorm] = None
    k_norm: Optional[ProjectionNorm] = None
    norms_after_projections: bool = False
    v_norm: Optional[ProjectionNorm] = None
    kv_from: Optional[int] = None
    kv_heads: Optional[int] = None
    values_from_keys: bool = False
    head_inputs: bool = True
    shared_key_columns: int = 0
    q_scale: float = 1.0
    k_scale: float = 1.0

    def scale(self, which: int) -> float:
        """The constant the attention module multiplies the queries' (``which=0``) or keys' (1) projection output
        by before rotary (``q_scale``/``k_scale``), 1.0 for the values."""
        return (self.q_scale, self.k_scale, 1.0)[which]


@dataclass(frozen=True)
class FusedQKV:
    """Queries, keys and values come from one projection's output.

    ``split(t)`` takes a tensor whose last dimension is the fused output features and returns
    ``(q, k, v)`` with the last dimension replaced by ``[heads, d_head]``; ``merge(q, k, v)`` is its
    inverse. The same functions split weight columns and biases, so weights follow the activations.

    ``q_norm``/``k_norm`` are norms of the split queries and keys before rotary, as for :class:`SeparateQKV`:
    ``hook_q``/``hook_k`` stay the projection's parts, ``attn.q_norm.*``/``attn.k_norm.*`` are the norms' points
    (the query norm runs first), and ``hook_rot_q``/``hook_rot_k`` are the normed and rotated values.
    """

    module: str
    split: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]
    merge: Callable[[Tensor, Tensor, Tensor], Tensor]
    rotary: Optional[RotarySpec] = None
    q_norm: Optional[ProjectionNorm] = None
    k_norm: Optional[ProjectionNorm] = None


QKVLayout = SeparateQKV | FusedQKV


@dataclass(frozen=True)
class ProjectionParts:
    """A linear projection whose output the model splits into parts, each shown at a hook point a plugin serves.

    A site that serves per-part points on a projection's output (a query projection holding each head's query
    and output gate; a fused projection grouped per head) declares this with ``hooked.declare_projection_parts``,
    so that a plugin wrapping the projection (LoRA: the ``*_lora`` delta points) shows its own contribution to the
    output split the same way: one point per part, ``points[i] + "_lora"``.

    * ``module``: the projection module (as the model holds it: a PEFT layer wraps it in place, so the wrapper);
    * ``points``: the full names of the parts' points (``blocks.3.attn.hook_q``...), in the order ``split``
      returns the parts;
    * ``split(t)``: the parts of a tensor whose last dimension is the projection's output features (any leading
      dimensions: activations, weight columns ``[r, d_out]``, biases), each in its point's shape; ``merge(*parts)``
      is its exact inverse (a regrouping: no arithmetic, so an edit of a part is that edit of the output);
    * ``before``: the point the projection runs before (default the first part's): the plugin's per-part points
      are placed right before it, in declaration order.
    """

    module: Any
    points: tuple[str, ...]
    split: Callable[[Tensor], tuple[Tensor, ...]]
    merge: Callable[..., Tensor]
    before: Optional[str] = None

    @property
    def first_point(self) -> str:
        """The point the projection runs before."""
        return self.before or self.points[0]


@dataclass(frozen=True)
class NormSpec:
    """How a norm module normalizes, so its scale can be exposed and edited.

    ``kind`` "LN": ``(x - mean) / scale * weight + bias`` with ``scale = sqrt(var + eps)``;
    "RMS": ``x / scale * weight`` with ``scale = sqrt(mean(x^2) + eps)``. ``weight_offset`` is added
    to the weight (Gemma-style ``1 + w``). Plugins declare the specs of their norms
    (``lensadapters_norm_scale``); the core's fallback for unknown ``*RMSNorm`` classes is checked against the
    module on a probe input and refused when the module computes something else.
    """

    kind: Literal["LN", "RMS"]
    eps: float
    weight: Optional[Tensor]
    bias: Optional[Tensor] = None
    weight_offset: float = 0.0


@dataclass(frozen=True)
class LinearWeight:
    """A linear map ``y = x @ W + b`` with ``W`` as ``[d_in, d_out]`` (TransformerLens orientation)."""

    W: Tensor
    b: Optional[Tensor] = None
