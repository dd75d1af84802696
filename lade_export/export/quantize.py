"""Weight-only quantized step graphs for ONNX Runtime (``build --precision int4|int8``).

Every MatMul of the transformer layers (attention and MLP projections; query/key/value
and gate/up arrive fused, one MatMul each, from :mod:`lade_export.export.fusion`) becomes ONNX
Runtime's ``MatMulNBits`` (com.microsoft contrib op; ONNX Runtime ContribOperators.md):
4 or 8 bits per weight, one float32 scale per block of ``block_size`` weights along the
input dimension, ``accuracy_level`` choosing the kernel's compute type.

**Exactness decides the compute type.** Lookahead is exact only if the engine computes a
token the same way in a one-token step (greedy) and inside a many-token step (lookahead).
With ``accuracy_level`` 4 (int8 activations) ONNX Runtime 1.32's CPU kernels quantize the
activations of a one-row step differently from those of a two-or-more-row step (row 0 of
SmolLM2's int4 graph: 0.66 apart in the logits, where float32 compute differs by 4e-5),
and float32-level differences between the two histories are then amplified by the
rounding to int8: 14 of 16 MT-Bench answers diverged from greedy within 128 tokens, also
with greedy steps padded to two rows. With ``accuracy_level`` 1 (float32 compute) the
int4 graph behaves like the float32 one. So:

* ``int4`` computes in float32 (level 1): exact lookahead, and on SmolLM2 about half the
  float32 graph's time for a one-token step (the weights are read at 4 bits).
* ``int8``: ONNX Runtime's CPU 8-bit kernels have no fast float32-compute path (level 1
  is ~30× slower than float32 here), so int8 uses level 4 and its artifacts say
  ``lookahead_exact: false``: the runtime decodes them greedily (or by sampling) one token
  per step and refuses lookahead rather than break the promise.
* ``int4`` with ``accuracy_level`` 4 and ``head_bits`` 8 (``build --precision int4
  --accuracy-level 4 --head-bits 8 --profile greedy-only``): the arithmetic of llama.cpp's
  Q4_1 × Q8_1 kernels (4-bit weights, activations rounded to 8 bits per block) with the
  head and embedding at 8 bits, exact for SmolLM2's Q8_0 ``token_embd``. Greedy only, like
  int8; on SmolLM2 a one-token step takes ~10.8 ms against ~15.5 ms for exact int4
  (bench/results/README.md), most of it the 8-bit head in place of the float32 one.

**Weights.** Transformer layers use ``minmax`` blocks: asymmetric, ``w = scale · (q − z)``
with ``scale = (max − min) / (2^bits − 1)`` and a real-valued zero point ``z = −min/scale``.
When the checkpoint came from a block-quantized file with the same block size — the
SmolLM2 GGUF stores its layers as Q4_1 (``d·q + m`` per block of 32) — every block lies on
this grid and is recovered exactly: the int4 engine computes with the model's own weights
(top-1 agreement 100%, max |Δlogit| 9e-5 against the float32 graph, teacher-forced on chat
answers). ``MatMulNBits`` has fast kernels only for integer zero points, so ``z`` is split
into the integer ``round(z)`` the kernel takes and a per-block residual
``scale · (round(z) − z)``, added back as ``Σ_block(x) @ R`` — a MatMul with K/block rows
beside the big one (about 1 bit per weight and 3% of the compute). ONNX Runtime's own
quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``) writes the same ops but
stores integer zero points and a symmetric scale of ``max|w| / 2^(bits−1)``, which cannot
hold such grids (top-1 agreement 73–76% at 4 bits); keeping the min-max grid but rounding
its zero point to an integer (no residual term, ~1.3 ms less per int8-activation step) is
no better (69% on 16 MT-Bench answers; greedy output leaves the float32 engine's after
~2 tokens on average, against ~18 with the residual); the quantizer's HQQ mode optimizes
float zero points iteratively (60 s for SmolLM2, not exact). Hence this small packer.

**LM head and embedding** stay float32 by default (``head_bits`` 0; the tied embedding
stays one tensor behind a Transpose). ``head_bits`` 8 or 4 quantizes them with symmetric
``absmax`` blocks (``scale = max|w| / (2^(bits−1) − 1)``, exact for a Q8_0 source such
as SmolLM2's ``token_embd``) into a ``MatMulNBits`` head and a ``GatherBlockQuantized``
embedding reading the head's packed weight through a ``Reshape`` (one tensor on disk;
ONNX Runtime may keep two copies in memory) — but an 8-bit head needs int8 activations
(see above) and a 4-bit one loses quality (top-1 agreement 79% on SmolLM2), so neither is
the default.

**This project's kernels** (``build --kernels lade``; :mod:`lade_export.kernels`) replace
``MatMulNBits`` by ``MatMulBlockQ``, a custom operator compiled into the artifact: the same
blocks of 32 stored as GGML's Q4_1 (``w = D·code + M``, float16 D and M: a Q4_1 checkpoint's
blocks as they are) and, for the head and the tied embedding (8 bits by default there),
Q8_0's. Each output row is computed from its own input row alone, and no residual term is
needed. The arithmetic is ``compute``: ``int8`` (the default) rounds each row's activations per
block of 32 (GGML's Q8_0 activation blocks) and sums in integers, the scales applied in float32
in one fixed order, bit-identical on every CPU path; ``float32`` (``build --compute float32``)
keeps float32 FMAs, whose tokens stay closer to the float32 engine's (on SmolLM2 its weights are
exactly the GGUF's, top-1 agreement 100%; int8 activations: 96%). Row-exact weight kernels are
not enough for int8 activations: ONNX Runtime's attention is not bit for bit the same in a
one-token and a many-token step (its sums over past + step columns are grouped by length, and
the cache part and the step part are added; 3.6e-7 apart on stories260K, 5e-5 in SmolLM2's
logits), which float32 weights pass on smoothly but int8 rounding amplifies (5 of 15 lookahead
outputs left greedy's on stories260K). So an int8 build takes the ``onnx-ops`` attention and
:func:`exact_attention` replaces each by the kernels' ``AttentionRows``, which computes a query
row over the keys it sees in position order in one pass: then every row of a step is the same
bits as alone, and lookahead is exact again. On SmolLM2 the artifact is 96 MB instead of 192
and a one-token step reads about the bytes llama.cpp's Q4_1 step reads (bench/results/ has the
measured speed).

Attention itself (softmax, the KV cache) stays float32; the I/O contract of the step graph
(:mod:`lade_export.specs`) does not change. Quality against the float32 graph is measured
by :func:`quality_report` and recorded in the manifest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import ProfileError
from ..kernels import COMPUTE, KERNELS
from .sanitize import drop_unused_initializers

#: ``--precision`` values for ONNX Runtime, and the bits each means.
ORT_PRECISIONS = {"fp32": None, "int8": 8, "int4": 4}
#: Weights per block of the lade kernels, and output columns per 512-bit vector.
LANE_BLOCK, LANES = 32, 16


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How weights are quantized.

    Attributes:
        bits: 4 or 8, the transformer layers' weights.
        block_size: weights per scale along the input dimension (a power of two ≥ 16).
        accuracy_level: ``MatMulNBits`` compute type: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
            (activations); only 0 and 1 keep lookahead exact (module docstring).
        head_bits: 4 or 8, the LM head's and the token embedding's weights (0: left float32).
        kernels: ``onnxruntime`` (``MatMulNBits``) or ``lade`` (``MatMulBlockQ``).
        compute: the lade kernels' arithmetic: ``float32`` (float32 FMAs on the dequantized
            weights) or ``int8`` (activations rounded per row and block of 32, integer sums;
            :mod:`lade_export.kernels`). Only ``float32`` with ONNX Runtime's kernels, whose
            compute type is ``accuracy_level``.

    Raises:
        ProfileError: on construction, a value out of range (one line, for the CLI).
    """

    bits: int
    block_size: int = 32
    accuracy_level: int = 1
    head_bits: int = 0
    kernels: str = "onnxruntime"
    compute: str = "float32"

    def __post_init__(self):
        if self.bits not in (4, 8) or self.head_bits not in (0, 4, 8):
            raise ProfileError(f"quantization bits must be 4 or 8, got {self.bits} (head {self.head_bits})")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ProfileError(f"--block-size must be a power of two ≥ 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ProfileError(f"--accuracy-level must be 0..4, got {self.accuracy_level}")
        if self.kernels not in KERNELS:
            raise ProfileError(f"--kernels must be {' or '.join(KERNELS)}, got {self.kernels!r}")
        if self.compute not in COMPUTE:
            raise ProfileError(f"--compute must be {' or '.join(COMPUTE)}, got {self.compute!r}")
        if self.compute != "float32" and self.kernels != "lade":
            raise ProfileError(f"--compute picks the arithmetic of --kernels lade; ONNX Runtime's MatMulNBits takes "
                               f"--accuracy-level instead: drop --compute {self.compute} or add --kernels lade")
        if self.kernels == "lade" and self.block_size != LANE_BLOCK:
            raise ProfileError(f"--kernels lade uses blocks of {LANE_BLOCK} weights (GGML's Q4_1/Q8_0); "
                               f"drop --block-size {self.block_size}")

    @property
    def lookahead_exact(self) -> bool:
        """Whether lookahead decodes the engine's greedy tokens: float32 compute (accuracy
        level 0 or 1) with ONNX Runtime's kernels, and this project's kernels with either
        compute type (int8: with :func:`exact_attention`, which the build applies). Not ONNX
        Runtime's level 4, which rounds activations differently per row count (module
        docstring)."""
        return self.kernels == "lade" or self.accuracy_level in (0, 1)

    @classmethod
    def for_precision(cls, precision: str, block_size: int | None = None, accuracy_level: int | None = None,
                      head_bits: int | None = None, kernels: str = "onnxruntime",
                      compute: str | None = None) -> "QuantSpec":
        """The spec of ``--precision int4|int8``. With ONNX Runtime's kernels int4 computes
        in float32 (accuracy level 1, exact lookahead) and int8 with int8 activations (level
        4); the head stays float32 unless ``head_bits``. With ``kernels="lade"`` both take
        ``compute`` (default ``int8``: the integer path, the same bits on every CPU; ``float32``:
        float32 FMAs), exact lookahead either way, and the head defaults to 8 bits.

        Raises:
            ProfileError: ``--accuracy-level`` with ``kernels="lade"`` (whose compute type is
                ``--compute``), ``--compute`` without it, or a value out of range.
        """
        bits = ORT_PRECISIONS[precision]
        if kernels == "lade":
            if accuracy_level is not None:
                raise ProfileError(f"--accuracy-level picks the compute type of ONNX Runtime's MatMulNBits; --kernels "
                                   f"lade takes --compute int8|float32 instead: drop --accuracy-level {accuracy_level}")
            return cls(bits, block_size or LANE_BLOCK, 0, 8 if head_bits is None else head_bits, kernels,
                       compute or "int8")
        level = accuracy_level if accuracy_level is not None else (1 if bits == 4 else 4)
        return cls(bits, block_size or 32, level, head_bits or 0, kernels, compute or "float32")

    def as_dict(self) -> dict:
        if self.kernels == "lade":
            head = {0: "float32", 4: "minmax, as the layers (4 bits)",
                    8: "absmax: code = round(w/D) + 128, D = max|w|/127, M = -128·D (GGML Q8_0)"}[self.head_bits]
            return {"bits": self.bits, "head_bits": self.head_bits, "block_size": self.block_size,
                    "lookahead_exact": self.lookahead_exact, "kernels": "lade", "compute": self.compute,
                    **({"activations": "int8 per row and block of 32: d = max|x|/127, q = round(x/d) (GGML Q8_0 "
                                       "activation blocks); int32 sums; y += D·(d·Σ code·q) + M·(d·Σq) in float32"}
                       if self.compute == "int8" else {}),
                    "layers": f"minmax: w = D·code + M per block of 32, {self.bits}-bit codes, float16 D and M"
                              + (" (GGML Q4_1)" if self.bits == 4 else ""),
                    "head_and_embedding": head}
        return {"bits": self.bits, "head_bits": self.head_bits, "block_size": self.block_size,
                "lookahead_exact": self.lookahead_exact, "kernels": "onnxruntime",
                "accuracy_level": self.accuracy_level,
                "layers": "minmax: asymmetric round-to-nearest per block; real zero point = uint zero point + "
                          "per-block residual term",
                "head_and_embedding": "absmax: symmetric round-to-nearest per block, scale max|w|/(2^(bits-1)-1)"
                                      if self.head_bits else "float32"}


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


def _matmul_nbits(graph, node, weight: np.ndarray, bits: int, spec: QuantSpec, scheme: str) -> list:
    """Nodes replacing MatMul ``node`` (initializers are added to ``graph``): a
    ``MatMulNBits``, plus the zero-point residual term ``ReduceSum_block(x) @ R`` when the
    blocks' zero points are not integers (see the module docstring)."""
    from onnx import helper, numpy_helper

    q = block_quant(weight, bits, spec.block_size, scheme)
    base = node.input[1]
    k, n = weight.shape
    graph.initializer.extend([numpy_helper.from_array(q["packed"], f"{base}_Q{bits}"),
                              numpy_helper.from_array(q["scales"], f"{base}_scales")])
    inputs = [node.input[0], f"{base}_Q{bits}", f"{base}_scales"]
    if q["zero_points"] is not None:
        graph.initializer.append(numpy_helper.from_array(q["zero_points"], f"{base}_zero_points"))
        inputs.append(f"{base}_zero_points")
    out = node.output[0]
    main = out if q["residual"] is None else f"{base}_nbits_out"
    nodes = [helper.make_node("MatMulNBits", inputs, [main], name=f"{node.name}_Q{bits}", domain="com.microsoft", K=k,
                              N=n, bits=bits, block_size=spec.block_size, accuracy_level=spec.accuracy_level)]
    if q["residual"] is not None:  # x [.., K] -> [.., K/block, block] -> sums [.., K/block] @ R [K/block, N]
        graph.initializer.extend([
            numpy_helper.from_array(np.array([0, 0, k // spec.block_size, spec.block_size], np.int64), f"{base}_blocks"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{base}_last_axis"),
            numpy_helper.from_array(q["residual"], f"{base}_zero_residual")])
        nodes += [helper.make_node("Reshape", [node.input[0], f"{base}_blocks"], [f"{base}_x_blocks"],
                                   name=f"{node.name}_x_blocks"),
                  helper.make_node("ReduceSum", [f"{base}_x_blocks", f"{base}_last_axis"], [f"{base}_x_block_sums"],
                                   name=f"{node.name}_x_block_sums", keepdims=0),
                  helper.make_node("MatMul", [f"{base}_x_block_sums", f"{base}_zero_residual"], [f"{base}_residual_out"],
                                   name=f"{node.name}_zero_residual"),
                  helper.make_node("Add", [main, f"{base}_residual_out"], [out], name=f"{node.name}_plus_residual")]
    return nodes


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


def _matmul_block_q(graph, node, weight: np.ndarray, bits: int, scheme: str, compute: str = "float32") -> list:
    """``MatMulBlockQ`` replacing MatMul ``node`` (its packed weight added to ``graph``);
    ``compute="int8"`` sets its attribute ``compute=1`` (float32 leaves it out, as graphs
    made before the integer path have it)."""
    from onnx import helper, numpy_helper

    from ..kernels import DOMAIN

    packed = pack_block_lanes(weight, bits, scheme)
    base = node.input[1]
    names = [f"{base}_lanes_q{bits}", f"{base}_lanes_d", f"{base}_lanes_m"]
    graph.initializer.extend(numpy_helper.from_array(packed[key], name) for key, name in zip("qdm", names))
    extra = {"compute": 1} if compute == "int8" else {}
    return [helper.make_node("MatMulBlockQ", [node.input[0], *names], list(node.output), name=f"{node.name}_Q{bits}",
                             domain=DOMAIN, N=packed["n"], **extra)]


def _lade_scheme(bits: int, scheme: str) -> str:
    """The lade kernels' symmetric blocks are 8-bit only (Q8_0); a 4-bit head takes min-max blocks."""
    return scheme if bits == 8 else "minmax"


def _quantized_matmul(graph, node, weight: np.ndarray, bits: int, spec: QuantSpec, scheme: str) -> list:
    """Nodes replacing MatMul ``node`` with the spec's kernels (``MatMulNBits`` or ``MatMulBlockQ``)."""
    if spec.kernels == "lade":
        return _matmul_block_q(graph, node, weight, bits, _lade_scheme(bits, scheme), spec.compute)
    return _matmul_nbits(graph, node, weight, bits, spec, scheme)


def _block_q_embedding(graph, embed: np.ndarray, head, gather, spec: QuantSpec) -> tuple[list, str]:
    """Nodes replacing the embedding ``gather`` with the lade kernels: a ``GatherBlockQ`` on
    the head's own packed tensors when ``head`` (its ``MatMulBlockQ``) is tied, else on a
    table of its own (added to ``graph``). Returns ``(nodes, description)``."""
    from onnx import helper, numpy_helper

    from ..kernels import DOMAIN

    if head is not None:
        tables, embedding = list(head.input[1:4]), "shared with the LM head"
    else:
        packed = pack_block_lanes(np.ascontiguousarray(embed.T), spec.head_bits, _lade_scheme(spec.head_bits, "absmax"))
        tables, embedding = ["embedding_lanes_q", "embedding_lanes_d", "embedding_lanes_m"], "own table"
        graph.initializer.extend(numpy_helper.from_array(packed[key], name) for key, name in zip("qdm", tables))
    return [helper.make_node("GatherBlockQ", [*tables, gather.input[1]], list(gather.output),
                             name="embedding_gather_block_q", domain=DOMAIN, N=embed.shape[0])], embedding


def _nbits_embedding(graph, embed: np.ndarray, head, gather, spec: QuantSpec) -> tuple[list, str]:
    """Nodes replacing the embedding ``gather`` with ONNX Runtime's ``GatherBlockQuantized``:
    on the head's packed weight (through a Reshape) when ``head`` (its ``MatMulNBits``) is
    tied, else on a table of its own (added to ``graph``). Returns ``(nodes, description)``."""
    import onnx
    from onnx import helper, numpy_helper

    vocab, hidden = embed.shape
    kbytes = hidden * spec.head_bits // 8
    nodes = []
    if head is not None:
        shape = helper.make_tensor("embedding_q_shape", onnx.TensorProto.INT64, [2], [vocab, kbytes])
        graph.initializer.append(shape)
        nodes.append(helper.make_node("Reshape", [head.input[1], shape.name], ["embedding_q"],
                                      name="embedding_shares_lm_head"))
        data, scales, embedding = "embedding_q", head.input[2], "shared with the LM head"
    else:
        q = block_quant(np.ascontiguousarray(embed.T), spec.head_bits, spec.block_size, "absmax")
        graph.initializer.extend([numpy_helper.from_array(q["packed"].reshape(vocab, kbytes), "embedding_q"),
                                  numpy_helper.from_array(q["scales"].reshape(vocab, hidden // spec.block_size),
                                                          "embedding_scales")])
        data, scales, embedding = "embedding_q", "embedding_scales", "own table"
    nodes.append(helper.make_node("GatherBlockQuantized", [data, gather.input[1], scales], list(gather.output),
                                  name="embedding_gather_quantized", domain="com.microsoft", gather_axis=0,
                                  quantize_axis=1, block_size=spec.block_size, bits=spec.head_bits))
    return nodes, embedding


def _producer_skipping_casts(producers: dict, name: str):
    node = producers.get(name)
    while node is not None and node.op_type == "Cast":
        node = producers.get(node.input[0])
    return node


def _transposed_input(producers, name, graph, perm):
    """The graph input that ``name`` is a ``Transpose(perm)`` of, or None."""
    node = producers.get(name)
    if node is None or node.op_type != "Transpose" or node.input[0] not in {i.name for i in graph.input}:
        return None
    got = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return node.input[0] if got == perm else None


def exact_attention(graph) -> int:
    """Replace every attention of an ``onnx-ops`` step graph (:mod:`lade_export.graph`: scores
    against the cache and against this step, concatenated, scaled, masked by ``Where``, softmax,
    then the two value products added) by one ``AttentionRows`` of the lade kernels, which computes
    each query row over the keys it sees in position order, in one pass over cache and step, so
    that a row's bits do not depend on the step's width (what int8 activations need for exact
    lookahead; :mod:`lade_export.kernels`). The cache's keys and values are fed to it as the
    graph's sequence-major inputs, read in place (``past_layout=1``; the graph's Transposes of
    the past, a copy of the whole cache per layer, go), so a row costs the key blocks it sees.
    Nodes left without consumers are dropped.

    Returns:
        the number of attentions replaced.

    Raises:
        ValueError: a ``Softmax`` of the graph is not inside that pattern.
    """
    from onnx import helper, numpy_helper

    from ..kernels import DOMAIN

    producers = {o: n for n in graph.node for o in n.output}
    consumers = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = {i.name: i for i in graph.initializer}
    replaced, drop, insert = 0, set(), {}

    def only(name, op):
        found = [n for n in consumers.get(name, []) if n.op_type != "Cast"] or \
            [m for n in consumers.get(name, []) if n.op_type == "Cast" for m in consumers.get(n.output[0], [])]
        if len(found) != 1 or found[0].op_type != op:
            raise ValueError(f"attention pattern: {name} does not feed one {op}")
        return found[0]

    for softmax in [n for n in graph.node if n.op_type == "Softmax"]:
        where = _producer_skipping_casts(producers, softmax.input[0])
        if where is None or where.op_type != "Where":
            raise ValueError(f"attention pattern: {softmax.name} does not follow a Where")
        reshape = producers[where.input[2]]
        scale_mul = producers[reshape.input[0]]
        scale = next(numpy_helper.to_array(inits[i]) for i in scale_mul.input if i in inits)
        concat = next(producers[i] for i in scale_mul.input if i not in inits)
        past_scores, step_scores = (producers[i] for i in concat.input)
        fill = float(numpy_helper.to_array(inits[where.input[1]]))
        if (reshape.op_type, scale_mul.op_type, concat.op_type, past_scores.op_type, step_scores.op_type) != \
                ("Reshape", "Mul", "Concat", "MatMul", "MatMul") or fill > -1e30 or scale.size != 1:
            raise ValueError(f"attention pattern: {softmax.name}'s scores are not the onnx-ops form")
        view = only(softmax.output[0], "Reshape")
        slices = [n for n in consumers[view.output[0]] if n.op_type == "Slice"]
        products = [only(sl.output[0], "MatMul") for sl in slices]
        add = only(products[0].output[0], "Add")
        starts = [int(numpy_helper.to_array(inits[sl.input[1]]).ravel()[0]) if sl.input[1] in inits else None
                  for sl in slices]
        past_values, step_values = (products if starts[0] == 0 else products[::-1])
        past_k, past_v = past_scores.input[1], past_values.input[1]
        in_place = {}
        cache_k, cache_v = (_transposed_input(producers, name, graph, perm)
                            for name, perm in ((past_k, [0, 2, 3, 1]), (past_v, [0, 2, 1, 3])))
        if cache_k is not None and cache_v is not None:  # read the cache in place: no Transpose of the past
            past_k, past_v, in_place = cache_k, cache_v, {"past_layout": 1}
        rows = helper.make_node("AttentionRows", [past_scores.input[0], past_k, step_scores.input[1],
                                                  past_v, step_values.input[1], where.input[0]],
                                list(add.output), name=f"{softmax.name}_rows", domain=DOMAIN, scale=float(scale),
                                **in_place)
        for n in (past_scores, step_scores, concat, scale_mul, reshape, where, softmax, view, *slices, *products, add):
            drop.add(n.name)
        insert[add.name] = rows
        replaced += 1
    nodes = [insert.get(n.name, n) for n in graph.node if n.name not in drop or n.name in insert]
    while True:  # drop what now feeds nothing (shape arithmetic of the old pattern)
        used = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
        kept = [n for n in nodes if any(o in used for o in n.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    graph.ClearField("node")
    graph.node.extend(nodes)
    return replaced


def quantize_step_graph(src: str | Path, dst: str | Path, spec: QuantSpec, embed_name: str = "embed_tokens.weight",
                        tied_transpose: str = "lm_head_tied_transpose") -> dict:
    """Write a weight-only quantized copy of the float32 step graph ``src`` to ``dst``.

    Args:
        src: the exported float32 ``model.onnx`` (external data beside it).
        dst: where to write the quantized graph (its weights go to ``dst.name + ".data"``).
        spec: bits, block size, accuracy level, head bits.
        embed_name: initializer of the token embedding [vocab, hidden].
        tied_transpose: name of the Transpose node that feeds a tied LM head (see
            :func:`lade_export.graph.export_onnx`).

    Returns:
        ``{"matmuls": n quantized, "embedding": "shared with the LM head" | "own table",
        "bytes_before": float32 weight bytes, "bytes_after": bytes of the quantized files}``.

    Raises:
        ValueError: the graph has no Gather on ``embed_name`` or hidden is not a multiple
            of the block size.
    """
    import onnx
    from onnx import helper, numpy_helper

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    bytes_before = sum(numpy_helper.to_array(i).nbytes for i in graph.initializer)
    embed = numpy_helper.to_array(inits[embed_name])  # [vocab, hidden]
    vocab, hidden = embed.shape
    if hidden % spec.block_size:
        raise ValueError(f"hidden size {hidden} is not a multiple of the block size {spec.block_size}")
    tied = next((n for n in graph.node if n.op_type == "Transpose" and n.name == tied_transpose), None)
    if not spec.head_bits:
        tied = None  # the head and the embedding stay float32 (and tied through the Transpose)
    head_weight = tied.output[0] if tied is not None else None
    nodes, matmuls, head = [], 0, None
    for node in graph.node:
        if node is tied:
            continue  # the head reads the embedding itself (quantized below)
        b = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        if b is not None and b == head_weight:
            new = _quantized_matmul(graph, node, np.ascontiguousarray(embed.T), spec.head_bits, spec, "absmax")
            head = new[0]
            nodes += new
            matmuls += 1
        elif (b in inits and len(inits[b].dims) == 2 and inits[b].dims[0] % spec.block_size == 0
              and not (list(inits[b].dims) == [hidden, vocab] and not spec.head_bits)):
            w = numpy_helper.to_array(inits[b])
            is_head = list(w.shape) == [hidden, vocab]
            nodes += _quantized_matmul(graph, node, w, spec.head_bits if is_head else spec.bits, spec,
                                       "absmax" if is_head else "minmax")
            matmuls += 1
        else:
            nodes.append(node)
    graph.ClearField("node")
    graph.node.extend(nodes)

    gather = next((n for n in graph.node if n.op_type == "Gather" and n.input and n.input[0] == embed_name), None)
    if gather is None:
        raise ValueError(f"the step graph has no Gather on {embed_name}")
    if not spec.head_bits:
        gather = None  # float32 embedding: nothing to replace
    if gather is None:
        extra, embedding = [], "float32"
    elif spec.kernels == "lade":
        extra, embedding = _block_q_embedding(graph, embed, head, gather, spec)
    else:
        extra, embedding = _nbits_embedding(graph, embed, head, gather, spec)
    if gather is not None:
        position = list(graph.node).index(gather)
        graph.node.remove(gather)
        for k, node in enumerate(extra):
            graph.node.insert(position + k, node)
    attentions = exact_attention(graph) if spec.kernels == "lade" and spec.compute == "int8" else 0
    if any(a.name == "past_layout" for n in graph.node if n.op_type == "AttentionRows" for a in n.attribute):
        # the runtime's fact (OrtEngine.attention_skips): attention costs the 16-key blocks a row sees
        model.metadata_props.append(onnx.StringStringEntryProto(key="attention_skips_masked", value="16"))
    drop_unused_initializers(graph)
    domain = "lade_export" if spec.kernels == "lade" else "com.microsoft"
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    for leftover in dst.parent.glob(dst.name + "*"):
        leftover.unlink()
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)
    size = dst.stat().st_size + (dst.parent / (dst.name + ".data")).stat().st_size
    return {"matmuls": matmuls, "embedding": embedding, "bytes_before": int(bytes_before), "bytes_after": int(size),
            **({"attention_rows": attentions} if attentions else {})}


def quality_report(reference_engine, quantized_engine, sequences: list[tuple[list[int], int]]) -> dict:
    """How far the quantized engine is from the float32 one, teacher-forced on real text.

    Args:
        reference_engine, quantized_engine: engines on the float32 and the quantized graph.
        sequences: ``(token ids, answer start)`` pairs: a prompt followed by an answer (the
            float32 engine's greedy answer); logits are compared at every answer position.

    Returns:
        ``{"positions", "top1_agreement" (fraction of positions whose argmax agrees),
        "max_abs_logit_diff", "sequences"}``.
    """
    from ..feeds import causal_feeds, empty_past_feeds, run_sequence_major

    agree = total = 0
    worst = 0.0
    for ids, start in sequences:
        rows = np.arange(start - 1, len(ids) - 1)
        feeds = {**causal_feeds(ids, 0, logit_rows=rows), **empty_past_feeds(reference_engine.dims)}
        ref = run_sequence_major(reference_engine, feeds, with_logits=True)["logits"][0]
        got = run_sequence_major(quantized_engine, feeds, with_logits=True)["logits"][0]
        agree += int(np.sum(ref.argmax(-1) == got.argmax(-1)))
        total += len(rows)
        worst = max(worst, float(np.max(np.abs(ref - got))))
    return {"sequences": len(sequences), "positions": total, "top1_agreement": agree / max(total, 1),
            "max_abs_logit_diff": worst}
