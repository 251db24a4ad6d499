"""Gradients through edits in bfloat16, the dtype 7-8B models run in: at every Llama point a plain PyTorch hook on
the Hugging Face modules can also edit, the gradient of a metric with respect to an edit ``x + p * c`` made at our
point is bit for bit the gradient of the same edit made by that plain hook (and so are the logits). The float64
contract checks gradients against finite differences; this checks that nothing of ours changes the bfloat16
numbers of the backward pass (an extra cast, a copy in another dtype, a recomputation in another order)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from lensadapters_llama.testing import llama_config, make, wrap

HEADS, HEAD_DIM = 4, 8


#: our point -> (the Hugging Face module under ``model.model.layers[1]`` whose input ("pre") or output ("out") is
#: that point's value, up to its shape)
PLAIN: dict[str, tuple[str, str]] = {
    "blocks.1.hook_resid_pre": ("", "pre"),
    "blocks.1.hook_resid_post": ("", "out"),
    "blocks.1.attn.hook_q": ("self_attn.q_proj", "out"),
    "blocks.1.attn.hook_k": ("self_attn.k_proj", "out"),
    "blocks.1.attn.hook_v": ("self_attn.v_proj", "out"),
    "blocks.1.attn.hook_z": ("self_attn.o_proj", "pre"),
    "blocks.1.hook_attn_out": ("self_attn", "out"),
    "blocks.1.mlp.hook_post": ("mlp.down_proj", "pre"),
    "blocks.1.hook_mlp_out": ("mlp", "out"),
}


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    config = llama_config(
        hidden=HEADS * HEAD_DIM, layers=3, n_heads=HEADS, n_kv=2, head_dim=HEAD_DIM, d_mlp=48, vocab=64
    )
    plain = make(config, seed=3).to(torch.bfloat16)
    ours = make(config, seed=3).to(torch.bfloat16)
    return plain, wrap(ours)


def _edit(x: torch.Tensor, p: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    return x + p * direction.reshape(x.shape)


def _plain_hook(module: torch.nn.Module, kind: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if kind == "pre":

        def pre(mod, args, kwargs):  # noqa: ANN001, ANN202
            if args:
                return (edit(args[0]), *args[1:]), kwargs
            key = next(k for k in ("hidden_states", "input") if k in kwargs)
            return args, {**kwargs, key: edit(kwargs[key])}

        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def out(mod, args, output):  # noqa: ANN001, ANN202
        if isinstance(output, tuple):
            return (edit(output[0]), *output[1:])
        return edit(output)

    return module.register_forward_hook(out)


def _metric_and_gradient(run: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.zeros((), dtype=torch.bfloat16, requires_grad=True)
    logits = run(p)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5)).to(logits.dtype)
    (logits * weights).float().sum().backward()
    assert p.grad is not None
    return logits.detach(), p.grad


@pytest.mark.parametrize("point", sorted(PLAIN))
def test_a_bfloat16_gradient_through_an_edit_is_a_plain_hooks_bit_for_bit(models, point: str) -> None:
    plain, hm = models
    ids = torch.randint(0, plain.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    seen: dict[str, torch.Size] = {}
    with torch.no_grad():
        hm.run_with_hooks(ids, fwd_hooks=[(point, lambda t, hook: seen.setdefault("shape", t.shape) and None)])
    direction = torch.randn(seen["shape"], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def ours(p: torch.Tensor) -> torch.Tensor:
        return hm.run_with_hooks(ids, fwd_hooks=[(point, lambda t, hook: _edit(t, p, direction))])

    def theirs(p: torch.Tensor) -> torch.Tensor:
        path, kind = PLAIN[point]
        module = plain.model.layers[1].get_submodule(path) if path else plain.model.layers[1]
        handle = _plain_hook(module, kind, lambda x: _edit(x, p, direction))
        try:
            return plain(ids).logits
        finally:
            handle.remove()

    our_logits, our_grad = _metric_and_gradient(ours)
    plain_logits, plain_grad = _metric_and_gradient(theirs)
    assert torch.equal(our_logits, plain_logits), f"{point}: logits differ by {(our_logits - plain_logits).abs().max()}"
    assert our_grad != 0, f"{point}: the edit has no gradient"
    assert torch.equal(our_grad, plain_grad), f"{point}: gradient {our_grad} against a plain hook's {plain_grad}"
