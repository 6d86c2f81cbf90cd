"""What the quantized CPU kernel multiplies a weight matrix by: x rounded to int8 per row and block of 32 k
(scale max|x| / 127, round half to even) and back to float. Tests compare the kernel's product with this
times the dequantized matrix."""
from __future__ import annotations

import numpy as np


def int8_rounded(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x [M, K] float32 -> the same shape, each block of `block` k (K padded with zeros) rounded to int8 steps."""
    M, K = x.shape
    xp = np.pad(x, [(0, 0), (0, -K % block)]).reshape(M, -1, block)
    dx = np.abs(xp).max(-1, keepdims=True) / 127
    return (np.rint(xp / dx) * dx).reshape(M, -1)[:, :K]
