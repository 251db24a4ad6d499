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
from lensadapters.testing import run_at_a_barrier
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


# --- per-forward state: threads, nested calls, gradient checkpointing -------------------------------------------

#: two block-sparse inputs for block_size 2 (longer than 14), padded to different lengths (16 and 20)
LENGTHS = (15, 19)
#: an edit of each forward (a residual point and a point under the attention wrapper)
EDIT_OF = {15: "encoder.0.hook_resid_mid", 19: "encoder.1.attn.hook_v"}


@pytest.fixture(scope="module")
def block2() -> Any:
    model = make(2)
    hm = HookedModel.wrap(model)
    yield model, hm
    hm.unwrap()


def _record_and_edit(hm: Any, length: int, extra: list[Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """The logits and every encoder point of one forward on ``batch_of(length)`` (each read, ``EDIT_OF[length]``
    edited by ``nudge``), with ``extra`` hooks too."""
    seen: dict[str, Tensor] = {}

    def record(t: Tensor, hook: Any) -> None:
        seen[hook.name] = t.detach().clone()

    hooks: list[Any] = [(name, record) for name in encoder_points(hm)]
    hooks.append((EDIT_OF[length], lambda t, hook: kit.nudge(t)))
    logits = kit.logits_of(hm.run_with_hooks(**batch_of(length), fwd_hooks=hooks + extra))
    return logits, seen


def _same(got: tuple[Tensor, dict[str, Tensor]], expected: tuple[Tensor, dict[str, Tensor]], what: str) -> None:
    assert torch.equal(got[0], expected[0]), f"{what}: logits"
    assert sorted(got[1]) == sorted(expected[1]), what
    for name, value in expected[1].items():
        assert got[1][name].shape == value.shape and torch.equal(got[1][name], value), f"{what}: {name}"


def test_two_threads_get_exactly_their_sequential_values(block2):
    """Two threads run the wrapped model at once on inputs padded to different lengths (each with its own hooks:
    every encoder point read, one edited), held together by a barrier at points of both blocks, so each forward
    runs while the other is between its stack's start and end: each gets bit for bit what it gets alone."""
    model, hm = block2
    with torch.no_grad():
        expected = {n: _record_and_edit(hm, n, []) for n in LENGTHS}
    meet = ("encoder.0.attn.hook_q", "encoder.0.hook_mlp_out", "encoder.1.hook_resid_mid")

    def run(length: int, hooks: list) -> tuple[Tensor, dict[str, Tensor]]:
        with torch.no_grad():
            return _record_and_edit(hm, length, hooks)

    results = run_at_a_barrier(run, LENGTHS, meet)
    for n in LENGTHS:
        _same(results[n], expected[n], f"length {n}")
    assert not hm.has_hooks


def test_a_nested_forward_leaves_the_outer_values_exact(block2):
    """A hook of the outer forward (length 15, padded to 16) runs the model on another input (19, padded to 20)
    between the outer stack's start and its later points: the outer forward's points and edit are those of a run
    without it, bit for bit, and the nested call gives Hugging Face's logits."""
    model, hm = block2
    inner = batch_of(LENGTHS[1])
    with torch.no_grad():
        expected = _record_and_edit(hm, LENGTHS[0], [])
        clean_inner = model(**inner).logits
        nested: list[Tensor] = []

        def call_again(t: Tensor, hook: Any) -> None:
            nested.append(hm(**inner).logits)

        got = _record_and_edit(hm, LENGTHS[0], [("encoder.0.hook_attn_out", call_again)])
    _same(got, expected, "the outer forward")
    assert len(nested) == 1 and torch.equal(nested[0], clean_inner)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_recomputes_with_each_forwards_lengths(reentrant):
    """Train mode (no dropout) with gradient checkpointing, float64: two forwards padded to different lengths (16,
    20), each adding a leaf ``delta`` at ``encoder.1.mlp.hook_pre`` (inside the checkpointed layer: recomputed
    during backward), then one backward of both losses. The recomputed layers of each forward show and edit that
    forward's positions: the gradients (of each ``delta`` and of the parameters) are bit for bit those of plain
    PyTorch hooks adding each ``delta`` at the same positions of ``fc1``'s padded output, under the same
    checkpointing, and those without checkpointing up to float64 rounding (reentrant checkpointing's own
    recomputation differs from a plain backward by a few ulps, hooks or not)."""

    def grads(checkpointing: bool, ours: bool) -> dict[str, Any]:
        model: Any = make(2, torch.float64).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        hm: Any = HookedModel.wrap(model)
        deltas = {n: torch.zeros(2, n, 24, dtype=torch.float64, requires_grad=True) for n in LENGTHS}
        by_padded = {n + 1: (n, deltas[n]) for n in LENGTHS}  # block_size 2: padded by one

        def plain(module: nn.Module, args: tuple, output: Tensor) -> Tensor:  # every call, recomputations too
            n, delta = by_padded[output.shape[1]]
            return torch.cat([output[:, :n] + delta, output[:, n:]], dim=1)

        handle = None if ours else model.model.encoder.layers[1].fc1.register_forward_hook(plain)
        try:
            loss = torch.zeros((), dtype=torch.float64)
            for n in LENGTHS:
                edit = [("encoder.1.mlp.hook_pre", lambda t, hook, delta=deltas[n]: t + delta)] if ours else []
                loss = loss + kit.logits_of(hm.run_with_hooks(**batch_of(n), fwd_hooks=edit)).square().sum()
            loss.backward()  # reentrant checkpointing takes no autograd.grad
        finally:
            if handle is not None:
                handle.remove()
            hm.unwrap()
        found = {f"delta{n}": delta.grad for n, delta in deltas.items()}
        return found | {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ours, theirs, unchecked = grads(True, True), grads(True, False), grads(False, True)
    assert all(ours[f"delta{n}"].abs().sum() > 0 for n in LENGTHS)
    assert sorted(ours) == sorted(theirs) == sorted(unchecked)
    for name, grad in theirs.items():
        assert torch.equal(ours[name], grad), name
        torch.testing.assert_close(ours[name], unchecked[name], rtol=1e-12, atol=1e-12, msg=name)


# --- bfloat16 -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"block{s[0]}-len{s[1]}")
def bf16_case(request: Any) -> Any:
    block_size, length = request.param
    model = make(block_size, torch.bfloat16)
    hm = HookedModel.wrap(model)
    yield model, hm, batch_of(length), length
    hm.unwrap()


def test_bfloat16_no_hooks_reads_and_edits_are_plain_hooks_bitwise(bf16_case):
    """The wrapped model in bfloat16, block-sparse and padded: no hooks, each encoder point read (the norms' scales
    included) and an edit at a point of each kind (``EDITED``) are bit for bit what the model and plain PyTorch
    hooks on its modules give in bfloat16."""
    test_no_hooks_is_hugging_face_bitwise(bf16_case)
    test_every_encoder_point_is_the_input_positions_of_the_hf_tensor(bf16_case)
    test_edits_are_plain_hook_edits_of_the_input_positions(bf16_case)
    model = bf16_case[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
