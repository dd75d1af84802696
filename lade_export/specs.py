"""The step graph's I/O contract, declared once.

Names, symbolic shapes and dtypes of every input and output of the exported decoder
step. The exporter's dynamic axes, the manifest, the TensorRT optimization profiles and
the runtime feeds are all derived from :func:`step_io_specs`.

Shape symbols:
    batch     — sequences in the batch
    step      — tokens fed in this forward pass (prompt length for prefill, 1 for a
                greedy step, up to 1 + (W+G)·(N−1) for a lookahead step)
    past      — tokens already in the KV cache
    past+step — key length seen by attention (``total``)
    n_logits  — positions whose logits are computed (``logits_positions``)

Mask convention: ``attention_mask`` is **boolean**, ``True`` where query row i may
attend key column j. Columns ``[0, past)`` are the cached tokens, ``[past, past+step)``
the tokens of this step in feed order. Every row must allow at least one column.

Packed passes (continuous batching, :mod:`lade_export.scheduler`): several requests'
steps travel as the rows of one batch-1 step — no other input. The cache is then one
token pool holding every request's keys/values, ``position_ids`` are each request's own
positions, and the mask is block diagonal: a request's rows see the pool columns it owns
and its own rows of this step. :mod:`lade_export.packed` computes that layout (row
offsets, logit offsets, pool column owners) in one place. The graph cannot tell a packed
pass from one request's step, so every artifact takes it; a pass over an empty cache
must hold one request (``GroupQueryAttention`` graphs take it as a first prompt, with
positions ``0 … step−1``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Shape facts of a LLaMA checkpoint that the step graph and the runtime need.

    Attributes:
        num_layers: decoder layers (one past/present key and value pair each).
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention when < ``heads``).
        head_dim: per-head width.
        hidden: model width.
        vocab: vocabulary size (last dim of ``logits``).
        max_context: the context the artifact declares, in tokens (prompt + new tokens).
        tied_embeddings: whether the LM head shares the token embedding.
    """

    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    max_context: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config) -> "ModelDims":
        """From a transformers ``LlamaConfig`` (or any object with its attribute names)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            max_context=config.max_position_embeddings,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @classmethod
    def from_dict(cls, data: dict) -> "ModelDims":
        """From the manifest's ``model.dims`` object (unknown keys are ignored)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: data[n] for n in names})

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of float32 keys and values one cached token takes over all layers (half
        that where the graph keeps a float16 cache: the integer path's)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * 4


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named graph tensor.

    Attributes:
        name: the ONNX tensor name.
        shape: symbolic dims; ``str`` entries are dynamic axes, ``int`` entries fixed.
        dtype: numpy dtype name (``int64``, ``bool``, ``float32``, ``float16``).
        doc: what it holds.
    """

    name: str
    shape: tuple
    dtype: str
    doc: str

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "doc": self.doc}


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


#: KV cache layouts of the step graph (manifest ``graph.kv_cache``).
#: ``sequence-major``: past [batch, past, kv_heads, head_dim] (the filled prefix of a
#: sequence-major buffer, contiguous), present = this step's keys/values only.
#: ``head-major-shared``: past and present are one [batch, kv_heads, capacity, head_dim]
#: buffer per tensor, filled up to ``past`` = (attention_mask columns − step); the step
#: writes its keys/values at [past, past+step) of the buffer it is given, in place when
#: the caller binds each present output to its past input's memory (ONNX Runtime's
#: ``GroupQueryAttention`` with a shared past/present buffer).
KV_LAYOUTS = ("sequence-major", "head-major-shared")


def step_io_specs(num_layers: int, kv_heads: int, head_dim: int, vocab: int, float_dtype: str = "float32",
                  kv_layout: str = "sequence-major", kv_dtype: str | None = None):
    """Return ``(inputs, outputs)``: lists of :class:`TensorSpec` for the decoder step.

    Args:
        num_layers: decoder layers (one past/present key and value pair each).
        kv_heads: key/value heads (grouped-query attention when < query heads).
        head_dim: per-head width.
        vocab: vocabulary size (last dim of ``logits``).
        float_dtype: dtype of the KV cache and logits.
        kv_dtype: dtype of the KV cache where it differs from ``float_dtype`` (``float16``:
            the integer path's half-precision cache,
            :func:`lade_export.export.attention_rows.half_precision_cache`); None: ``float_dtype``.
        kv_layout: one of :data:`KV_LAYOUTS`.

    Raises:
        ValueError: an unknown ``kv_layout``.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    shared = kv_layout == "head-major-shared"
    cache_dtype = kv_dtype or float_dtype
    inputs = [
        TensorSpec("input_ids", ("batch", "step"), "int64", "token ids of this step, in feed order"),
        TensorSpec("position_ids", ("batch", "step"), "int64", "RoPE position of each fed token (need not be contiguous)"),
        TensorSpec(
            "attention_mask",
            ("batch", 1, "step", "past+step"),
            "bool",
            "True where row i may attend column j; columns are [cache | this step]",
        ),
        TensorSpec(
            "logits_positions",
            ("batch", "n_logits"),
            "int64",
            "indices into the step axis whose logits are computed (the LM head runs only there)",
        ),
    ]
    for i in range(num_layers):
        for name in (past_key_name(i), past_value_name(i)):
            inputs.append(
                TensorSpec(name, ("batch", kv_heads, "capacity", head_dim), cache_dtype,
                           f"layer {i} keys/values buffer, head-major, filled up to past (RoPE applied to keys)")
                if shared else
                TensorSpec(name, ("batch", "past", kv_heads, head_dim), cache_dtype,
                           f"layer {i} cached keys/values, sequence-major (RoPE applied to keys)")
            )
    outputs = [
        TensorSpec("logits", ("batch", "n_logits", vocab), float_dtype, "next-token logits at logits_positions"),
        TensorSpec("next_token_ids", ("batch", "n_logits"), "int64", "argmax of logits (greedy choice)"),
    ]
    for i in range(num_layers):
        for name in (present_key_name(i), present_value_name(i)):
            outputs.append(
                TensorSpec(name, ("batch", kv_heads, "capacity", head_dim), cache_dtype,
                           f"layer {i} the past buffer with this step's keys/values at [past, past+step)")
                if shared else
                TensorSpec(name, ("batch", "step", kv_heads, head_dim), cache_dtype,
                           f"layer {i} keys/values of this step only, sequence-major")
            )
    return inputs, outputs


def dynamic_axes(specs) -> dict:
    """Exporter ``dynamic_axes`` mapping {name: {axis: symbol}} from specs."""
    return {s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in specs}
