"""The verification's references of the routing and per-expert points of a mixture of experts whose routing weights
scale the experts' *input* (``FusedExperts.scaled_input``, a router returning ``(scores, logits)``: Llama 4's form),
written out in plain PyTorch from the router's output, the experts module's input and output and the experts' live
3-D parameters. Nothing here reads a served point; :mod:`.verify` compares the two sides.

* ``mlp.hook_expert_weights`` ``[b, p, E]``: the router's scores as the model computes them (the sigmoid of the
  selected logits, zeros elsewhere). An edit changes the scores of the experts each token selected (the top-k of the
  logits); the selection stays the router's (``Routing.order="topk_sigmoid"``: an edit at an expert not selected
  is dropped; to send a token to another expert, edit ``mlp.hook_expert_indices``).
* ``mlp.hook_expert_indices`` ``[b, p, k]``: the top-k of the router's logits (``torch.topk``, as the router takes
  it). An edit sends each token to the edited experts, each slot keeping its score: the scores become the old
  slots' scores at the new experts, zeros elsewhere (what the router would return had it chosen those experts).
* ``mlp.experts.{e}.hook_gate`` / ``hook_pre`` / ``hook_post`` ``[n_e, d_mlp]`` and ``hook_result``
  ``[n_e, d_model]``: expert ``e`` on the rows it computes for the tokens that selected it (slot, then token:
  :func:`lensadapters.moe.expert_rows`), its input those tokens' MLP input *times their score* (the experts
  module's input block ``e``: the model scales before the expert), the gate and up products of that input with
  the expert's ``gate_up_proj`` slice, ``act(gate) * up`` and its product with ``down_proj``: the rows of block
  ``e`` of the experts module's output, what the expert adds to ``hook_mlp_out``. An edit recomputes what follows
  the edited step from the live parameters and puts the edited rows into the experts module's output.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.moe import FusedExperts, MoELayout

Tensor = torch.Tensor
Edit = Optional[Callable[[Tensor], Tensor]]

#: the per-expert points of a scaled-input MoE with a reference here, in the order an expert computes them
_STEPS = ("hook_gate", "hook_pre", "hook_post", "hook_result")


class _RouterReference:
    """Plain hooks on the router (``modules``) reading its scores, or the top-k of its logits, and editing them."""

    def __init__(self, router: nn.Module, top_k: int, what: str) -> None:
        self.modules, self.top_k, self.what = (router,), top_k, what

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            scores, logits = output[0], output[1]
            index = torch.topk(logits, self.top_k, dim=-1).indices
            if self.what == "weights":
                seen.append(scores.detach().clone())
                if edit is None:
                    return None
                selected = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, True)
                return (torch.where(selected, edit(scores), scores), *output[1:])
            seen.append(index.clone())
            if edit is None:
                return None
            moved = edit(index)
            return (torch.zeros_like(scores).scatter(-1, moved, scores.gather(-1, index)), *output[1:])

        return [self.modules[0].register_forward_hook(post)]

    def integer_delta(self, index: Tensor) -> Tensor:
        """An edit of the indices ``[..., k]`` for the check: each token's first slot moved to the next expert it
        did not select (none where it selected every expert), so that no expert is in two slots."""
        n = self.n_experts
        first, new = index[..., 0], index[..., 0].clone()
        pending = torch.ones_like(first, dtype=torch.bool)
        for j in range(1, n):
            candidate = (first + j) % n
            free = pending & ~(candidate.unsqueeze(-1) == index).any(-1)
            new = torch.where(free, candidate, new)
            pending &= ~free
        delta = torch.zeros_like(index)
        delta[..., 0] = new - first
        return delta

    n_experts = 0


class _ExpertReference:
    """Plain hooks on the router (recording which tokens selected expert ``e``, in which slot) and on the experts
    module (its input block ``e`` at those rows, the expert's steps written out from its live parameters, an edited
    step's consequences put into block ``e`` of its output)."""

    def __init__(self, router: nn.Module, experts: nn.Module, spec: FusedExperts, top_k: int, e: int, step: str):
        self.modules = (router, experts)
        self.spec, self.top_k, self.e, self.step = spec, top_k, e, step
        #: for an expert no token of the probe selects: every token's first slot sent to it (the scores of that slot
        #: moved there), as an edit of ``mlp.hook_expert_indices`` would (:func:`.verify.check_points`)
        self.routed_here = False

    def _weight(self, name: str) -> Tensor:
        w = getattr(self.modules[1], name)[self.e]
        return w if self.spec.transposed else w.T  # [in, out]

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        router, experts = self.modules
        routed: list[Tensor] = []

        def on_router(module: nn.Module, args: tuple, output: Any) -> Any:
            scores, logits = output[0], output[1]
            index = torch.topk(logits, self.top_k, dim=-1).indices
            moved = index.clone()
            if self.routed_here:
                moved[..., 0] = self.e
            _, token = torch.where(moved.T == self.e)  # slot, then token
            routed[:] = [token]
            if not self.routed_here:
                return None
            return (torch.zeros_like(scores).scatter(-1, moved, scores.gather(-1, index)), *output[1:])

        def on_experts(module: nn.Module, args: tuple, output: Tensor) -> Any:
            (token,) = routed
            n = getattr(module, self.spec.gate_up).shape[0]
            block = args[0].unflatten(0, (n, -1))[self.e]
            x = block[token]
            both = x @ self._weight(self.spec.gate_up)
            if self.spec.interleaved:
                gate, up = both[..., ::2], both[..., 1::2]
            else:
                gate, up = both.chunk(2, dim=-1)
            act = getattr(module, self.spec.act)
            values = {"hook_gate": gate, "hook_pre": up}
            values["hook_post"] = act(gate) * up
            values["hook_result"] = values["hook_post"] @ self._weight(self.spec.down)
            seen.append(values[self.step].detach().clone())
            if edit is None:
                return None
            edited = edit(values[self.step])
            if self.step in ("hook_gate", "hook_pre"):
                gate, up = (edited, up) if self.step == "hook_gate" else (gate, edited)
                edited = act(gate) * up
            if self.step != "hook_result":
                edited = edited @ self._weight(self.spec.down)
            out = output.clone()
            out.unflatten(0, (n, -1))[self.e, token] = edited.to(out.dtype)
            return out

        return [router.register_forward_hook(on_router), experts.register_forward_hook(on_experts)]


def scaled_input_reference(get: Callable[[str], nn.Module], moe: MoELayout, rest: str) -> Optional[tuple[Any, bool]]:
    """``(spec of a "hooks" reference, whether the point is [b, p, ...] shown from [b * p, ...])`` of the point
    ``rest`` of a scaled-input MoE (see the module docstring); ``None`` for another point or another MoE."""
    experts = moe.experts
    if not (isinstance(experts, FusedExperts) and experts.scaled_input and moe.router_output == "scores_logits"):
        return None
    if experts.gate_up_bias or experts.down_bias or experts.glu is not None:
        return None
    k = moe.routing.top_k
    if rest in ("mlp.hook_expert_weights", "mlp.hook_expert_indices"):
        ref = _RouterReference(get(moe.router), k, "weights" if rest.endswith("weights") else "indices")
        ref.n_experts = moe.routing.n_experts
        return ref, True
    parts = rest.split(".")
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit() and parts[3] in _STEPS:
        e = int(parts[2])
        if e < moe.routing.n_experts:
            return _ExpertReference(get(moe.router), get(experts.module), experts, k, e, parts[3]), False
    return None
