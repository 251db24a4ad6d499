"""The BART-shaped families lensadapters-bart serves: what each changes of BART (:class:`Family`), by ``model_type``
(:data:`FAMILIES`), as transformers' modelling code builds it (checked against the modules at wrap time)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family"]


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
    final_norm: str = "layer_norm"
    """The attribute of each stack that is its final norm (where ``final_norms``; BigBird-Pegasus:
    ``layernorm_embedding``, which is then no embedding norm)."""
    decoder_norm_first: bool = False
    """The decoder normalizes its token embeddings (``layernorm_embedding``) before adding the positions
    (BlenderbotSmall's: ``norm(embed) + positions``) instead of normalizing the sum (its encoder: ``norm(embed +
    positions)``)."""
    decoder_scaled: bool = True
    """The decoder applies the embedding scale (BlenderbotSmall's has an ``embed_scale`` it never multiplies by)."""
    encoder_attention: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "out_proj")
    """The encoder self-attention's query, key, value and output projections, as paths under each encoder block's
    ``self_attn`` (BigBird-Pegasus': ``self.query``, ``self.key``, ``self.value``, ``output``: its
    ``*EncoderAttention`` wraps the full or block-sparse module ``self``, which shares those linears)."""
    block_sparse_encoder: bool = False
    """The encoder's attention is BigBird's: full (``config.attention_type="original_full"``) or block-sparse, as
    the stack decides per forward (it switches the model to full attention, for good, where the input is too short
    for block-sparse); its scores and patterns are served in full forwards only, every other point in both (in a
    block-sparse forward whose input the stack pads to a multiple of ``block_size``, on the input's positions)."""


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
    # the decoder's norm before the positions, its embeddings unscaled
    "blenderbot-small": Family(
        "BlenderbotSmall", False, True, False, "learned", False, decoder_norm_first=True, decoder_scaled=False
    ),
    # Pegasus' blocks with BigBird's encoder attention; both stacks' final norms are named layernorm_embedding
    "bigbird_pegasus": Family(
        "BigBirdPegasus",
        True,
        False,
        True,
        "learned",
        True,
        final_norm="layernorm_embedding",
        encoder_attention=("self.query", "self.key", "self.value", "output"),
        block_sparse_encoder=True,
    ),
}
