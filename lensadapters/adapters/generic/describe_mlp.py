"""The dense MLP's description: the output projection and the one or two (or one fused gate-up) projections of the
MLP's input whose outputs, through the activation the MLP module or the config names (or else SiLU or ReLU),
reproduce the down projection's input. What this does not cover is tried as a mixture of experts (:mod:`.moe`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.description_types import MLP, NotDescribed, _is_linear
from lensadapters.adapters.generic.norms import norm_behaviour
from lensadapters.adapters.generic.probe import Recording, _close
from lensadapters.adapters.vlm import text_config
from lensadapters.hooks.specs import (
    FusedGateUp,
    MLPLayout,
    cat_gate_up,
    chunk_gate_up,
)

Tensor = torch.Tensor
#: activations tried (each checked on the probe) after the MLP module's own and the config's: none of them can pass
#: for another on the probe (GELU's exact and tanh forms can, on small inputs: neither is guessed)
COMMON_ACTIVATIONS = ("silu", "relu")


def _activation(module: nn.Module, config: Any) -> list[tuple[Optional[str], Callable[[Tensor], Tensor]]]:
    """Candidate activations: the MLP module's own (``act_fn``, ``act``, ``activation_fn``...), then the config's,
    then :data:`COMMON_ACTIVATIONS`."""
    from transformers.activations import ACT2FN

    found: list[tuple[Optional[str], Callable[[Tensor], Tensor]]] = []
    for name in ("act_fn", "act", "activation_fn", "activation", "act_func"):
        fn = getattr(module, name, None)
        if callable(fn):
            found.append((None, fn))
    # a parameter-free child module of the MLP (Bloom's ``gelu_impl``): the activation where it reproduces the values
    found += [(None, child) for child in module.children() if next(child.parameters(), None) is None]
    for key in ("hidden_act", "hidden_activation", "activation_function", "act_fn"):
        act_name = getattr(config, key, None)
        if isinstance(act_name, str) and act_name in ACT2FN:
            found.append((act_name, ACT2FN[act_name]))
    names = [n for n, _ in found if n is not None]
    # then the common activations under their own names (a module that calls F.silu and names none in its config)
    return [(names[0] if names else n, fn) for n, fn in found] + [(n, ACT2FN[n]) for n in COMMON_ACTIVATIONS]


def _before_sub_norm(layer: nn.Module, i: int, mlp: str, rec: Recording, post: Tensor) -> Tensor:
    """The MLP's hidden before a norm between it and the down projection (BitNet's ``ffn_sub_norm``: a child of the
    MLP module that is LayerNorm or RMSNorm of its input and gives the down projection's input), else ``post``.
    ``mlp.hook_post`` stays the down projection's input (after the norm): an edit there is what the projection reads,
    and the norm sits between the activation and ``hook_post`` as the model computes it."""
    prefix = mlp + "."
    for (layer_i, path), (a, b) in rec.inner.items():
        if layer_i != i or not path.startswith(prefix) or a is None or b is None or not _close(b, post):
            continue
        module = layer.get_submodule(path)
        if not _is_linear(module) and a.shape == b.shape and norm_behaviour(module, a, b) is not None:
            return a
    return post


def _constants(config: Any) -> list[float]:
    from lensadapters.adapters.generic.parallel import _constants as numbers

    return numbers(config)


def _scaled_output(linears: dict[str, Any], readers: list[str], y: Tensor, config: Any) -> tuple[list[str], float]:
    """``([path], c)``: the one linear module of the MLP (not reading its input) whose output times a constant of
    the config other than 1 is the MLP's output (the constant estimated by least squares, then the config's numbers
    tried nearest first); ``([], 1.0)`` where none is."""
    from lensadapters.adapters.generic.parallel import _by_distance, _estimates

    if config is None:
        return [], 1.0
    for p, (_, b) in linears.items():
        if p in readers or b is None or b.shape != y.shape:
            continue
        estimate = _estimates(y, [b])
        if estimate is None:
            continue
        for c in _by_distance(estimate[0], _constants(config), y.dtype)[:8]:
            if c != 1.0 and _close(b * c, y):
                return [p], c
    return [], 1.0


def _describe_mlp(
    model: nn.Module, layer: nn.Module, i: int, mlp: str, rec: Recording
) -> tuple[MLP, bool, Optional[str]]:
    prefix = mlp + "."
    x, y = rec.inner.get((i, mlp), (None, None))
    if x is None or y is None:
        raise NotDescribed("the probe saw no input or output of the MLP module")
    linears: dict[str, Any] = {
        path[len(prefix) :]: io
        for (layer_i, path), io in rec.inner.items()
        if layer_i == i and path.startswith(prefix) and _is_linear(layer.get_submodule(path)) and io[0] is not None
    }
    down = [p for p, (a, b) in linears.items() if _close(b, y)]
    readers = [p for p, (a, b) in linears.items() if _close(a, x) and p not in down]
    out_scale = 1.0
    if not down and 1 <= len(readers) <= 2:  # the output projection's output times a constant of the config
        down, out_scale = _scaled_output(linears, readers, y, rec.config)
    if len(down) != 1 or not 1 <= len(readers) <= 2:
        raise NotDescribed("the MLP is not one or two projections of its input and one output projection")
    post = _before_sub_norm(layer, i, mlp, rec, linears[down[0]][0])
    acts = _activation(layer.get_submodule(mlp), text_config(model))
    out = f"{mlp}.{down[0]}"
    for name, act in acts:
        if len(readers) == 2:
            for gate, up in (readers, readers[::-1]):
                if _close(act(linears[gate][1]) * linears[up][1], post):
                    return MLPLayout(f"{mlp}.{gate}", out, f"{mlp}.{up}", out_scale=out_scale), True, name
        else:
            pre = linears[readers[0]][1]
            if pre is not None and pre.shape[-1] == 2 * post.shape[-1]:
                gate_t, up_t = chunk_gate_up(pre)
                if _close(act(gate_t) * up_t, post):
                    return FusedGateUp(f"{mlp}.{readers[0]}", out, chunk_gate_up, cat_gate_up), True, name
            elif _close(act(pre), post):
                return MLPLayout(f"{mlp}.{readers[0]}", out, out_scale=out_scale), False, name
    # the activation's input times a constant of the config (an MLP multiplier: act(gate(x) * c) * up(x))
    for c in _constants(rec.config)[1:] if rec.config is not None else []:
        for name, act in acts:
            if len(readers) == 2:
                for gate, up in (readers, readers[::-1]):
                    if _close(act(linears[gate][1] * c) * linears[up][1], post):
                        layout = MLPLayout(f"{mlp}.{gate}", out, f"{mlp}.{up}", pre_scale=c, out_scale=out_scale)
                        return layout, True, name
            elif linears[readers[0]][1].shape[-1] == post.shape[-1] and _close(act(linears[readers[0]][1] * c), post):
                return MLPLayout(f"{mlp}.{readers[0]}", out, pre_scale=c, out_scale=out_scale), False, name
    raise NotDescribed("no activation named by the config or the MLP module reproduces the down projection's input")
