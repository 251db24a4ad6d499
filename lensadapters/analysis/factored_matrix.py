"""``FactoredMatrix``: a low-rank matrix ``A @ B`` kept as its two factors (TransformerLens' class and API).

``hm.OV`` (``W_V @ W_O``, ``[n_layers, n_heads, d_model, d_model]``) and ``hm.QK`` (``W_Q @ W_K^T``) are
factored matrices: products, singular values, norms and eigenvalues come from the factors without building
the ``d_model x d_model`` products.
"""

from __future__ import annotations

from typing import Any, Union

import torch

Tensor = torch.Tensor


def _t(x: Tensor) -> Tensor:
    return x.transpose(-2, -1)


class FactoredMatrix:
    """``A @ B`` with ``A: [..., ldim, mdim]`` and ``B: [..., mdim, rdim]``; leading dimensions broadcast."""

    def __init__(self, A: Tensor, B: Tensor) -> None:
        if A.size(-1) != B.size(-2):
            raise ValueError(
                f"the factors must agree on the inner dimension; shapes were {tuple(A.shape)} and {tuple(B.shape)}"
            )
        self.ldim, self.mdim, self.rdim = A.size(-2), B.size(-2), B.size(-1)
        self.has_leading_dims = A.ndim > 2 or B.ndim > 2
        lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self.shape = torch.Size(lead + (self.ldim, self.rdim))
        self.A = A.broadcast_to(lead + (self.ldim, self.mdim))
        self.B = B.broadcast_to(lead + (self.mdim, self.rdim))
        self._svd: Any = None

    # --- products --------------------------------------------------------------------------------------

    def __matmul__(self, other: Union[Tensor, "FactoredMatrix"]) -> Union["FactoredMatrix", Tensor]:
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.ndim < 2:  # a vector: the product itself
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)
        if other.size(-2) != self.rdim:
            raise ValueError(f"shapes {tuple(self.shape)} and {tuple(other.shape)} do not multiply")
        # keep the smaller inner dimension
        return FactoredMatrix(self.A, self.B @ other) if self.rdim > self.mdim else FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Union[Tensor, "FactoredMatrix"]) -> Union["FactoredMatrix", Tensor]:
        if isinstance(other, FactoredMatrix):
            return other.A @ (other.B @ self)
        if other.size(-1) != self.ldim:
            raise ValueError(f"shapes {tuple(other.shape)} and {tuple(self.shape)} do not multiply")
        if other.ndim < 2:
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)
        return FactoredMatrix(other @ self.A, self.B) if self.ldim > self.mdim else FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: Union[int, float, Tensor]) -> "FactoredMatrix":
        if isinstance(scalar, Tensor) and scalar.numel() != 1:
            raise ValueError(f"* takes a scalar (got shape {tuple(scalar.shape)}); use @ for matrix products")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    @property
    def AB(self) -> Tensor:
        """The product ``A @ B`` (``[..., ldim, rdim]``; large)."""
        return self.A @ self.B

    @property
    def BA(self) -> Tensor:
        """The reverse product ``B @ A`` (only for ``ldim == rdim``)."""
        if self.rdim != self.ldim:
            raise ValueError(f"BA needs ldim == rdim; the shape is {tuple(self.shape)}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(_t(self.B), _t(self.A))

    # --- spectrum ------------------------------------------------------------------------------------

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(U, S, Vh)`` with ``U @ diag(S) @ Vh^T == A @ B`` (``Vh`` as TransformerLens: ``[..., rdim, mdim]``),
        from the SVDs of the factors."""
        if self._svd is None:
            Ua, Sa, Va = torch.svd(self.A)
            Ub, Sb, Vb = torch.svd(self.B)
            middle = Sa[..., :, None] * _t(Va) @ Ub * Sb[..., None, :]
            Um, Sm, Vm = torch.svd(middle)
            self._svd = (Ua @ Um, Sm, Vb @ Vm)
        return self._svd

    @property
    def U(self) -> Tensor:
        return self.svd()[0]

    @property
    def S(self) -> Tensor:
        return self.svd()[1]

    @property
    def Vh(self) -> Tensor:
        return self.svd()[2]

    @property
    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``A @ B`` (those of ``B @ A``: the non-zero ones agree), complex."""
        matrix = self.BA
        if matrix.dtype in (torch.float16, torch.bfloat16):
            matrix = matrix.float()
        return torch.linalg.eig(matrix).eigenvalues

    def norm(self) -> Tensor:
        """Frobenius norm, ``[...]``."""
        return self.S.pow(2).sum(-1).sqrt()

    def make_even(self) -> "FactoredMatrix":
        """The same matrix factored as ``(U sqrt(S), sqrt(S) Vh^T)``."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * _t(self.Vh))

    def collapse_l(self) -> Tensor:
        """``S Vh^T``: the right factor with the left one's orthogonal part removed, ``[..., mdim, rdim]``."""
        return self.S[..., :, None] * _t(self.Vh)

    def collapse_r(self) -> Tensor:
        """``U S``, ``[..., ldim, mdim]``."""
        return self.U * self.S[..., None, :]

    # --- shape ---------------------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pair(self) -> tuple[Tensor, Tensor]:
        return self.A, self.B

    def unsqueeze(self, k: int) -> "FactoredMatrix":
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    def get_corner(self, k: int = 3) -> Tensor:
        product = self.A[..., :k, :] @ self.B[..., :, :k]
        return product[tuple(slice(k) for _ in range(product.ndim))]

    def __getitem__(self, idx: Any) -> "FactoredMatrix":
        """Index the leading dimensions (and, with more indices, rows then columns: an int keeps its dimension)."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        count = len([i for i in idx if i is not None])
        lead = len(self.shape) - 2
        keep = [slice(i, i + 1) if isinstance(i, int) else i for i in idx]
        if count <= lead:
            return FactoredMatrix(self.A[idx], self.B[idx])
        if count == lead + 1:
            rows = tuple(idx[:-1]) + (keep[-1],)
            return FactoredMatrix(self.A[rows], self.B[tuple(idx[:-1])])
        if count == lead + 2:
            return FactoredMatrix(
                self.A[tuple(idx[:-2]) + (keep[-2],)], self.B[tuple(idx[:-2]) + (slice(None), keep[-1])]
            )
        raise ValueError(f"{idx} is too long an index for a FactoredMatrix of shape {tuple(self.shape)}")

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"
