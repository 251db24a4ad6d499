"""Weight-based circuit analysis on a HookedModel, as TransformerLens' ``HookedTransformer`` offers it:
``OV``, ``QK``, ``all_composition_scores``, ``tokens_to_residual_directions``, ``accumulated_bias``.

Everything is computed from the live weights on access (``W_Q``, ``W_O``... through the plugins), with no
norm folded in: TransformerLens' values on a model loaded without weight processing.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from lensadapters.analysis.factored_matrix import FactoredMatrix
from lensadapters.analysis.utils import composition_scores
from lensadapters.wiring import weights as _w

Tensor = torch.Tensor


class CircuitsMixin:
    """``hm.OV``, ``hm.QK`` and friends (mixed into :class:`lensadapters.HookedModel`)."""

    cfg: Any
    wiring: Any

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_K^T`` per head, ``[n_layers, n_heads, d_model, d_model]`` (key/value heads repeated under GQA)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))  # type: ignore[attr-defined]

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per head, ``[n_layers, n_heads, d_model, d_model]``."""
        return FactoredMatrix(self.W_V, self.W_O)  # type: ignore[attr-defined]

    def all_composition_scores(self, mode: str) -> Tensor:
        """Composition scores of every head pair, ``[n_layers, n_heads, n_layers, n_heads]``: how much the output
        of head (L1, H1) feeds the queries (``"Q"``), keys (``"K"``) or values (``"V"``) of head (L2, H2); zero
        unless L1 < L2."""
        left = self.OV
        if mode == "Q":
            right = self.QK
        elif mode == "K":
            right = self.QK.T
        elif mode == "V":
            right = self.OV
        else:
            raise ValueError(f"mode must be 'Q', 'K' or 'V', not {mode!r}")
        scores = composition_scores(left, right, broadcast_dims=True)
        layers = torch.arange(self.cfg.n_layers, device=scores.device)
        later = layers[:, None, None, None] < layers[None, None, :, None]
        return torch.where(later, scores, torch.zeros_like(scores))

    def all_head_labels(self) -> list[str]:
        return [f"L{i}H{h}" for i in range(self.cfg.n_layers) for h in range(self.cfg.n_heads)]

    def tokens_to_residual_directions(self, tokens: Union[str, int, Tensor]) -> Tensor:
        """The unembedding direction of each token: ``W_U[:, token]`` — ``[d_model]`` for one token (an int, a
        one-element tensor, or a string that is one token), ``[..., d_model]`` for a tensor of tokens."""
        W_U = self.W_U  # type: ignore[attr-defined]
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return W_U[:, tokens.to(W_U.device)].movedim(0, -1)
        if isinstance(tokens, str):
            token = self.to_single_token(tokens)  # type: ignore[attr-defined]
        elif isinstance(tokens, int):
            token = tokens
        elif isinstance(tokens, Tensor) and tokens.numel() == 1:
            token = int(tokens.item())
        else:
            raise ValueError(f"tokens must be a string, an int or a tensor of token ids, not {type(tokens).__name__}")
        return W_U[:, token]

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """The sum of the attention (``b_O``) and MLP (``b_out``) output biases written to the residual stream
        before block ``layer`` (``mlp_input``: and block ``layer``'s attention bias), ``[d_model]``."""
        n = self.cfg.n_layers
        if not 0 <= layer <= n:
            raise ValueError(f"layer must be in [0, {n}], not {layer}")
        if mlp_input and layer >= n:
            raise ValueError("mlp_input needs a block: layer < n_layers")
        total = None
        parts: list[Tensor] = []
        for i in range(layer):
            parts.append(_w.layer_weight(self.wiring, "b_O", i))
            if include_mlp_biases:
                parts.append(_w.layer_weight(self.wiring, "b_out", i))
        if mlp_input:
            parts.append(_w.layer_weight(self.wiring, "b_O", layer))
        for part in parts:
            total = part.float() if total is None else total + part.float().to(total.device)
        if total is None:
            return torch.zeros(self.cfg.d_model, dtype=self.cfg.dtype, device=self.cfg.device)
        return total.to(parts[0].dtype)
