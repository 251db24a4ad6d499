"""An independent reference of ModernBERT for exactness tests: a tiny masked-LM model (:func:`make_model`, 3 layers:
global, local, global; window 4; or another head's model, ``cls``), a right-padded batch (:func:`inputs`), every
point computed step by step from the Hugging Face modules' parameters (:func:`reference`; the masked-LM head's,
``ModernBertForSequenceClassification``'s or ``ModernBertForMultipleChoice``'s pooling and head, or
``ModernBertForTokenClassification``'s or ``ModernBertForQuestionAnswering``'s head on every token; a multiple-choice
batch, :func:`choice_inputs`, flattened to ``[batch * num_choices, pos]`` as transformers does) and the largest
difference of a cache from it
(:func:`max_error`). Needs ``lensadapters[testing]``."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from transformers import ModernBertConfig, ModernBertForMaskedLM

import lensadapters_modernbert
from lensadapters import HookedModel, Registry
from lensadapters.testing.models import reinit
from lensadapters.testing.reference import ReferencePoints, masked_difference

__all__ = [
    "IMPLEMENTATIONS",
    "PER_TOKEN",
    "WINDOW",
    "choice_inputs",
    "inputs",
    "logits_of",
    "make_model",
    "max_error",
    "reference",
    "registry",
    "wrapped",
]

IMPLEMENTATIONS = ("eager", "sdpa")
# the classification models whose head reads every token (no cls_head.hook_pooled)
PER_TOKEN = ("ModernBertForTokenClassification", "ModernBertForQuestionAnswering")
WINDOW = 2  # local_attention=4: a local layer's query at i sees the keys j with |i - j| <= 2


def registry() -> Registry:
    """A registry holding this plugin (its entry point is registered only when the distribution is installed)."""
    reg = Registry()
    reg.register(lensadapters_modernbert, "modernbert")
    return reg


def make_model(implementation: str = "eager", seed: int = 0, cls: Any = ModernBertForMaskedLM, **more: Any) -> Any:
    config = lensadapters_modernbert.tiny_config(ModernBertConfig, layers=3, window=2 * WINDOW, **more)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=implementation)
    reinit(model, seed)
    return model.eval()


def choice_inputs(seed: int = 0, choices: int = 3) -> dict[str, Tensor]:
    """A multiple-choice batch, ``[2, choices, 9]``: every row of :func:`inputs`' shape, the last choice of the
    first row right-padded by 2, the second choice of the second row left-padded by 2 (its first real token is at 2)
    and the third right-padded by 1 (every padding query keeps a real key in its window)."""
    ids = torch.randint(3, 64, (2, choices, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, -1, 7:] = 0
    mask[1, 1, :2] = 0
    if choices > 2:
        mask[1, 2, 8:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


def inputs(seed: int = 0) -> dict[str, Tensor]:
    """Two rows of 9 tokens, the second right-padded by 2 (every padding query keeps a real key in its window)."""
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    ids[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def wrapped(implementation: str = "eager", seed: int = 0, **more: Any) -> tuple[Any, dict[str, Tensor], HookedModel]:
    model = make_model(implementation, seed, **more)
    return model, inputs(seed), HookedModel.wrap(model, registry=registry())


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(model: Any, batch: dict[str, Tensor], edits: Optional[dict[str, Callable]] = None) -> dict:
    """Every point, from the model's parameters; ``edits`` (point -> fn, called as a hook is:
    ``fn(value, hook)``) change a point's value where it is computed.
    Rotary angles are written out from ``rope_theta`` (global) / ``local_rope_theta`` (local layers); scores are
    ``q kᵀ / sqrt(d_head)`` with padding keys, and on local layers keys beyond the window, ``-inf``."""
    at = ReferencePoints(edits)  # at(name, value): the point's value, edited as a hook would (value, hook)
    out = at.values
    c = model.config

    def norm(prefix: str, ln: nn.LayerNorm, x: Tensor) -> Tensor:
        centred = x - x.mean(-1, keepdim=True)
        scale = at(f"{prefix}.hook_scale", (x.var(-1, keepdim=True, unbiased=False) + ln.eps).sqrt())
        normalized = centred / scale * ln.weight
        return at(f"{prefix}.hook_normalized", normalized if ln.bias is None else normalized + ln.bias)

    ids, mask = batch["input_ids"], batch["attention_mask"]
    choices = ids.shape[1] if ids.dim() == 3 else None  # multiple choice: [batch, num_choices, pos], flattened
    ids, mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1])
    b, p = ids.shape
    base = model.model
    x = at("hook_embed", base.embeddings.tok_embeddings.weight[ids])
    x = at("hook_full_embed", norm("embed.ln", base.embeddings.norm, x))
    h = c.num_attention_heads
    d = c.hidden_size // h
    position = torch.arange(p)
    for i, layer in enumerate(base.layers):
        pre = f"blocks.{i}."
        local = i % c.global_attn_every_n_layers != 0
        theta = (c.local_rope_theta if local else c.global_rope_theta) if hasattr(c, "global_rope_theta") else None
        if theta is None:  # transformers 5: rope parameters per layer type
            kind = "sliding_attention" if local else "full_attention"
            theta = c.rope_parameters[kind]["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        angles = torch.cat([position[:, None].float() * inv_freq] * 2, -1)  # [p, d]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        x = at(pre + "hook_resid_pre", x)
        attn_in = at(pre + "hook_attn_in", x[:, :, None].expand(b, p, h, x.shape[-1]))
        for n in "qkv":  # the residual per head, before ln1 (ln1 is served on the residual itself)
            at(pre + f"hook_{n}_input", attn_in)
        ln1_out = norm(pre + "ln1", layer.attn_norm, x) if i else x
        normed = [ln1_out[:, :, None].expand(b, p, h, x.shape[-1])] * 3
        wqkv = layer.attn.Wqkv
        w, bias = wqkv.weight.view(3, h, d, -1), (wqkv.bias.view(3, h, d) if wqkv.bias is not None else None)
        q, k, v = (
            at(
                pre + f"attn.hook_{n}",
                torch.einsum("bphm,hdm->bphd", normed[j], w[j]) + (0 if bias is None else bias[j]),
            )
            for j, n in enumerate("qkv")
        )
        q = at(pre + "attn.hook_rot_q", q * cos + _rotate_half(q) * sin)
        k = at(pre + "attn.hook_rot_k", k * cos + _rotate_half(k) * sin)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        allowed = mask.bool()[:, None, None, :].expand(b, 1, p, p)
        if local:
            allowed = allowed & ((position[:, None] - position[None, :]).abs() <= c.local_attention // 2)
        scores = at(pre + "attn.hook_attn_scores", scores.masked_fill(~allowed, -math.inf))
        pattern = at(pre + "attn.hook_pattern", scores.softmax(-1))
        z = at(pre + "attn.hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        wo = layer.attn.Wo
        result = at(pre + "attn.hook_result", torch.einsum("bphd,mhd->bphm", z, wo.weight.view(-1, h, d)))
        attn_out = at(pre + "hook_attn_out", result.sum(2) + (0 if wo.bias is None else wo.bias))
        mid = at(pre + "hook_resid_mid", x + attn_out)
        mlp_in = at(pre + "hook_mlp_in", mid)
        normalized = norm(pre + "ln2", layer.mlp_norm, mlp_in)
        first, second = layer.mlp.Wi(normalized).chunk(2, dim=-1)
        gate = at(pre + "mlp.hook_pre", first)
        linear = at(pre + "mlp.hook_pre_linear", second)
        post = at(pre + "mlp.hook_post", layer.mlp.act(gate) * linear)
        mlp_out = at(pre + "hook_mlp_out", layer.mlp.Wo(post))
        x = at(pre + "hook_resid_post", mid + mlp_out)
    x = norm("ln_final", base.final_norm, x)
    head = model.head
    dense = head.dense

    def dense_of(t: Tensor) -> Tensor:
        return t @ dense.weight.T + (0 if dense.bias is None else dense.bias)

    if not hasattr(model, "classifier"):  # the masked-LM head, on every token
        post = at("mlm_head.hook_post", head.act(at("mlm_head.hook_pre", dense_of(x))))
        out["logits"] = model.decoder(norm("mlm_head.ln", head.norm, post))
        return out
    if type(model).__name__ in PER_TOKEN:  # the head on every token, no pooling
        pooled = x
    elif c.classifier_pooling == "cls":  # the first token (multiple choice: the first real one), or the mean
        first = mask.argmax(-1) if choices is not None else torch.zeros(b, dtype=torch.long)
        pooled = at("cls_head.hook_pooled", x[torch.arange(b), first])
    else:
        real = mask.to(x.dtype)[:, :, None]
        pooled = at("cls_head.hook_pooled", (x * real).sum(1) / real.sum(1))
    dense_out = at("cls_head.hook_pre", dense_of(pooled))
    post = at("cls_head.hook_post", head.act(dense_out))
    classifier_in = at("cls_head.hook_out", norm("cls_head.ln", head.norm, post))  # the dropout: none in eval
    logits = classifier_in @ model.classifier.weight.T + model.classifier.bias
    out["logits"] = logits if choices is None else logits.view(-1, choices)
    return out


def logits_of(output: Any) -> Tensor:
    """The logits of a ModernBERT output (``run_with_hooks``' answer, or the HF output): ``logits``, or the question
    answerer's ``start_logits`` and ``end_logits`` stacked on a last axis (its classifier's output,
    ``[batch, pos, 2]``)."""
    if isinstance(output, Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    return torch.stack((output.start_logits, output.end_logits), dim=-1)


def logits_with_head_norm_scale_halved(model: Any, batch: dict) -> Tensor:
    """The logits of ``model`` on ``batch`` with its head's norm written out with its scale halved, in a PyTorch hook
    replacing the norm's output: what an edit halving ``cls_head.ln.hook_scale`` computes (equal to rounding: the
    norm has no module for its scale, so it is written out here)."""

    def halved(module: Any, args: tuple, output: Tensor) -> Tensor:
        x = args[0]
        scale = (x.var(-1, keepdim=True, unbiased=False) + module.eps).sqrt() * 0.5
        out = (x - x.mean(-1, keepdim=True)) / scale * module.weight
        return out if module.bias is None else out + module.bias

    handle = model.head.norm.register_forward_hook(halved)
    try:
        with torch.no_grad():
            return logits_of(model(**batch))
    finally:
        handle.remove()


def max_error(cache: Any, ref: dict, real: Optional[Tensor] = None) -> float:
    """The largest difference at the finite entries; masked (``-inf``) entries must be masked in both. ``real``
    (``[b, p]`` booleans) restricts query-indexed attention points to real queries (padding queries whose window
    holds no real key are implementation-defined)."""
    worst = 0.0
    for name, value in ref.items():
        if name == "logits":
            continue
        got = cache[name]
        assert got.shape == value.shape, f"{name}: {tuple(got.shape)} != {tuple(value.shape)}"
        if real is not None and name.endswith(("hook_attn_scores", "hook_pattern")):
            keep = real[:, None, :, None].expand_as(value)
            got, value = got[keep], value[keep]
        worst = max(worst, masked_difference(got, value, name))
    return worst
