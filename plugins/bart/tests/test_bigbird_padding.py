"""BigBird-Pegasus' block-sparse encoder on inputs that are not a multiple of ``block_size``: transformers pads them
with pad tokens' embeddings (attention mask 0, no positions) and strips the pad positions after the encoder's final
norm. Every encoder point shows the input's positions only; the tests check that against plain PyTorch hooks on the
Hugging Face modules (the same positions of the padded tensors they see), edits against plain hooks editing those
positions, bit for bit, and that the pad positions cannot change the input's (the premise of showing them so).

The models are tiny (width 16, 2 layers of each stack, 2 heads, one random block), built once per module.
"""

from __future__ import annotations

from typing import Any, Callable

import lensadapters_bart
import pytest
import torch
from torch import Tensor, nn
from transformers import AutoModelForSeq2SeqLM

from lensadapters import HookedModel
from lensadapters.plugin_api import first_output, replace_first_output
from lensadapters.testing import encoder_decoder as kit
from lensadapters.testing.models import reinit

#: (block_size, input length): block-sparse (longer than (5 + 2 * 1) * block_size) and padded by 1 and by 2
SHAPES = [(2, 15), (4, 30)]
D, HEADS = 16, 2


def make(block_size: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    config = lensadapters_bart.bart_config(
        layers=2, heads=HEADS, d_model=D, ffn=24, vocab=40, scale_embedding=True, model_type="bigbird_pegasus"
    )
    config.block_size, config.num_random_blocks = block_size, 1
    torch.manual_seed(6)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager")
    reinit(model, 6)
    return model.to(dtype).eval()


def batch_of(length: int) -> dict[str, Tensor]:
    """Two encoder rows of ``length`` tokens, the second right-padded by 5 (the user's padding), and 5 decoder
    tokens each."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 40, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    ids[1, -5:], mask[1, -5:] = 1, 0
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(3, 40, (2, 5), generator=g)}


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"block{s[0]}-len{s[1]}")
def case(request: Any) -> Any:
    block_size, length = request.param
    model = make(block_size)
    hm = HookedModel.wrap(model)
    yield model, hm, batch_of(length), length
    hm.unwrap()


def _heads(t: Tensor) -> Tensor:
    return t.view(*t.shape[:2], HEADS, D // HEADS)


def _scale(norm: nn.Module) -> Callable[[Tensor], Tensor]:
    def scale(x: Tensor) -> Tensor:  # sqrt(var + eps) of the norm's input, row by row
        return (torch.var_mean(x.float(), -1, correction=0, keepdim=True)[0] + norm.eps).sqrt().to(x.dtype)

    return scale


def sources(model: Any, length: int) -> dict[str, tuple[nn.Module, str, Callable[[Tensor], Tensor]]]:
    """Each encoder point but the scores and patterns (which a block-sparse forward does not compute): the module
    whose input ("in") or output ("out") a plain hook records, and what of it the point shows (before the slice to
    the input's positions)."""
    enc = model.model.encoder
    same: Callable[[Tensor], Tensor] = lambda t: t  # noqa: E731
    out: dict[str, Any] = {
        "hook_embed": (enc.embed_tokens, "out", same),  # its first call: the input's tokens (then the pad tokens')
        "hook_pos_embed": (enc.embed_positions, "out", lambda t: t.expand(2, length, D)),
    }
    for i, layer in enumerate(enc.layers):
        attn = layer.self_attn
        p = f"encoder.{i}"
        out |= {
            f"{p}.hook_resid_pre": (layer, "in", same),
            f"{p}.ln1.hook_scale": (layer.self_attn_layer_norm, "in", _scale(layer.self_attn_layer_norm)),
            f"{p}.ln1.hook_normalized": (layer.self_attn_layer_norm, "out", same),
            f"{p}.attn.hook_q": (attn.self.query, "out", _heads),
            f"{p}.attn.hook_k": (attn.self.key, "out", _heads),
            f"{p}.attn.hook_v": (attn.self.value, "out", _heads),
            f"{p}.attn.hook_z": (attn.output, "in", _heads),
            f"{p}.hook_attn_out": (attn.output, "out", same),
            f"{p}.hook_resid_mid": (layer.final_layer_norm, "in", same),
            f"{p}.ln2.hook_scale": (layer.final_layer_norm, "in", _scale(layer.final_layer_norm)),
            f"{p}.ln2.hook_normalized": (layer.final_layer_norm, "out", same),
            f"{p}.mlp.hook_pre": (layer.fc1, "out", same),
            f"{p}.mlp.hook_post": (layer.fc2, "in", same),
            f"{p}.hook_mlp_out": (layer.fc2, "out", same),
            f"{p}.hook_resid_post": (layer, "out", same),
        }
    final = enc.layernorm_embedding
    out["encoder_final_ln.hook_scale"] = (final, "in", _scale(final))
    out["encoder_final_ln.hook_normalized"] = (final, "out", same)
    return out


def _attach(module: nn.Module, where: str, fn: Callable[[Tensor], Any]) -> Any:
    """A plain hook giving ``fn`` the module's first input or output (the first call only); ``fn``'s result, where
    not ``None``, replaces it."""
    calls = [0]

    def pre(m: nn.Module, args: tuple) -> Any:
        calls[0] += 1
        new = fn(args[0]) if calls[0] == 1 else None
        return None if new is None else (new, *args[1:])

    def post(m: nn.Module, args: tuple, output: Any) -> Any:
        calls[0] += 1
        new = fn(first_output(output)) if calls[0] == 1 else None
        return None if new is None else replace_first_output(output, new)

    return module.register_forward_pre_hook(pre) if where == "in" else module.register_forward_hook(post)


def encoder_points(hm: Any) -> list[str]:
    return [n for n in hm.hook_names if not n.startswith("decoder") and not n.endswith(("_scores", "_pattern"))]


def test_no_hooks_is_hugging_face_bitwise(case):
    model, hm, batch, length = case
    enc = model.model.encoder
    with torch.no_grad():
        assert torch.equal(hm(**batch).logits, model(**batch).logits)
        assert enc.attention_type == "block_sparse" and length % enc.config.block_size != 0, "a padded forward"


def test_every_encoder_point_is_the_input_positions_of_the_hf_tensor(case):
    """Each point (read alone) is its module's tensor as a plain hook sees it, at the input's positions; the forward
    that caches them all gives Hugging Face's logits bitwise."""
    model, hm, batch, length = case
    table = sources(model, length)
    names = encoder_points(hm)
    assert sorted(table) == sorted(names), "every encoder point is checked"
    seen: dict[str, Tensor] = {}
    handles = [
        _attach(module, where, lambda t, name=name, f=f: seen.__setitem__(name, f(t)))
        for name, (module, where, f) in table.items()
    ]
    try:
        with torch.no_grad():
            logits, cache = hm.run_with_cache(**batch, names_filter=names)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        assert torch.equal(kit.logits_of(logits), model(**batch).logits)
    padded = length + model.config.block_size - length % model.config.block_size
    for name in names:
        assert cache[name].shape[:2] == (2, length), name
        assert seen[name].shape[1] in (length, padded), name
        assert torch.equal(cache[name], seen[name][:, :length]), name


def _edit_real(length: int) -> Callable[[Tensor], Tensor]:
    def edit(t: Tensor) -> Tensor:  # the input's positions nudged, the pad positions as they are
        return torch.cat([kit.nudge(t[:, :length]), t[:, length:]], dim=1)

    return edit


#: a point of each kind of site (embeddings' sum, block input, norm, shared q/k/v linears, per-head input, output,
#: MLP, pre-LN residual, final norm)
EDITED = [
    "hook_embed",
    "hook_pos_embed",
    "encoder.0.hook_resid_pre",
    "encoder.1.ln1.hook_normalized",
    "encoder.0.attn.hook_q",
    "encoder.1.attn.hook_v",
    "encoder.1.attn.hook_z",
    "encoder.0.hook_attn_out",
    "encoder.1.mlp.hook_pre",
    "encoder.0.mlp.hook_post",
    "encoder.1.hook_resid_post",
    "encoder_final_ln.hook_normalized",
]


def test_edits_are_plain_hook_edits_of_the_input_positions(case):
    """An edit (``nudge``) at a point of each kind (``EDITED``) is, on the logits, a plain hook editing the same
    positions of the module's padded tensor, bit for bit (and changes them). Left out: the norms' scales
    and ``hook_resid_mid`` (the residual between the branches, which no module computes: the norm after it and the
    block output both read it), whose edits need more than one plain hook; they go through the same slice and
    write-back as the others, and ``test_bart.py`` checks them on unpadded inputs."""
    model, hm, batch, length = case
    table = sources(model, length)
    with torch.no_grad():
        clean = model(**batch).logits
        for name in EDITED:
            module, where, _ = table[name]
            ours = kit.logits_of(hm.run_with_hooks(**batch, fwd_hooks=[(name, lambda t, hook: kit.nudge(t))]))
            if name == "hook_pos_embed":  # the positions a stack adds, shown [batch, pos, d_model]
                handle = _attach(module, where, lambda t: kit.nudge(t.expand(2, length, D)))
            else:
                handle = _attach(module, where, _edit_real(length))
            try:
                theirs = model(**batch).logits
            finally:
                handle.remove()
            assert torch.equal(ours, theirs), name
            assert not torch.equal(ours, clean), name
    assert not hm.has_hooks


def test_pad_positions_cannot_change_the_input_positions(case):
    """The premise: the pad positions transformers appends (masked as keys, their attention output zeroed as
    queries) leave the input's positions as they are, whatever they hold: large values written into them before
    each block give the same encoder output and logits, bitwise."""
    model, hm, batch, length = case
    enc = model.model.encoder

    def scramble(m: nn.Module, args: tuple) -> Any:
        x = args[0].clone()
        x[:, length:] = 50 * torch.sin(torch.arange(x[:, length:].numel(), dtype=x.dtype)).view(x[:, length:].shape)
        return (x, *args[1:])

    with torch.no_grad():
        clean = model(**batch)
        handles = [layer.register_forward_pre_hook(scramble) for layer in enc.layers]
        try:
            scrambled = model(**batch)
        finally:
            for h in handles:
                h.remove()
    assert torch.equal(scrambled.encoder_last_hidden_state, clean.encoder_last_hidden_state)
    assert torch.equal(scrambled.logits, clean.logits)


def test_float64_gradients_of_an_edit_are_plain_hooks(case):
    """A float64 edit at a residual point (``x + delta``, ``delta`` a leaf): the gradient of the logits with respect
    to ``delta`` is the same as through a plain hook adding it at the same positions of the padded tensor."""
    _, _, batch, length = case
    model = make(case[0].config.block_size, torch.float64)
    hm = HookedModel.wrap(model)
    layer = model.model.encoder.layers[1]
    try:
        delta = torch.zeros(2, length, D, dtype=torch.float64, requires_grad=True)
        ours = kit.logits_of(
            hm.run_with_hooks(**batch, fwd_hooks=[("encoder.1.hook_resid_pre", lambda t, hook: t + delta)])
        )
        (g_ours,) = torch.autograd.grad(ours.square().sum(), delta)
        delta2 = torch.zeros_like(delta, requires_grad=True)
        handle = _attach(layer, "in", lambda t: torch.cat([t[:, :length] + delta2, t[:, length:]], dim=1))
        try:
            theirs = model(**batch).logits
        finally:
            handle.remove()
        (g_theirs,) = torch.autograd.grad(theirs.square().sum(), delta2)
        assert torch.equal(ours, theirs)
        assert torch.equal(g_ours, g_theirs) and g_ours.abs().sum() > 0
    finally:
        hm.unwrap()
