"""The ellipsoid a LayerNorm/RMSNorm maps onto, from its gain and bias alone (Riechers 2024).

Pure linear algebra, no model: :mod:`.ellipsoid` (our models) and :mod:`.bridge` (TransformerBridges)
both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from jaxtyping import Float
from torch import Tensor

from interp_norm.errors import GeometryError

__all__ = ["NormEllipsoid", "norm_ellipsoid"]


@dataclass(frozen=True, eq=False)
class NormEllipsoid:
    """The image of a LayerNorm/RMSNorm with gain g and bias b (Riechers 2024).

    LayerNorm: outputs y lie in the hyperplane through ``center`` = b with unit ``normal`` ∝ 1/g
    (Σ_n (y_n − b_n)/g_n = 0), inside the (N−1)-dim ellipsoid zᵀ Q z ≤ N (z = y − b) with
    Q = Π₂ diag(1/g²) Π₂, Π₂ = I − α̂α̂ᵀ. ``axes`` [N−1, N] (rows) are Q's eigenvectors with nonzero
    eigenvalue λ, ``semi_axes`` = √(N/λ), longest first. RMSNorm: no hyperplane (``normal`` None),
    Q = diag(1/g²), N axes of length √N·|g_n|. ``membership(y)`` = zᵀQz/N = σ²/(σ²+ε) < 1 for any output.
    """

    kind: str
    gain: Tensor
    center: Tensor
    normal: Optional[Tensor]
    semi_axes: Tensor

    @property
    def quad(self) -> Tensor:
        """Q [N, N], computed on access (a model has one ellipsoid per norm: dense matrices are not kept)."""
        return _decompose(self.gain, self.kind)[1]

    @property
    def axes(self) -> Tensor:
        """The semi-axes' directions [n_axes, N] (rows, longest first), computed on access like :attr:`quad`."""
        return _decompose(self.gain, self.kind)[2]

    @property
    def dim(self) -> int:
        return int(self.gain.numel())

    def membership(self, y: Float[Tensor, "... N"]) -> Float[Tensor, "..."]:
        """zᵀQz/N with z = y − b, computed as |Π₂z / g|²/N (O(N) per vector, same value)."""
        z = torch.as_tensor(y).double() - self.center
        if self.normal is not None:
            z = z - (z @ self.normal).unsqueeze(-1) * self.normal
        return ((z / self.gain) ** 2).sum(-1) / self.dim

    def plane_residual(self, y: Float[Tensor, "... N"]) -> Float[Tensor, "..."]:
        """(y − b)·α̂: 0 on the hyperplane (always 0 for RMSNorm)."""
        z = torch.as_tensor(y).double() - self.center
        if self.normal is None:
            return torch.zeros(z.shape[:-1], dtype=torch.float64)
        return z @ self.normal


def norm_ellipsoid(gain: Tensor, bias: Optional[Tensor] = None, kind: str = "ln") -> NormEllipsoid:
    """Principal axes of the norm's image; raises :class:`GeometryError` for zero gains.

    The (N−1)-dim eigenproblem is solved in an orthonormal basis of the hyperplane (same nonzero
    spectrum as Π₂ diag(1/g²) Π₂, without having to guess which eigenvalue is the structural zero).
    """
    if kind not in ("ln", "rms"):
        raise GeometryError(f"kind must be 'ln' (LayerNorm) or 'rms' (RMSNorm), got {kind!r}")
    g = torch.as_tensor(gain).detach().double().cpu().reshape(-1)
    N = g.numel()
    if N < (2 if kind == "ln" else 1):
        raise GeometryError(f"a {kind} norm over {N} dimension(s) has no ellipsoid; need N >= 2 for LayerNorm")
    zero = (g == 0).nonzero().flatten().tolist()
    if zero:
        raise GeometryError(
            f"the gain is zero in {len(zero)} dimension(s) {zero[:10]}; the image then collapses to a lower-"
            "dimensional ellipsoid (Riechers treats this with a Drazin inverse, not implemented). "
            "Drop those dimensions (gain[gain != 0]) or perturb them before calling norm_ellipsoid"
        )
    if not torch.isfinite(g).all():
        raise GeometryError("the gain has non-finite entries")
    b = torch.zeros(N, dtype=torch.float64) if bias is None else torch.as_tensor(bias).detach().double().cpu().reshape(-1)
    if b.numel() != N:
        raise GeometryError(f"bias has {b.numel()} entries but the gain has {N}")
    normal, _, _, semi = _decompose(g, kind)  # the N×N matrices are freed here: 16 MB each at N = 1024
    return NormEllipsoid(kind=kind, gain=g, center=b, normal=normal, semi_axes=semi)


def _decompose(g: Tensor, kind: str) -> tuple[Optional[Tensor], Tensor, Tensor, Tensor]:
    """(normal, Q, axes [rows], semi-axes longest first) of the norm with gain ``g`` (float64)."""
    N = g.numel()
    Ginv2 = torch.diag(1.0 / g**2)
    if kind == "rms":
        lam, V = torch.linalg.eigh(Ginv2)
        normal, quad = None, Ginv2
    else:
        alpha = 1.0 / g
        normal = alpha / alpha.norm()
        P2 = torch.eye(N, dtype=torch.float64) - torch.outer(normal, normal)
        quad = P2 @ Ginv2 @ P2
        # orthonormal basis of the hyperplane ⊥ normal: the complement from a full QR
        Qf, _ = torch.linalg.qr(torch.cat([normal[:, None], torch.eye(N, dtype=torch.float64)], 1), mode="complete")
        B = Qf[:, 1:N]
        lam, W = torch.linalg.eigh(B.T @ Ginv2 @ B)
        V = B @ W
    semi = torch.sqrt(N / lam)
    order = torch.argsort(semi, descending=True)
    return normal, quad, V[:, order].T.contiguous(), semi[order]
