"""What the quantized CPU kernel multiplies a weight matrix by: x rounded per row and block of 32 k to int8
(scale max|x| / 127) or, `act_bits` 16, to int16 codes (max|x| / 16319), round half to even, and back to
float. Tests compare the kernel's product with this times the dequantized matrix."""
from __future__ import annotations

import numpy as np

from pallas_kernels.matmul.cpu_quant import ACT_BITS  # the largest code of each width


def int8_rounded(x: np.ndarray, block: int = 32, act_bits: int = 8) -> np.ndarray:
    """x [M, K] float32 -> the same shape, each block of `block` k (K padded with zeros) rounded to the
    steps of `act_bits`-bit codes."""
    M, K = x.shape
    xp = np.pad(x, [(0, 0), (0, -K % block)]).reshape(M, -1, block)
    dx = np.abs(xp).max(-1, keepdims=True) / ACT_BITS[act_bits]
    return (np.rint(xp / dx) * dx).reshape(M, -1)[:, :K]
