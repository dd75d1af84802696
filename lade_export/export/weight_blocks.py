"""Block-quantized weights as arrays (numpy only): the two storage layouts the quantized
step graphs read (:mod:`lade_export.export.quantize` writes them into the graph).

* :func:`block_quant` — ONNX Runtime's ``MatMulNBits`` layout (com.microsoft contrib op;
  ONNX Runtime ContribOperators.md): 4 or 8 bits per weight, one float32 scale per block
  of ``block_size`` weights along the input dimension.
* :func:`pack_block_lanes` / :func:`dequantize_block_lanes` — this project's kernels'
  layout (``MatMulBlockQ`` / ``GatherBlockQ``, :mod:`lade_export.kernels`): blocks of 32
  stored as GGML's Q4_1 (``w = D·code + M``, float16 D and M) or Q8_0, 16 output columns
  in the 32-bit lanes of a 512-bit vector.

**Grids.** Transformer layers use ``minmax`` blocks: asymmetric, ``w = scale · (q − z)``
with ``scale = (max − min) / (2^bits − 1)`` and a real-valued zero point ``z = −min/scale``.
When the checkpoint came from a block-quantized file with the same block size — the
SmolLM2 GGUF stores its layers as Q4_1 (``d·q + m`` per block of 32) — every block lies on
this grid and is recovered exactly: the quantized engine computes with the model's own
weights. ``MatMulNBits`` has fast kernels only for integer zero points, so ``z`` is split
into the integer ``round(z)`` the kernel takes and a per-block residual
``scale · (round(z) − z)``, which the graph adds back as ``Σ_block(x) @ R`` — a MatMul with
K/block rows beside the big one (about 1 bit per weight). ONNX Runtime's own quantizer
(``onnxruntime.quantization.matmul_nbits_quantizer``) writes the same ops but stores
integer zero points and a symmetric scale of ``max|w| / 2^(bits−1)``, which cannot hold
such grids; keeping the min-max grid but rounding its zero point to an integer (no
residual term) is no better; the quantizer's HQQ mode optimizes float zero points
iteratively (slowly, and not exactly). Hence this small packer. The agreement and timing
figures behind these choices are in bench/results/design-figures.md (*Quantized step
graphs*).

The LM head and the tied embedding, when quantized, use symmetric ``absmax`` blocks
(``scale = max|w| / (2^(bits−1) − 1)``, exact for a Q8_0 source such as SmolLM2's
``token_embd``).
"""

from __future__ import annotations

import numpy as np

#: Weights per block of the lade kernels, and output columns per 512-bit vector.
LANE_BLOCK, LANES = 32, 16


def block_quant(weight: np.ndarray, bits: int, block_size: int, scheme: str) -> dict:
    """Block quantization of a MatMul weight in ``MatMulNBits`` layout.

    Args:
        weight: float [K, N], a MatMul's B (K = input features, a multiple of ``block_size``).
        bits: 4 or 8.
        block_size: weights per block along K.
        scheme: ``"minmax"`` (asymmetric, with zero points) or ``"absmax"`` (symmetric,
            implied zero point 2^(bits−1)).

    Returns:
        ``{"packed": uint8 [N, K/block, block·bits/8] (4-bit values two per byte, low nibble
        first), "scales": float32 [N, K/block], "zero_points": uint8 [N, K/block] (8-bit)
        or [N, ⌈K/block/2⌉] (4-bit, two per byte), None for absmax, "residual": float32
        [K/block, N] or None}``; the weight of block ``b``, column ``n`` is
        ``scale · (q − zero_point) + residual[b, n]``.
    """
    k, n = weight.shape
    blocks = weight.T.reshape(n, k // block_size, block_size).astype(np.float64)
    if scheme == "absmax":
        half = 1 << (bits - 1)
        scale = np.abs(blocks).max(-1) / (half - 1)
        scale[scale == 0] = 1.0
        q = (np.clip(np.round(blocks / scale[..., None]), 1 - half, half - 1) + half).astype(np.uint8)
        zeros = residual = None
    else:
        levels = (1 << bits) - 1
        low, high = blocks.min(-1), blocks.max(-1)
        scale = (high - low) / levels
        scale[scale == 0] = 1.0  # a constant block: any scale, q = 0
        z = -low / scale  # real zero point: w = scale·(q − z)
        q = np.clip(np.round(blocks / scale[..., None] + z[..., None]), 0, levels).astype(np.uint8)
        zp = np.clip(np.round(z), 0, levels)
        residual = (scale * (zp - z)).T.astype(np.float32)  # [K/block, N]
        zp = zp.astype(np.uint8)
        if bits == 4:  # two per byte, low nibble first, rows padded to whole bytes
            if zp.shape[1] % 2:
                zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1)
            zp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
        zeros = zp
        if not np.any(residual):
            residual = None
    packed = q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return {"packed": packed, "scales": scale.astype(np.float32), "zero_points": zeros, "residual": residual}



def pack_block_lanes(weight: np.ndarray, bits: int, scheme: str) -> dict:
    """Pack a MatMul weight for the lade kernels' ``MatMulBlockQ`` / ``GatherBlockQ``
    (:mod:`lade_export.kernels`): blocks of 32 along K, ``w = D·code + M``.

    Args:
        weight: float [K, N], a MatMul's B; K a multiple of 32.
        bits: 4 or 8.
        scheme: ``"minmax"`` (``D = (max − min)/(2^bits − 1)``, ``M = min``: GGML's Q4_1 for
            4 bits, so a Q4_1 checkpoint's blocks come back as they were) or ``"absmax"``
            (8 bits: ``code = round(w/D) + 128``, ``D = max|w|/127``, ``M = −128·D``, GGML's
            Q8_0 shifted to unsigned codes).

    Returns:
        ``{"q": uint8 [T, K/32, 64·bits], "d": float16 [T, K/32, 16], "m": float16 [T, K/32, 16],
        "n": N}`` with T = ⌈N/16⌉ tiles of 16 columns (the last one padded with zero columns).
        In tile t, block b, the 64·bits bytes are ``bits`` vectors of 16 little-endian uint32
        lanes; lane i of vector g holds the code of column 16t + i, block element
        j = (32/bits)·g + e, in bits [bits·e, bits·e + bits).

    Raises:
        ValueError: a block's scale or minimum does not fit float16 (weights beyond ~6e4).
    """
    k, n = weight.shape
    blocks = weight.T.reshape(n, k // LANE_BLOCK, LANE_BLOCK).astype(np.float32)
    top = (1 << bits) - 1
    if scheme == "absmax":
        d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
        scale = d.astype(np.float32)
        scale[scale == 0] = 1.0
        codes = np.clip(np.round(blocks / scale[..., None]), -127, 127) + 128
        m = (-128 * d.astype(np.float32)).astype(np.float16)
    else:
        low = blocks.min(-1)
        d = ((blocks.max(-1) - low) / top).astype(np.float16)
        m = low.astype(np.float16)
        scale = d.astype(np.float32)
        scale[scale == 0] = 1.0  # a constant block: code 0, w = M
        codes = np.clip(np.round((blocks - m.astype(np.float32)[..., None]) / scale[..., None]), 0, top)
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(m))):
        raise ValueError(f"a [{k}, {n}] weight has blocks beyond float16's range (|w| up to "
                         f"{float(np.abs(blocks).max()):.3g}); the lade kernels store scales in float16")
    codes = codes.astype(np.uint32)
    tiles = -(-n // LANES)
    pad = tiles * LANES - n
    if pad:
        codes = np.concatenate([codes, np.zeros((pad,) + codes.shape[1:], np.uint32)])
        d = np.concatenate([d, np.zeros((pad, d.shape[1]), np.float16)])
        m = np.concatenate([m, np.zeros((pad, m.shape[1]), np.float16)])
    per = LANE_BLOCK // bits
    lanes = codes.reshape(tiles, LANES, k // LANE_BLOCK, bits, per).transpose(0, 2, 3, 1, 4)  # T, B, G, lane, e
    words = np.zeros(lanes.shape[:-1], np.uint32)
    for e in range(per):
        words |= lanes[..., e] << np.uint32(bits * e)
    words = np.ascontiguousarray(words).astype("<u4")

    def by_tile(a):
        return np.ascontiguousarray(a.reshape(tiles, LANES, -1).transpose(0, 2, 1))

    return {"q": words.view(np.uint8).reshape(tiles, k // LANE_BLOCK, bits * 64), "d": by_tile(d), "m": by_tile(m),
            "n": n}


def dequantize_block_lanes(packed: dict) -> np.ndarray:
    """The float32 weight [K, N] that :func:`pack_block_lanes`'s output stands for (what the
    kernels multiply by, up to float32 rounding of ``D·code + M``)."""
    q, d, m, n = packed["q"], packed["d"], packed["m"], packed["n"]
    tiles, blocks, width = q.shape
    bits = width // 64
    per = LANE_BLOCK // bits
    words = q.reshape(tiles, blocks, bits, LANES * 4).view("<u4")  # T, B, G, lane
    codes = np.stack([(words >> np.uint32(bits * e)) & np.uint32((1 << bits) - 1) for e in range(per)], -1)
    codes = codes.transpose(0, 3, 1, 2, 4).reshape(tiles * LANES, blocks, LANE_BLOCK).astype(np.float32)
    d = d.transpose(0, 2, 1).reshape(tiles * LANES, blocks, 1).astype(np.float32)
    m = m.transpose(0, 2, 1).reshape(tiles * LANES, blocks, 1).astype(np.float32)
    return (codes * d + m).reshape(tiles * LANES, blocks * LANE_BLOCK)[:n].T

