"""Weight-only quantized step graphs for ONNX Runtime (``build --precision int4|int8``).

Every MatMul of the transformer layers (attention and MLP projections; query/key/value
and gate/up arrive fused, one MatMul each, from :mod:`lade_export.export.fusion`) becomes ONNX
Runtime's ``MatMulNBits`` (com.microsoft contrib op; ONNX Runtime ContribOperators.md):
4 or 8 bits per weight, one float32 scale per block of ``block_size`` weights along the
input dimension, ``accuracy_level`` choosing the kernel's compute type — or, with
``build --kernels lade``, this project's ``MatMulBlockQ`` (:mod:`lade_export.kernels`).
This module is the spec, the rewrite pass and the quality check; the nodes it writes are
:mod:`.quantized_ops`, the weights' grids and storage layouts :mod:`.weight_blocks`, the
int8 path's attention rewrite :mod:`.attention_rows`.
The measured figures behind the choices below (logit gaps, agreement rates, step times,
sizes) are in bench/results/design-figures.md (*Quantized step graphs*).

**Exactness decides the compute type.** Lookahead is exact only if the engine computes a
token the same way in a one-token step (greedy) and inside a many-token step (lookahead).
With ``accuracy_level`` 4 (int8 activations) ONNX Runtime 1.32's CPU kernels quantize the
activations of a one-row step differently from those of a two-or-more-row step (row 0 of
SmolLM2's int4 graph: far apart in the logits, where float32 compute differs in the last
bits), and float32-level differences between the two histories are then amplified by the
rounding to int8: most MT-Bench answers diverged from greedy within 128 tokens, also
with greedy steps padded to two rows. With ``accuracy_level`` 1 (float32 compute) the
int4 graph behaves like the float32 one. So:

* ``int4`` computes in float32 (level 1): exact lookahead, and on SmolLM2 a one-token step
  faster than the float32 graph's (the weights are read at 4 bits).
* ``int8``: ONNX Runtime's CPU 8-bit kernels have no fast float32-compute path (level 1
  is far slower than float32), so int8 uses level 4 and its artifacts say
  ``lookahead_exact: false``: the runtime decodes them greedily (or by sampling) one token
  per step and refuses lookahead rather than break the promise.
* ``int4`` with ``accuracy_level`` 4 and ``head_bits`` 8 (``build --precision int4
  --accuracy-level 4 --head-bits 8 --profile greedy-only``): the arithmetic of llama.cpp's
  Q4_1 × Q8_1 kernels (4-bit weights, activations rounded to 8 bits per block) with the
  head and embedding at 8 bits, exact for SmolLM2's Q8_0 ``token_embd``. Greedy only, like
  int8; on SmolLM2 a one-token step is faster than exact int4's, most of the gain the 8-bit
  head in place of the float32 one.

**Weights**: ``minmax`` blocks with a real zero point, split into the integer one
``MatMulNBits`` takes and a residual term ``Σ_block(x) @ R`` added beside it, so that a
Q4_1 checkpoint's blocks are recovered exactly (:mod:`.weight_blocks` explains the grid
and why ONNX Runtime's own quantizer is not used).

**LM head and embedding** stay float32 by default (``head_bits`` 0; the tied embedding
stays one tensor behind a Transpose). ``head_bits`` 8 or 4 quantizes them with symmetric
``absmax`` blocks into a ``MatMulNBits`` head and a ``GatherBlockQuantized`` embedding
reading the head's packed weight through a ``Reshape`` (one tensor on disk; ONNX Runtime
may keep two copies in memory) — but an 8-bit head needs int8 activations (see above) and
a 4-bit one loses quality, so neither is the default.

**This project's kernels** (``build --kernels lade``; :mod:`lade_export.kernels`) replace
``MatMulNBits`` by ``MatMulBlockQ``, a custom operator compiled into the artifact: the same
blocks of 32 stored as GGML's Q4_1 (a Q4_1 checkpoint's blocks as they are; no residual term)
and, for the head and the tied embedding (8 bits by default there), Q8_0's; each output row is
computed from its own input row alone. Its arithmetic is ``compute``: ``int8`` (the default;
integer sums over activations rounded per row and block of 32, the same bits on every CPU
path) or ``float32`` (``build --compute float32``: float32 FMAs, tokens closer to the float32
engine's). Row-exact weight kernels are not enough for int8 activations, so an int8 build takes
the ``onnx-ops`` attention and :func:`~.attention_rows.exact_attention` replaces each by the
kernels' ``AttentionRows`` (why: :mod:`.attention_rows`); lookahead is then exact. Its KV cache
is float16 (:func:`~.attention_rows.half_precision_cache`), and each layer's attention, from the
fused query/key/value projection to the output projection's input, becomes one
``RotaryAttentionRows`` (:func:`~.attention_rows.fuse_rotary_attention`: the same bits, ~30 fewer
nodes per layer for ONNX Runtime to dispatch). The
artifact is smaller, and a one-token step reads about the bytes llama.cpp's Q4_1 step reads.

Attention itself (softmax, the KV cache) stays float32; the I/O contract of the step graph
(:mod:`lade_export.specs`) does not change. Quality against the float32 graph is measured
by :func:`quality_report` and recorded in the manifest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import ProfileError
from ..kernels import COMPUTE, KERNELS
from .attention_rows import exact_attention, fuse_rotary_attention, half_precision_cache
from .sanitize import drop_unused_initializers
from .quantized_ops import block_q_embedding, lade_argmax, nbits_embedding, quantized_matmul
from .row_fusion import fuse_row_work
from .weight_blocks import LANE_BLOCK

#: ``--precision`` values for ONNX Runtime, and the bits each means.
ORT_PRECISIONS = {"fp32": None, "int8": 8, "int4": 4}


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
        if self.bits not in (4, 8):
            raise ProfileError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.head_bits not in (0, 4, 8):
            raise ProfileError(f"--head-bits must be 0 (float32), 4 or 8, got {self.head_bits}")
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
            return cls(bits, LANE_BLOCK if block_size is None else block_size, 0, 8 if head_bits is None else head_bits,
                       kernels, compute or "int8")
        if compute is not None:  # given at all (float32 too): only the lade kernels take it
            raise ProfileError(f"--compute picks the arithmetic of --kernels lade; ONNX Runtime's MatMulNBits takes "
                               f"--accuracy-level instead: drop --compute {compute} or add --kernels lade")
        level = accuracy_level if accuracy_level is not None else (1 if bits == 4 else 4)
        return cls(bits, 32 if block_size is None else block_size, level, head_bits or 0, kernels)

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
        "bytes_before": float32 weight bytes, "bytes_after": bytes of the quantized files}``, and for
        int8-compute lade graphs ``attention_rows`` (attentions swapped for ``AttentionRows``),
        ``kv_cache_dtype`` (``float16``) and ``rotary_attention_rows`` (layers fused into one
        ``RotaryAttentionRows`` each); for lade graphs ``argmax_rows`` (the tokens' ``ArgMax``
        swapped for ``ArgMaxRows``).

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
            new = quantized_matmul(graph, node, np.ascontiguousarray(embed.T), spec.head_bits, spec, "absmax")
            head = new[0]
            nodes += new
            matmuls += 1
        elif (b in inits and len(inits[b].dims) == 2 and inits[b].dims[0] % spec.block_size == 0
              and not (list(inits[b].dims) == [hidden, vocab] and not spec.head_bits)):
            w = numpy_helper.to_array(inits[b])
            is_head = list(w.shape) == [hidden, vocab]
            nodes += quantized_matmul(graph, node, w, spec.head_bits if is_head else spec.bits, spec,
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
        extra, embedding = block_q_embedding(graph, embed, head, gather, spec)
    else:
        extra, embedding = nbits_embedding(graph, embed, head, gather, spec)
    if gather is not None:
        position = list(graph.node).index(gather)
        graph.node.remove(gather)
        for k, node in enumerate(extra):
            graph.node.insert(position + k, node)
    attentions = exact_attention(graph) if spec.kernels == "lade" and spec.compute == "int8" else 0
    if any(a.name == "past_layout" for n in graph.node if n.op_type == "AttentionRows" for a in n.attribute):
        # the runtime's fact (OrtEngine.attention_skips): attention costs the 16-key blocks a row sees
        model.metadata_props.append(onnx.StringStringEntryProto(key="attention_skips_masked", value="16"))
    half_cache = half_precision_cache(graph)  # 0 without in-place AttentionRows
    rotary = fuse_rotary_attention(graph) if half_cache else 0  # one RotaryAttentionRows per layer
    folded = fuse_row_work(graph) if attentions else {}  # norms, SwiGLU, residual adds into MatMulBlockQ
    argmax = lade_argmax(graph) if spec.kernels == "lade" else 0  # the tokens' ArgMax → ArgMaxRows
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
            **({"attention_rows": attentions} if attentions else {}),
            **({"kv_cache_dtype": "float16"} if half_cache else {}),
            **({"rotary_attention_rows": rotary} if rotary else {}),
            **({"matmul_row_work": folded} if any(folded.values()) else {}),
            **({"argmax_rows": argmax} if argmax else {})}


def teacher_forced_logits(engine, sequences: list[tuple[list[int], int]]) -> Iterator[np.ndarray]:
    """The engine's logits at every answer position, the whole sequence fed as one prompt,
    one sequence at a time (a caller comparing two engines holds two sequences' logits, not
    every answer's: SmolLM2's are 0.2 MB a position).

    Args:
        engine: an engine (:class:`lade_export.runtime.Engine`), open while the iterator runs.
        sequences: ``(token ids, answer start)`` pairs: a prompt followed by an answer.

    Yields:
        per sequence, float32 [len(ids) − start, vocab]: row i predicts ``ids[start + i]``.
    """
    from ..feeds import causal_feeds, empty_past_feeds, run_sequence_major

    for ids, start in sequences:
        rows = np.arange(start - 1, len(ids) - 1)
        feeds = {**causal_feeds(ids, 0, logit_rows=rows), **empty_past_feeds(engine.dims)}
        yield run_sequence_major(engine, feeds, with_logits=True)["logits"][0]


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
    agree = total = 0
    worst = 0.0
    for ref, got in zip(teacher_forced_logits(reference_engine, sequences),
                        teacher_forced_logits(quantized_engine, sequences)):
        agree += int(np.sum(ref.argmax(-1) == got.argmax(-1)))
        total += len(ref)
        worst = max(worst, float(np.max(np.abs(ref - got))))
    return {"sequences": len(sequences), "positions": total, "top1_agreement": agree / max(total, 1),
            "max_abs_logit_diff": worst}
