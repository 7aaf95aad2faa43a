"""Tolerances derived from what a comparison claims, never from one machine's figures.

Two float32 computations of the same function that sum in different orders (another tile size,
another BLAS blocking, another CPU's vector kernels, another process layout) differ by rounding:
a sum of ``n`` terms computed in any order is within ``n * u * sum(|terms|)`` of the exact sum
(Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2), ``u = eps / 2``; two orders are
within twice that of each other. :func:`reordered` turns the longest chain of sums a result goes
through into a tolerance relative to the result's magnitude (or 1 if smaller, where absolute
rounding of O(1) intermediates dominates).

What the optimizer does with such differences is another matter: AdamW divides each moment by
``sqrt(v) + adam_eps``, so with the default ``adam_eps = 1e-8`` a coordinate whose gradient is
within float32 rounding of zero (~1e-8 absolute on O(0.1) gradients) moves by up to ``lr`` in a
direction that rounding decides. Comparisons *after* optimizer steps therefore run AdamW with
:data:`LIPSCHITZ_ADAMW`, whose step is Lipschitz in the gradient with constant ``lr /
adam_eps``, so the weights after a step differ by at most that times the gradients' difference.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps

#: AdamW whose step moves a weight by at most ``lr / adam_eps = 0.01`` per unit of gradient
#: difference (and by ``~lr * g`` for the O(0.1) gradients of the tiny models): two engines whose
#: float32 gradients agree to ~1e-6 stay within ~1e-8 of each other after a step.
LIPSCHITZ_ADAMW = {"lr": 1e-2, "adam_eps": 1.0}


def reordered(terms: int) -> float:
    """Relative tolerance for two float32 computations of the same result that sum ``terms``
    terms in total, in different orders (``terms * eps``: twice Higham's ``n * u``)."""
    return terms * EPS32


def relative_gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (or 1 if smaller)."""
    if not expected.numel():
        return 0.0
    scale = max(1.0, float(expected.abs().max()))
    return float((got.float() - expected.float()).abs().max()) / scale
