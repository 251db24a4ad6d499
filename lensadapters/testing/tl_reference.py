"""TransformerLens 2.x as a reference: a ``HookedTransformer`` with the weights of a Hugging Face model, offline.

``hooked_transformer(model)`` builds TransformerLens' config from the Hugging Face config (the fields its own
``convert_hf_model_config`` sets for that architecture), converts the weights with TransformerLens' own
``convert_*_weights`` and loads them with every processing step off (``fold_ln=False``, no centering, no value-
bias folding), as ``from_pretrained_no_processing`` does, without touching the Hub. ``fold_ln=True`` gives the
model TransformerLens' ``from_pretrained`` defaults to for norms (its weight folded into the next matrix).

Architectures: ``gpt2``, ``gpt_neox``, ``opt`` (pre-LN), ``llama``, in the configurations TransformerLens 2.x
represents; anything else raises :class:`ReferenceUnavailable` (tests skip). ``reference_configs(model_type)``
draws tiny Hugging Face configs of that kind (hypothesis). TransformerLens 2.x needs transformers 4.x: the
comparisons run in the transformers-4.57 environment (``scripts/setup-reference.sh``).
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Optional

import torch
from hypothesis import strategies as st

from lensadapters.adapters.hf_helpers import config_sizes
from lensadapters.adapters.toy_configs import tiny_config_of

__all__ = [
    "ReferenceUnavailable",
    "transformer_lens_available",
    "hooked_transformer",
    "load_unprocessed",
    "reference_configs",
    "REFERENCE_MODEL_TYPES",
    "word_tokenizer",
]

REFERENCE_MODEL_TYPES = ("gpt2", "gpt_neox", "opt", "llama")


class ReferenceUnavailable(Exception):
    """TransformerLens is not installed, or cannot represent this model exactly."""


def transformer_lens_available() -> bool:
    try:
        import transformer_lens  # noqa: F401
    except Exception:  # ImportError, or TransformerLens 2.x refusing transformers 5
        return False
    return True


def _rope_theta(c: Any) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(c, "rope_theta", None) or getattr(c, "rotary_emb_base", 10000.0)))


def _rope_type(c: Any) -> str:
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def _gpt2(model: Any) -> dict:
    c = model.config
    if getattr(c, "add_cross_attention", False):
        raise ReferenceUnavailable("GPT-2 with cross-attention")
    return dict(
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        n_layers=c.n_layer,
        n_ctx=c.n_positions,
        eps=c.layer_norm_epsilon,
        d_vocab=c.vocab_size,
        act_fn=c.activation_function,
        use_attn_scale=bool(c.scale_attn_weights),
        scale_attn_by_inverse_layer_idx=bool(c.scale_attn_by_inverse_layer_idx),
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
    )


def _gpt_neox(model: Any) -> dict:
    c = model.config
    rotary_ndims = model.gpt_neox.layers[0].attention.rotary_ndims
    return dict(
        **config_sizes(c, d_head=c.hidden_size // c.num_attention_heads),
        eps=c.layer_norm_eps,
        act_fn=c.hidden_act,
        use_attn_scale=True,
        parallel_attn_mlp=bool(c.use_parallel_residual),
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=rotary_ndims,
        rotary_base=_rope_theta(c),
        normalization_type="LN",
        original_architecture="GPTNeoXForCausalLM",
    )


def _opt(model: Any) -> dict:
    c = model.config
    if not getattr(c, "do_layer_norm_before", True):
        raise ReferenceUnavailable("post-LN OPT (do_layer_norm_before=False): TransformerLens has no such OPT")
    if (getattr(c, "word_embed_proj_dim", c.hidden_size) or c.hidden_size) != c.hidden_size:
        raise ReferenceUnavailable("OPT with project_in/project_out: TransformerLens does not convert them")
    if not getattr(c, "enable_bias", True) or not getattr(c, "layer_norm_elementwise_affine", True):
        raise ReferenceUnavailable("OPT without biases or norm weights")
    eps = float(model.model.decoder.layers[0].self_attn_layer_norm.eps)
    return dict(
        **config_sizes(c, d_head=c.hidden_size // c.num_attention_heads, d_mlp=c.ffn_dim),
        eps=eps,
        act_fn=c.activation_function,
        use_attn_scale=True,
        normalization_type="LN",
        original_architecture="OPTForCausalLM",
    )


def _llama(model: Any) -> dict:
    c = model.config
    if _rope_type(c) != "default":
        raise ReferenceUnavailable(f"Llama rope type {_rope_type(c)!r}: TransformerLens 2.x rotates with plain RoPE")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ReferenceUnavailable("Llama with attention or MLP biases: TransformerLens' conversion drops them")
    d_head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return dict(
        **config_sizes(c, d_head=d_head),
        eps=c.rms_norm_eps,
        act_fn=c.hidden_act,
        n_key_value_heads=n_kv if n_kv != c.num_attention_heads else None,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=d_head,
        rotary_base=_rope_theta(c),
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
    )


_CONFIGS: dict[str, Callable[[Any], dict]] = {"gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt, "llama": _llama}


def _converter(model_type: str) -> Callable[..., dict]:
    from transformer_lens.pretrained import weight_conversions as wc

    return {
        "gpt2": wc.convert_gpt2_weights,
        "gpt_neox": wc.convert_neox_weights,
        "opt": wc.convert_opt_weights,
        "llama": wc.convert_llama_weights,
    }[model_type]


def hooked_transformer(
    model: Any, *, fold_ln: bool = False, tokenizer: Any = None, default_prepend_bos: bool = True, **cfg_overrides: Any
) -> Any:
    """TransformerLens' ``HookedTransformer`` with ``model``'s weights (float32, CPU, eval mode).

    ``tokenizer`` must be loadable again from its ``name_or_path`` (TransformerLens reloads it with
    ``add_bos_token=True``): save it to a folder and load it from there (:func:`word_tokenizer` does).
    ``cfg_overrides`` set more HookedTransformerConfig fields (``use_split_qkv_input=True``...).
    """
    if not transformer_lens_available():
        raise ReferenceUnavailable("transformer_lens (2.x) is not installed in this environment")
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    model_type = getattr(model.config, "model_type", None)
    if model_type not in _CONFIGS:
        raise ReferenceUnavailable(f"no TransformerLens reference for model type {model_type!r}")
    fields = _CONFIGS[model_type](model)
    if fold_ln:
        fields["normalization_type"] = fields["normalization_type"] + "Pre"
    fields.update(default_prepend_bos=default_prepend_bos, device="cpu", dtype=torch.float32, **cfg_overrides)
    cfg = HookedTransformerConfig(**fields)
    hooked = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    return load_unprocessed(hooked, _converter(model_type)(model, cfg), fold_ln=fold_ln)


def load_unprocessed(hooked: Any, state: dict, *, fold_ln: bool = False) -> Any:
    """``hooked`` (TransformerLens' ``HookedTransformer``) with the converted weights ``state`` loaded with every
    processing step off (no centering, no value-bias folding, no refactored attention matrices; ``fold_ln``:
    TransformerLens' norm folding), as ``from_pretrained_no_processing`` loads them; in eval mode."""
    hooked.load_and_process_state_dict(
        state,
        fold_ln=fold_ln,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    return hooked.eval()


def word_tokenizer(vocab_size: int, *, adds_bos: bool = False, folder: Optional[str] = None) -> Any:
    """A local word-level tokenizer: ``<unk>`` (0), BOS ``<s>`` (1), EOS and pad ``</s>`` (2), then the words
    ``w3 .. w{vocab_size-1}``; saved to ``folder`` (a new temporary one by default) and loaded from there with
    ``AutoTokenizer``. ``adds_bos``: the tokenizer puts BOS in front by itself (as Llama's); otherwise it adds
    nothing (as GPT-2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    folder = folder or tempfile.mkdtemp(prefix="lensadapters-reference-tok-")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# --- configurations TransformerLens represents --------------------------------------------------------------


@st.composite
def reference_configs(draw: st.DrawFn, model_type: str, max_layers: int = 2) -> Any:
    """Tiny Hugging Face configs of ``model_type`` that TransformerLens 2.x represents exactly."""
    layers = draw(st.integers(1, max_layers), label="n_layers")
    heads = draw(st.sampled_from([2, 4]), label="n_heads")
    d_head = draw(st.sampled_from([4, 8]), label="d_head")
    vocab = draw(st.integers(24, 64), label="vocab")
    d_model = heads * d_head
    shared = dict(layers=layers, heads=heads, vocab=vocab, positions=64, bos_token_id=1, eos_token_id=2)
    if model_type == "gpt2":
        from transformers import GPT2Config

        n_inner = draw(st.sampled_from([None, 3 * d_model]), label="n_inner")
        act = draw(st.sampled_from(["gelu_new", "relu"]), label="act")
        return tiny_config_of(
            GPT2Config, hidden=d_model, n_inner=n_inner, activation_function=act, dropout_free=True, **shared
        )
    if model_type == "gpt_neox":
        from transformers import GPTNeoXConfig

        d_model = heads * 8  # every rotary_pct rotates an even number of dimensions
        rotary_pct = draw(st.sampled_from([0.25, 0.5, 1.0]), label="rotary_pct")
        parallel = draw(st.booleans(), label="parallel")
        sizes = dict(hidden=d_model, d_mlp=2 * d_model, **shared)
        return tiny_config_of(
            GPTNeoXConfig, rotary_pct=rotary_pct, use_parallel_residual=parallel, dropout_free=True, **sizes
        )
    if model_type == "opt":
        from transformers import OPTConfig

        sizes = dict(hidden=d_model, ffn_dim=2 * d_model, word_embed_proj_dim=d_model, **shared)
        return tiny_config_of(OPTConfig, do_layer_norm_before=True, pad_token_id=2, dropout_free=True, **sizes)
    if model_type == "llama":
        from transformers import LlamaConfig

        kv = draw(st.sampled_from([h for h in (1, 2, heads) if heads % h == 0]), label="n_kv_heads")
        theta = draw(st.sampled_from([100.0, 10000.0]), label="rope_theta")
        tied = draw(st.booleans(), label="tied")
        sizes = dict(hidden=d_model, d_mlp=2 * d_model, kv_heads=kv, head_dim=d_head, pad_token_id=2, **shared)
        return tiny_config_of(LlamaConfig, rms_norm_eps=1e-5, rope_theta=theta, tie_word_embeddings=tied, **sizes)
    raise ReferenceUnavailable(f"no reference configs for model type {model_type!r}")
