"""An independent reference of the BERT and RoBERTa encoders for exactness tests: tiny masked-LM models
(:func:`make_model`, width 16-24, 2 layers, unit-scale weights from ``lensadapters.testing.reinit``), a padded batch
(:func:`inputs`), every HookedEncoder point computed step by step from the Hugging Face modules (:func:`reference`)
and the largest difference of a cache from it (:func:`max_error`). Needs ``lensadapters[testing]``."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

from lensadapters import HookedModel, hf
from lensadapters.testing.models import reinit
from lensadapters.testing.reference import ReferencePoints, masked_difference

__all__ = [
    "FAMILIES",
    "IMPLEMENTATIONS",
    "PAD",
    "base_model",
    "inputs",
    "make_model",
    "max_error",
    "mlm_head",
    "reference",
    "wrapped",
]

FAMILIES = ("bert", "roberta")
IMPLEMENTATIONS = ("eager", "sdpa")
PAD = {"bert": 0, "roberta": 1}


def make_model(family: str, implementation: str = "eager", seed: int = 0, heads: int = 2, cls: Any = None) -> Any:
    sizes = hf.size_fields(vocab=40, hidden=8 * heads, layers=2, heads=heads, d_mlp=32)
    shared: dict[str, Any] = dict(**sizes, type_vocab_size=2, pad_token_id=PAD[family])
    config = (
        hf.without_dropout(BertConfig, max_position_embeddings=12, **shared)
        if family == "bert"
        else hf.without_dropout(RobertaConfig, max_position_embeddings=14, **shared)
    )
    torch.manual_seed(seed)
    if cls is None:
        cls = BertForMaskedLM if family == "bert" else RobertaForMaskedLM
    model = cls._from_config(config, attn_implementation=implementation)
    reinit(model, seed)
    return model.eval()


def inputs(family: str, seed: int = 0) -> dict[str, Tensor]:
    """Two rows of 7 tokens, the second right-padded by 3, with two token types."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 40, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    ids[1, 4:] = PAD[family]
    types = torch.zeros(2, 7, dtype=torch.long)
    types[:, 3:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def wrapped(
    family: str, implementation: str = "eager", seed: int = 0, cls: Any = None
) -> tuple[Any, dict[str, Tensor], HookedModel]:
    """:func:`make_model`, its :func:`inputs` (the same seed) and the model wrapped."""
    model = make_model(family, implementation, seed, cls=cls)
    return model, inputs(family, seed), HookedModel.wrap(model)


def base_model(model: Any) -> Any:
    return getattr(model, model.base_model_prefix, model)


def mlm_head(model: Any) -> tuple[Any, Any, Any, Any]:
    """(dense, activation, norm, decoder) of the masked-LM head."""
    if hasattr(model, "cls"):
        t = model.cls.predictions.transform
        return t.dense, t.transform_act_fn, t.LayerNorm, model.cls.predictions.decoder
    from transformers.activations import gelu

    h = model.lm_head
    return h.dense, gelu, h.layer_norm, h.decoder


def _scale(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    return (x.var(-1, keepdim=True, unbiased=False) + ln.eps).sqrt()


def reference(model: Any, batch: dict[str, Tensor], edits: Optional[dict[str, Callable]] = None) -> dict:
    """Every HookedEncoder point, computed step by step from the model's modules; ``edits`` (point -> fn, called as
    a hook is: ``fn(value, hook)``) change a point's value where it is computed. The pattern and scores are written
    out: ``q kᵀ / sqrt(d_head)``, padding keys ``-inf``."""
    at = ReferencePoints(edits)  # at(name, value): the point's value, edited as a hook would (value, hook)
    out = at.values

    def norm(prefix: str, ln: nn.LayerNorm, x: Tensor) -> Tensor:
        centred = x - x.mean(-1, keepdim=True)
        scale = at(f"{prefix}.hook_scale", _scale(ln, x))
        return at(f"{prefix}.hook_normalized", centred / scale * ln.weight + ln.bias)

    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    b, p = ids.shape
    e = base_model(model).embeddings
    if model.config.model_type == "roberta":
        real = ids.ne(e.padding_idx).long()
        positions = real.cumsum(1) * real + e.padding_idx
    else:
        positions = torch.arange(p).expand(b, p)
    word = at("hook_embed", e.word_embeddings(ids))
    token_type = at("embed.hook_token_type_embed", e.token_type_embeddings(types))
    pos = at("hook_pos_embed", e.position_embeddings(positions))
    x = at("hook_full_embed", norm("embed.ln", e.LayerNorm, word + token_type + pos))
    n_heads = model.config.num_attention_heads
    d_head = model.config.hidden_size // n_heads
    for i, layer in enumerate(base_model(model).encoder.layer):
        pre = f"blocks.{i}."
        x = at(pre + "hook_resid_pre", x)
        sa = layer.attention.self
        attn_in = at(pre + "hook_attn_in", x[:, :, None].expand(b, p, n_heads, x.shape[-1]))
        q, k, v = (
            at(
                pre + f"attn.hook_{n}",
                torch.einsum("bphm,hdm->bphd", at(pre + f"hook_{n}_input", attn_in), m.weight.view(n_heads, d_head, -1))
                + m.bias.view(n_heads, d_head),
            )
            for n, m in zip("qkv", (sa.query, sa.key, sa.value))
        )
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d_head)
        scores = at(pre + "attn.hook_attn_scores", scores.masked_fill(mask[:, None, None, :] == 0, -math.inf))
        pattern = at(pre + "attn.hook_pattern", scores.softmax(-1))
        z = at(pre + "attn.hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        dense = layer.attention.output.dense
        result = at(pre + "attn.hook_result", torch.einsum("bphd,mhd->bphm", z, dense.weight.view(-1, n_heads, d_head)))
        attn_out = at(pre + "hook_attn_out", result.sum(2) + dense.bias)
        mid = at(pre + "hook_resid_mid", x + attn_out)
        normalized = norm(pre + "ln1", layer.attention.output.LayerNorm, mid)
        mlp_in = at(pre + "hook_mlp_in", normalized)
        hidden = at(pre + "mlp.hook_pre", layer.intermediate.dense(mlp_in))
        post = at(pre + "mlp.hook_post", layer.intermediate.intermediate_act_fn(hidden))
        mlp_out = at(pre + "hook_mlp_out", layer.output.dense(post))
        resid_post = at(pre + "hook_resid_post", normalized + mlp_out)
        x = at(pre + "hook_normalized_resid_post", norm(pre + "ln2", layer.output.LayerNorm, resid_post))
    dense, act, ln, decoder = mlm_head(model)
    out["logits"] = decoder(norm("mlm_head.ln", ln, act(dense(x))))
    return out


def max_error(cache: Any, ref: dict) -> float:
    """The largest difference at the finite entries; masked (``-inf``) entries must be masked in both."""
    return max((masked_difference(cache[n], value, n) for n, value in ref.items() if n != "logits"), default=0.0)
