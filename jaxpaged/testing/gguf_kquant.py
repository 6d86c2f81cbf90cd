"""GGUF Q4_K blocks written from the format (gguf-py dequantizes K-quants but does not quantize them).

A Q4_K block holds 256 values of a row, as 8 sub-blocks of 32, in 144 bytes:

    bytes 0-1    d     float16, the scale of the sub-block scales
    bytes 2-3    dmin  float16, the scale of the sub-block minimums
    bytes 4-15   sc, mn [8] each, 6 bits: sub-blocks 0-3 in the low six bits of bytes 4-7 (sc) and 8-11 (mn);
                 sub-blocks 4-7 in the nibbles of bytes 12-15 (sc low, mn high), their top two bits in the top
                 two bits of bytes 4-7 (sc) and 8-11 (mn)
    bytes 16-143 codes q, 4 bits: four runs of 32 bytes, run i the low nibbles of sub-block 2i and the high
                 nibbles of sub-block 2i + 1

and stands for value = (d * sc) * q - dmin * mn. The quantizer here is the plain min / max one: each
sub-block's range [min(x, 0), max(x)] in 15 steps, the steps and the minimums rounded to 6 bits of one
block-wide float16 scale each, the codes rounded with the rounded steps (llama.cpp searches scales that
lower the error further; the format is the same).
"""
from __future__ import annotations

import numpy as np

Q4_K_BLOCK, Q4_K_BYTES = 256, 144


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """float [..., K] (K a multiple of 256) -> Q4_K data uint8 [..., K / 256 * 144], rows as gguf stores them
    (what `gguf.quants.dequantize(data, Q4_K)` reads back). ValueError naming the shape for another K and
    naming NaN / inf values."""
    a = np.asarray(a, np.float32)
    if a.ndim < 1 or a.shape[-1] % Q4_K_BLOCK:
        raise ValueError(f"Q4_K: rows of shape {a.shape} are not whole blocks of {Q4_K_BLOCK} values")
    if not np.all(np.isfinite(a)):
        raise ValueError("Q4_K: the tensor holds NaN / inf values")
    x = a.reshape(-1, 8, 32)                                  # [blocks, sub-block, value]
    lo = np.minimum(x.min(axis=2), 0)                         # [blocks, 8], <= 0
    step = (x.max(axis=2) - lo) / 15                          # [blocks, 8], >= 0
    d = _f16_scale(step.max(axis=1) / 63)                     # [blocks]
    dmin = _f16_scale(-lo.min(axis=1) / 63)                   # [blocks]
    sc = _six_bits(step, d)                                   # [blocks, 8]
    mn = _six_bits(-lo, dmin)                                 # [blocks, 8]
    eff_step = d[:, None] * sc                                # the step the codes are read with
    eff_min = dmin[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((x + eff_min[..., None]) / eff_step[..., None])
    q = np.clip(np.where(eff_step[..., None] > 0, q, 0), 0, 15).astype(np.uint8)  # [blocks, 8, 32]
    out = np.empty((len(x), Q4_K_BYTES), np.uint8)
    out[:, 0:2] = d.astype(np.float16)[:, None].view(np.uint8)
    out[:, 2:4] = dmin.astype(np.float16)[:, None].view(np.uint8)
    out[:, 4:16] = _pack_scales(sc.astype(np.uint8), mn.astype(np.uint8))
    out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    return out.reshape(*a.shape[:-1], a.shape[-1] // Q4_K_BLOCK * Q4_K_BYTES)


def _f16_scale(v: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its float16 rounding (what the block stores and the reader uses)."""
    return v.astype(np.float16).astype(np.float32)


def _six_bits(v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """v [blocks, 8] in units of scale [blocks], rounded to 0..63 (0 where the scale is 0), as float32."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.rint(v / scale[:, None])
    return np.clip(np.where(scale[:, None] > 0, r, 0), 0, 63).astype(np.float32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """sc, mn uint8 [blocks, 8] (6 bits each) -> the 12 scale bytes [blocks, 12] (see the module docstring)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=1)
