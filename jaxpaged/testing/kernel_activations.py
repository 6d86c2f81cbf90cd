"""What the quantized CPU kernel multiplies a weight matrix by: x rounded per row and block of 32 k to int8
(scale max|x| / 127) or, `act_bits` 16, to int16 codes (max|x| / 16319; with an outlier cut tau, only in the
row's outlier blocks, int8 in the others: cpu_quant.py), round half to even, and back to float. Tests compare
the kernel's product with this times the dequantized matrix."""
from __future__ import annotations

import numpy as np

from pallas_kernels.matmul.cpu_quant import ACT_BITS  # the largest code of each width


def int8_rounded(x: np.ndarray, block: int = 32, act_bits: int = 8, outlier: float = 0.0) -> np.ndarray:
    """x [M, K] float32 -> the same shape, each block of `block` k (K padded with zeros) rounded to the
    steps of `act_bits`-bit codes; with `outlier` tau > 0 (act_bits 16), int16 steps only in the blocks
    whose max|x| times the row's block count exceeds tau times its sum of block maxima, int8 elsewhere."""
    M, K = x.shape
    xp = np.pad(x, [(0, 0), (0, -K % block)]).reshape(M, -1, block)
    amax = np.abs(xp).max(-1).astype(np.float32)  # [M, blocks]
    top = np.full(amax.shape, np.float32(ACT_BITS[act_bits]))
    if outlier:
        total = np.zeros(M, np.float32)
        for b in range(amax.shape[1]):  # the kernel's float32 sum, in block order
            total = (total + amax[:, b]).astype(np.float32)
        wide = amax * np.float32(amax.shape[1]) > np.float32(outlier) * total[:, None]
        top = np.where(wide, top, np.float32(ACT_BITS[8]))
    inv = np.where(amax > 0, top / np.where(amax > 0, amax, 1), 0).astype(np.float32)[..., None]
    return (np.rint(xp * inv) * (amax / top)[..., None]).reshape(M, -1)[:, :K]  # the kernel's x * (top / max)
