"""GGUF quantized tensors -> the engine's quantized matrix format, exactly (no rounding anywhere).

The format (jaxpaged/models/quant.py): a matrix W [K, N] (K = in, N = out) is

    W[k, n] = s[k // G, n] * (u[k, n] - z) + m[k // G, n]

with unsigned codes u (`bits` 8: 0..255, or 4: 0..15), float32 group scales s and optional float32 group
minimums m [ceil(K / G), N], one integer zero code z per matrix (0 where m is given), and G the group.

A GGUF matrix is stored as the rows of its [out, in] layout, each row a run of blocks along `in`, so the
codes of one block become consecutive k of one column n. Per type (ggml's block layouts, bytes in order):

    type  block  bytes: layout                                    value               -> G, bits, z, m
    Q8_0   32    d f16, q int8 [32]                                d * q                  32, 8, 128 (u = q + 128)
    Q4_0   32    d f16, 16 bytes of nibbles                        d * (q - 8)            32, 4, 8
    Q4_1   32    d f16, min f16, nibbles                           d * q + min            32, 4, 0, min
    Q5_0   32    d f16, 32 high bits, nibbles                      d * (q - 16)           32, 8, 16
    Q5_1   32    d f16, min f16, 32 high bits, nibbles             d * q + min            32, 8, 0, min
    Q4_K  256    d, dmin f16, 12 bytes of 6-bit sc / mn per 32,    (d * sc) * q            32, 4, 0, -(dmin * mn)
                 128 bytes of nibbles                                 - dmin * mn
    Q5_K  256    as Q4_K, 32 bytes of high bits before the nibbles  as Q4_K                32, 8, 0, -(dmin * mn)
    Q6_K  256    128 bytes low nibbles, 64 bytes of 2-bit highs,   (d * sc) * (q - 32)    16, 8, 32
                 int8 sc [16], d f16

(In the nibble runs of the 32-blocks, the low nibbles are values 0..15 and the high nibbles 16..31.)
`d * sc` is exact in float32 (an 11-bit significand times an integer of at most 8 bits), and so is
`dmin * mn`; the per-value arithmetic is then the same as gguf.quants.dequantize's, so
s * (u - z) + m equals its float32 output bit for bit (tests/test_gguf_quant.py). The legacy types' s and m
are float16 values, so the quantized CPU kernel's packed layout keeps them in two bytes each; the K-quants'
`d * sc` generally is not one (17 significant bits): they keep the file's two-level form there, a float16 d
per 256 inputs and an int8 sub-scale per group (`cpu_quant.Layout.superblock`; jaxpaged/models/qpacked.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np

# GGUF type name -> (values per block, bytes per block, group G, code bits)
GGUF_QUANT_TYPES = {"Q8_0": (32, 34, 32, 8), "Q4_0": (32, 18, 32, 4), "Q4_1": (32, 20, 32, 4),
                    "Q5_0": (32, 22, 32, 8), "Q5_1": (32, 24, 32, 8), "Q4_K": (256, 144, 32, 4),
                    "Q5_K": (256, 176, 32, 8), "Q6_K": (256, 210, 16, 8)}


@dataclasses.dataclass(frozen=True)
class GGUFCodes:
    """One GGUF matrix in the engine's quantized format (host arrays): W [K, N] = s * (u - zero) + m."""
    u: np.ndarray             # uint8 [K, N], codes < 2 ** bits
    s: np.ndarray             # float32 [K / group, N]
    m: np.ndarray | None      # float32 [K / group, N], or None
    zero: int
    group: int
    bits: int

    def dequantize(self) -> np.ndarray:
        """The float32 matrix [K, N] the codes stand for (numpy; the tests' reference)."""
        idx = np.arange(self.u.shape[0]) // self.group
        w = self.s[idx] * (self.u.astype(np.float32) - np.float32(self.zero))
        return w if self.m is None else w + self.m[idx]


    def columns(self, idx) -> "GGUFCodes":
        """The codes of columns `idx` (an index array or a slice) of W."""
        def take(a):
            return np.ascontiguousarray(a[:, idx])
        return GGUFCodes(take(self.u), take(self.s), None if self.m is None else take(self.m), self.zero,
                         self.group, self.bits)


def is_packable(type_name: str) -> bool:
    """Whether tensors of this GGUF type (its name, e.g. "Q4_K") map onto the quantized format."""
    return type_name in GGUF_QUANT_TYPES


def gguf_codes(data: np.ndarray, type_name: str, k: int) -> GGUFCodes:
    """A GGUF matrix of type `type_name`, its raw blocks `data` (uint8 [N, K / block * bytes], rows of the
    [out, in] layout, as gguf.GGUFReader gives them), with K = `k` inputs -> its codes W [K, N].

    Raises ValueError naming the type for a type without a mapping, and the shape for a K that is not a
    whole number of blocks or data that is not N rows of them."""
    if type_name not in GGUF_QUANT_TYPES:
        raise ValueError(f"GGUF type {type_name} has no quantized mapping; mapped: {', '.join(GGUF_QUANT_TYPES)}")
    block, nbytes, group, bits = GGUF_QUANT_TYPES[type_name]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if k % block or data.ndim != 2 or data.shape[1] != k // block * nbytes:
        raise ValueError(f"GGUF {type_name} data of shape {data.shape} is not rows of {k} inputs "
                         f"(blocks of {block} values, {nbytes} bytes each)")
    n = data.shape[0]
    q, s, m, zero = _BLOCKS[type_name](data.reshape(-1, nbytes))  # q [n * k / block, block]

    def cols(a):  # [N * K / width, width] row-major over (n, k) -> [K / ..., N]
        return np.ascontiguousarray(a.reshape(n, -1).T)
    return GGUFCodes(cols(q), cols(s), None if m is None else cols(m), zero, group, bits)


def _f16(b: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 (little-endian float16) -> float32 [nb, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] bytes -> codes [nb, 32]: the low nibbles are values 0..15, the high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits(b: np.ndarray) -> np.ndarray:
    """[nb, c] bytes -> [nb, 8 c] bits, bit i of the little-endian run."""
    return np.unpackbits(b, axis=1, bitorder="little")


def _q8_0(b):
    return (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(b[:, :2]), None, 128


def _q4_0(b):
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None, 8


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 0


def _q5_0(b):
    return _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4), _f16(b[:, :2]), None, 16


def _q5_1(b):
    return _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4]), 0


def _k_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> (sc, mn) [nb, 8], 6 bits each: sub-blocks 0-3 in the low six bits of
    bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11 (scale low, min high)
    with their top two bits in the top two bits of bytes 0-3 / 4-7."""
    a, b, c = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: four runs of 32 bytes, each the low nibbles of one sub-block of 32 then the
    high nibbles of the next."""
    r = qs.reshape(-1, 4, 32)
    return np.stack([r & 15, r >> 4], axis=2).reshape(-1, 256)


def _q4_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]), d * sc, -(dmin * mn), 0


def _q5_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    # bit i of high byte j is the fifth bit of value j of sub-block i
    high = _bits(b[:, 16:48].reshape(-1, 1)).reshape(-1, 32, 8).transpose(0, 2, 1).reshape(-1, 256)
    return _k_nibbles(b[:, 48:176]) | (high << 4), d * sc, -(dmin * mn), 0


def _q6_k(b):
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
    # value 128 h + j (h < 2, j < 128): low four bits from ql[64 h + j % 64] (its high nibble when j >= 64),
    # high two bits from qh[32 h + j % 32] >> (2 (j // 32))
    r = ql.reshape(-1, 2, 64)
    lo = np.stack([r & 15, r >> 4], axis=2).reshape(-1, 2, 128)
    h = qh.reshape(-1, 2, 32)
    hi = np.stack([(h >> (2 * i)) & 3 for i in range(4)], axis=2).reshape(-1, 2, 128)
    return (lo | (hi << 4)).reshape(-1, 256), d * sc.astype(np.float32), None, 32


_BLOCKS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
