"""Gradients through an edit of a pre-LN block's residual (``hook_resid_mid``, the decoder's
``hook_resid_mid_cross``) under gradient checkpointing, reentrant and not: the block adds each branch to its residual
in its own forward, so the edit's difference is carried into the next branch's output inside the layer, which a
checkpoint's recomputation recomputes with gradients (transformers 5.x runs a layer's own forward hooks outside
the checkpointed function: a block output rebuilt there from the no-grad first forward cuts the graph).

Float64, train mode without dropout. Each edit adds a leaf ``delta`` (random, nonzero). The reference is plain
PyTorch hooks on the Hugging Face modules making the same edit in the only form a hook inside a checkpointed layer
can: the norm after the residual reads ``x + delta``, the next branch's output gets ``+ delta`` (the block's own
residual add then carries it). Under the same checkpointing the gradients of every parameter, of the encoder's
``inputs_embeds`` and of each ``delta`` are theirs bit for bit; without checkpointing (the wrapped model then
rebuilds the block output as ``edited + mlp_out``, exactly) they agree up to float64 rounding (1e-12 relative).
"""

from __future__ import annotations

from typing import Any

import lensadapters_bart
import pytest
import torch
from torch import Tensor, nn
from transformers import AutoModelForSeq2SeqLM

from lensadapters import HookedModel
from lensadapters.plugin_api import first_output, replace_first_output
from lensadapters.testing import encoder_decoder as kit
from lensadapters.testing.models import reinit

#: the families whose blocks are pre-LN (PreLNResidualSite's)
PRE_LN = [t for t, f in lensadapters_bart.FAMILIES.items() if f.pre_ln]
D = 16


def make(model_type: str, block_size: int = 0) -> Any:
    config = lensadapters_bart.bart_config(
        layers=2, heads=2, d_model=D, ffn=24, vocab=40, scale_embedding=True, model_type=model_type
    )
    if block_size:  # BigBird block-sparse (an input of 15 tokens: padded to 16)
        config.attention_type, config.block_size, config.num_random_blocks = "block_sparse", block_size, 1
    torch.manual_seed(3)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager")
    reinit(model, 3)
    return model.to(torch.float64).train()


def batch_of(length: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 40, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    ids[1, -3:], mask[1, -3:] = 1, 0
    decoder = torch.randint(3, 40, (2, 5), generator=g)
    decoder[:, 0] = 2
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}


def edits(model: Any) -> list[tuple[str, nn.Module, nn.Module]]:
    """(point, the norm reading it, the branch whose output the block adds next) of each residual point edited."""
    enc, dec = model.model.encoder.layers[1], model.model.decoder.layers[0]
    return [
        ("encoder.1.hook_resid_mid", enc.final_layer_norm, enc.fc2),
        ("decoder.0.hook_resid_mid", dec.encoder_attn_layer_norm, dec.encoder_attn.out_proj),
        ("decoder.0.hook_resid_mid_cross", dec.final_layer_norm, dec.fc2),
    ]


def grads(model_type: str, length: int, checkpointing: Any, ours: bool, block_size: int = 0) -> dict[str, Tensor]:
    """The gradients of a loss on the logits, with each point of ``edits`` adding its ``delta``: through the wrapped
    model (``ours``) or plain hooks; ``checkpointing``: None, or whether reentrant."""
    model = make(model_type, block_size)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    batch = batch_of(length)
    g = torch.Generator().manual_seed(1)
    embeds = model.get_encoder().embed_tokens(batch.pop("input_ids")).detach().requires_grad_(True)
    points = edits(model)
    deltas = {
        n: (
            0.1 * torch.randn(2, 5 if n.startswith("decoder") else length, D, generator=g, dtype=torch.float64)
        ).requires_grad_(True)
        for n, _, _ in points
    }
    handles: list[Any] = []
    hm: Any = HookedModel.wrap(model) if ours else None
    if not ours:
        for name, norm, branch in points:
            pending: list[Tensor] = []

            def pre(m: nn.Module, args: tuple, delta: Tensor = deltas[name], pending: list = pending) -> Any:
                x = args[0]  # (BigBird's padded encoder: the delta on the input's positions)
                edited = torch.cat([x[:, : delta.shape[1]] + delta, x[:, delta.shape[1] :]], dim=1)
                pending[:] = [edited - x]
                return (edited, *args[1:])

            def post(m: nn.Module, args: tuple, output: Any, pending: list = pending) -> Any:
                return replace_first_output(output, first_output(output) + pending.pop())

            handles += [norm.register_forward_pre_hook(pre), branch.register_forward_hook(post)]
    try:
        if ours:
            hooks = [(n, lambda t, hook, d=deltas[n]: t + d) for n in deltas]
            logits = kit.logits_of(hm.run_with_hooks(inputs_embeds=embeds, **batch, fwd_hooks=hooks))
        else:
            logits = model(inputs_embeds=embeds, **batch).logits
        logits.square().sum().backward()  # (reentrant checkpointing takes no autograd.grad)
    finally:
        for h in handles:
            h.remove()
        if hm is not None:
            hm.unwrap()
    found = {"inputs_embeds": embeds.grad} | {f"delta {n}": d.grad for n, d in deltas.items()}
    return found | {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


CASES = [(t, 7, 0) for t in PRE_LN] + [("bigbird_pegasus", 15, 2)]


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize(("model_type", "length", "block_size"), CASES, ids=str)
def test_resid_mid_edit_gradients_under_checkpointing_are_plain_hooks(model_type, length, block_size, reentrant):
    """Edits of ``encoder.1.hook_resid_mid``, ``decoder.0.hook_resid_mid`` and ``decoder.0.hook_resid_mid_cross``
    at once, each pre-LN family (BigBird-Pegasus also block-sparse, padded from 15 tokens to 16): under
    checkpointing every gradient is the plain hooks' bit for bit; against the wrapped model without checkpointing
    each differs by at most 1e-12 of the largest gradient (measured: 7e-16; a few 1e-15 relative per tensor)."""
    ours = grads(model_type, length, reentrant, True, block_size)
    theirs = grads(model_type, length, reentrant, False, block_size)
    unchecked = grads(model_type, length, None, True, block_size)
    assert all(ours[f"delta {n}"].abs().sum() > 0 for n, _, _ in edits(make(model_type)))
    assert ours["inputs_embeds"].abs().sum() > 0
    assert sorted(ours) == sorted(theirs) == sorted(unchecked)
    differ = [n for n in theirs if not torch.equal(ours[n], theirs[n])]
    assert not differ, f"{len(differ)} of {len(theirs)} gradients differ from plain hooks: {differ}"
    top = max(g.abs().max().item() for g in unchecked.values())
    for name, grad in unchecked.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-12, atol=1e-12 * top, msg=name)
