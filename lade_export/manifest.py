"""The artifact manifest (``manifest.json``, schema_version 2) as one family of typed dataclasses.

docs/manifest.md documents every key; this module is its code. The build
(:func:`lade_export.export.build.build_artifact`) fills a :class:`Manifest` and writes
:meth:`Manifest.to_dict`; :class:`lade_export.artifact.Artifact` reads one with
:meth:`Manifest.from_dict` (``artifact.spec``), which checks what the runtime needs and
fills in the defaults of the optional keys. Those defaults are written down here and
nowhere else: ``graph.precision`` ``fp32``, ``graph.attention`` ``onnx-ops``,
``graph.kv_cache`` ``sequence-major``, ``graph.lookahead_exact`` true,
``quantization.spec.kernels`` ``onnxruntime``, a lade build's ``compute`` ``float32``,
a profile's ``lookup_branches`` and ``lookup_min_match`` 1
(:meth:`lade_export.profile.LookaheadProfile.from_dict`).

Round trip: for a manifest the build wrote, ``Manifest.from_dict(d).to_dict() == d``,
key for key, value for value and in the same order. A manifest of an earlier schema-2
build that lacks an optional key reads with the key's default, which ``to_dict`` then
writes out.

Unknown keys: within a schema version later builds may add optional keys
(docs/manifest.md, *Versioning*), which readers ignore. Every section typed here keeps
the keys it does not know in its ``extra`` mapping, and ``to_dict`` writes them back after
the known ones, so nothing a newer build wrote is lost; the runtime never reads them.
Entries read into classes of other modules — a lookahead profile
(:class:`~lade_export.profile.LookaheadProfile`, whose ``max_step`` is derived, not read)
and a graph tensor (:class:`~lade_export.specs.TensorSpec`) — ignore unknown keys.

Sections nobody reads key by key stay plain mappings: ``versions``, ``timings_s``, the
parity cases, the engines' optimization-profile shapes, precision plans and sanitize
counts. Decoding imports this module: it needs neither torch nor transformers.

Why one module of about 800 lines (over the package's ~400): it is one schema. Each of
its sixteen classes is one section of docs/manifest.md — its fields with their meanings
and units (about a third of the lines are these docstrings), its checks and defaults in
``from_dict``, its ``to_dict`` — and nothing else; split over modules, the defaults that
must live in one place and the one page docs/manifest.md mirrors would be scattered.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from .errors import ArtifactError, ProfileError
from .profile import LookaheadProfile
from .specs import ModelDims, TensorSpec

SCHEMA_VERSION = 2

#: Keys every manifest section must hold for the runtime to open the artifact (besides
#: what the typed sections below require).
REQUIRED_KEYS = {"graph": ("file", "opset", "inputs", "outputs"), "model": ("dims", "stop_token_ids")}
#: Top-level sections every manifest holds, each a JSON object.
REQUIRED_SECTIONS = ("source", "model", "graph", "tokenizer", "files")

#: ``model.dims`` keys (the fields of :class:`lade_export.specs.ModelDims`).
DIMS_FIELDS = tuple(f.name for f in dataclasses.fields(ModelDims))

#: What lade kernels compute in when a build did not record it (builds before int8 compute).
LADE_DEFAULT_COMPUTE = "float32"

_EMPTY: Mapping = MappingProxyType({})


def _valid_dim(name: str, value) -> bool:
    """A ``model.dims`` value as the runtime needs it: ``tied_embeddings`` a bool, every
    other field a positive int (not a bool)."""
    if name == "tied_embeddings":
        return isinstance(value, bool)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_KIND_NAMES = {"string": "a string", "integer": "an integer", "list": "a list", "integers": "a list of integers"}


def _is_kind(value, kind: str) -> bool:
    """Whether a JSON value is of ``kind`` (``string``, ``integer`` — not a boolean —,
    ``list``, ``integers``: a list of integers)."""
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "list":
        return isinstance(value, list)
    return isinstance(value, list) and all(_is_kind(v, "integer") for v in value)


class _Reader:
    """Collects, while a manifest is read, the keys it lacks (or holds as the wrong kind
    of JSON value) and the values that are wrong, so the refusal is one line."""

    def __init__(self):
        self.lacking: list[str] = []
        self.wrong: list[str] = []

    def need(self, data: dict, key: str, at: str, kind: str | None = None):
        """``data[key]``, or None with ``at.key`` noted as lacking: absent, null, or (``kind``
        given: ``"string"``, ``"integer"``, ``"list"``) another kind of JSON value."""
        where = f"{at}.{key}" if at else key
        value = data.get(key)
        if value is None:
            self.lacking.append(where)
            return None
        if kind is not None and not _is_kind(value, kind):
            self.lacking.append(f"{where} ({_KIND_NAMES[kind]})")
            return None
        return value

    def optional(self, data: dict, key: str, at: str, kind: str, default=None):
        """``data[key]`` when present and not null, else ``default``; a value of another
        kind than ``kind`` is noted as lacking (and ``default`` returned)."""
        value = data.get(key)
        if value is None:
            return default
        if not _is_kind(value, kind):
            self.lacking.append(f"{at}.{key} ({_KIND_NAMES[kind]})")
            return default
        return value

    def mapping(self, value, at: str) -> dict | None:
        """``value`` when it is a JSON object, else None with ``at (an object)`` noted."""
        if isinstance(value, dict):
            return value
        self.lacking.append(f"{at} (an object)")
        return None

    def array(self, value, at: str) -> list | None:
        """``value`` when it is a JSON array, else None with ``at (a list)`` noted."""
        if isinstance(value, list):
            return value
        self.lacking.append(f"{at} (a list)")
        return None

    def profile(self, value, at: str) -> LookaheadProfile | None:
        """A lookahead profile entry, or None with the reason noted (lacking or wrong)."""
        if self.mapping(value, at) is None:
            return None
        try:
            return LookaheadProfile.from_dict(value, name=value.get("name", "custom"))
        except ProfileError as err:
            self.wrong.append(f"{at}: {err}")
            return None

    def raise_if_any(self, where) -> None:
        """Raise the one-line refusal for what was noted.

        Raises:
            ArtifactError: ``WHERE: manifest lacks A, B; rebuild with lade-export build``,
                or ``WHERE: manifest has A: …; rebuild …`` for wrong values.
        """
        prefix = f"{where}: " if where else ""
        if self.lacking:
            raise ArtifactError(f"{prefix}manifest lacks {', '.join(dict.fromkeys(self.lacking))}; "
                                "rebuild with lade-export build")
        if self.wrong:
            raise ArtifactError(f"{prefix}manifest has {'; '.join(self.wrong)}; rebuild with lade-export build")


def _extra(cls, data: dict) -> Mapping:
    """The keys of ``data`` that ``cls`` has no field for (kept, see the module doc)."""
    known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    return MappingProxyType({k: v for k, v in data.items() if k not in known})


def _present(**values) -> dict:
    """The given keys whose value is not None (optional keys a build writes only when set)."""
    return {k: v for k, v in values.items() if v is not None}


class _Section:
    """A typed manifest section: ``from_dict`` for one section alone (the build uses it on
    the dicts its stages return), ``to_dict`` the JSON object."""

    #: The section's place in the manifest, for messages.
    AT = ""

    @classmethod
    def from_dict(cls, data, where=None, at: str | None = None):
        """Read the section from its JSON object.

        Raises:
            ArtifactError: a required key is missing or a value is wrong (one line).
        """
        r = _Reader()
        at = cls.AT if at is None else at
        value = cls._read(r, data, at) if r.mapping(data, at) is not None else None
        r.raise_if_any(where)
        return value

    # A section of optional keys only (every field but ``extra`` may be absent, written in
    # field order when set); sections with required keys or nested sections override both.
    @classmethod
    def _read(cls, r: _Reader, data: dict, at: str):
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls) if f.name != "extra"},
                   extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {**_present(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}),
                **self.extra}


@dataclasses.dataclass(frozen=True)
class Source(_Section):
    """``source``: what the artifact was built from.

    Attributes:
        model: the ``--model`` value (local paths absolute): what ``check`` and the torch
            backend load as the PyTorch reference.
        kind: ``builtin``, ``hf-dir``, ``gguf`` or ``hub`` (None when not recorded).
        extra: keys this version does not know, kept (module doc).
    """

    AT = "source"
    model: str
    kind: str | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        model = r.need(data, "model", at, "string")
        return None if model is None else cls(model=model, kind=data.get("kind"), extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"model": self.model, **_present(kind=self.kind), **self.extra}


@dataclasses.dataclass(frozen=True)
class Rope(_Section):
    """``model.rope``: how the rotary embedding was exported (docs/manifest.md, *model.rope*;
    written from :class:`lade_export.export.rope.RopePlan`).

    Attributes:
        type: transformers' rope type (``default``, ``linear``, ``dynamic``, ``yarn``,
            ``llama3``, ``longrope``, ``proportional``).
        handling: ``exact`` or ``capped`` (the declared context stops where transformers'
            frequencies start to depend on the call).
        max_position_embeddings: the configuration's context, tokens.
        declared_context: the context the artifact declares (= ``dims.max_context``), tokens.
        position_dependent: whether transformers picks this type's frequencies per call.
        thresholds: sequence lengths (tokens) where the rope behaviour changes.
        reason: why the context is capped; empty when ``handling`` is ``exact``.
        extra: keys this version does not know, kept.
    """

    AT = "model.rope"
    type: str
    handling: str
    max_position_embeddings: int
    declared_context: int
    position_dependent: bool = False
    thresholds: tuple = ()
    reason: str = ""
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        needed = {k: r.need(data, k, at) for k in ("type", "handling", "max_position_embeddings", "declared_context")}
        thresholds = r.array(data.get("thresholds", []), f"{at}.thresholds")
        if any(v is None for v in needed.values()) or thresholds is None:
            return None
        return cls(**needed, position_dependent=data.get("position_dependent", False), thresholds=tuple(thresholds),
                   reason=data.get("reason", ""), extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"type": self.type, "position_dependent": self.position_dependent, "handling": self.handling,
                "max_position_embeddings": self.max_position_embeddings, "declared_context": self.declared_context,
                "thresholds": list(self.thresholds), "reason": self.reason, **self.extra}


@dataclasses.dataclass(frozen=True)
class ModelInfo(_Section):
    """``model``: facts about the model.

    Attributes:
        dims: shape facts (:class:`lade_export.specs.ModelDims`: layers, heads, widths,
            vocabulary, ``max_context`` in tokens, tied embeddings).
        stop_token_ids: every id that ends generation (emitted, nothing after it).
        architecture: ``llama``.
        bos_token_id, eos_token_id, pad_token_id: the tokenizer's special ids, or None.
        rope: how the rotary embedding was exported; None in earlier schema-2 builds.
        extra: keys this version does not know, kept.
    """

    AT = "model"
    dims: ModelDims
    stop_token_ids: tuple
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    rope: Rope | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        dims = data.get("dims")
        if isinstance(dims, dict):
            r.lacking += [f"{at}.dims.{name}" for name in DIMS_FIELDS if name not in dims]
        else:
            r.lacking.append(f"{at}.dims (an object)" if "dims" in data else f"{at}.dims")
        stops = r.need(data, "stop_token_ids", at, "integers")
        rope = Rope._read(r, data["rope"], f"{at}.rope") \
            if data.get("rope") is not None and r.mapping(data["rope"], f"{at}.rope") is not None else None
        if r.lacking or stops is None or not isinstance(dims, dict):
            return None
        wrong = [f"{at}.dims.{name} = {dims[name]!r}" for name in DIMS_FIELDS if not _valid_dim(name, dims[name])]
        if wrong:
            r.wrong.append(f"{', '.join(wrong)} (sizes are positive integers, tied_embeddings true or false)")
            return None
        return cls(dims=ModelDims.from_dict(dims), stop_token_ids=tuple(stops),
                   architecture=data.get("architecture", "llama"), bos_token_id=data.get("bos_token_id"),
                   eos_token_id=data.get("eos_token_id"), pad_token_id=data.get("pad_token_id"), rope=rope,
                   extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, "dims": self.dims.as_dict(),
                **({"rope": self.rope.to_dict()} if self.rope is not None else {}),
                "stop_token_ids": list(self.stop_token_ids), "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id, **self.extra}


def _tensors(r: _Reader, value, at: str) -> tuple | None:
    """``graph.inputs`` / ``graph.outputs`` entries as :class:`TensorSpec` values."""
    entries = r.array(value, at)
    if entries is None:
        return None
    out = []
    for i, entry in enumerate(entries):
        where = f"{at}[{i}]"
        if r.mapping(entry, where) is None:
            continue
        name, shape, dtype = (r.need(entry, k, where, kind) for k, kind in
                              (("name", "string"), ("shape", "list"), ("dtype", "string")))
        if None not in (name, shape, dtype):
            out.append(TensorSpec(name=name, shape=tuple(shape), dtype=dtype, doc=entry.get("doc", "")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class GraphInfo(_Section):
    """``graph``: the step graph's contract (docs/manifest.md, *graph*).

    Attributes:
        file: the ONNX graph, relative to the artifact (``model.onnx``).
        opset: ONNX opset.
        inputs, outputs: the graph's tensors (:class:`lade_export.specs.TensorSpec`: name,
            symbolic shape, numpy dtype name, doc).
        external_data: the weights file beside the graph (``model.onnx.data``), or None.
        precision: the weights' format: ``fp32``, ``int4`` or ``int8``.
        lookahead_exact: whether a token is computed the same in one-token and multi-token
            steps (False: the runtime decodes one token per step).
        custom_ops: the custom-op library the graph needs (``--kernels lade`` builds), or None.
        mask: the mask convention in words.
        attention: ``onnx-ops`` or ``group-query-attention``.
        kv_cache: the cache contract, ``sequence-major`` or ``head-major-shared``
            (:data:`lade_export.specs.KV_LAYOUTS`).
        kv_layout: the KV cache layout in words.
        extra: keys this version does not know, kept.
    """

    AT = "graph"
    file: str
    opset: int
    inputs: tuple
    outputs: tuple
    external_data: str | None = None
    precision: str = "fp32"
    lookahead_exact: bool = True
    custom_ops: str | None = None
    mask: str | None = None
    attention: str = "onnx-ops"
    kv_cache: str = "sequence-major"
    kv_layout: str | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        file, opset, inputs, outputs = (r.need(data, k, at, kind) for k, kind in
                                        zip(REQUIRED_KEYS["graph"], ("string", "integer", "list", "list")))
        inputs = _tensors(r, inputs, f"{at}.inputs") if inputs is not None else None
        outputs = _tensors(r, outputs, f"{at}.outputs") if outputs is not None else None
        external = r.optional(data, "external_data", at, "string")
        if None in (file, opset, inputs, outputs):
            return None
        return cls(file=file, opset=opset, inputs=inputs, outputs=outputs, external_data=external,
                   precision=data.get("precision", "fp32"), lookahead_exact=data.get("lookahead_exact", True),
                   custom_ops=data.get("custom_ops"), mask=data.get("mask"),
                   attention=data.get("attention", "onnx-ops"), kv_cache=data.get("kv_cache", "sequence-major"),
                   kv_layout=data.get("kv_layout"), extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"file": self.file, "external_data": self.external_data, "opset": self.opset,
                "precision": self.precision, "lookahead_exact": self.lookahead_exact,
                **_present(custom_ops=self.custom_ops, mask=self.mask), "attention": self.attention,
                "kv_cache": self.kv_cache, **_present(kv_layout=self.kv_layout),
                "inputs": [t.as_dict() for t in self.inputs], "outputs": [t.as_dict() for t in self.outputs],
                **self.extra}


@dataclasses.dataclass(frozen=True)
class TokenizerInfo(_Section):
    """``tokenizer``: how to turn text into ids and back (docs/manifest.md, *tokenizer*).

    Attributes:
        file: the Hugging Face ``tokenizer.json``, relative to the artifact.
        dir: the folder holding the tokenizer files.
        chat_template: the jinja2 chat template, or None.
        special_tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` strings.
        checked_samples: sample texts the build checked against transformers (None: not recorded).
        files: every file under ``dir``, relative to the artifact.
        extra: keys this version does not know, kept.
    """

    AT = "tokenizer"
    file: str
    dir: str = "tokenizer"
    chat_template: str | None = None
    special_tokens: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)
    checked_samples: int | None = None
    files: tuple = ()
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        file = r.need(data, "file", at, "string")
        special = r.mapping(data.get("special_tokens", {}), f"{at}.special_tokens")
        files = r.array(data.get("files", []), f"{at}.files")
        template = r.optional(data, "chat_template", at, "string")
        folder = r.optional(data, "dir", at, "string", "tokenizer")
        if None in (file, special, files):
            return None
        return cls(file=file, dir=folder, chat_template=template,
                   special_tokens=MappingProxyType(dict(special)), checked_samples=data.get("checked_samples"),
                   files=tuple(files), extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"dir": self.dir, "file": self.file, "chat_template": self.chat_template,
                "special_tokens": dict(self.special_tokens), **_present(checked_samples=self.checked_samples),
                "files": list(self.files), **self.extra}


@dataclasses.dataclass(frozen=True)
class Parity(_Section):
    """``parity``: the build's ONNX Runtime vs PyTorch check (cases kept as mappings).

    Attributes:
        bounds: ``max_abs``, ``max_rel`` the cases were held to.
        prompt_tokens: tokens of the parity prompt.
        cases: per shape ``label``, ``step``, ``past``, ``max_abs``, ``max_logit``, ``rel``,
            ``argmax_equal``, ``kv_max_abs``.
        transformers: the graph against transformers' own model (docs/manifest.md,
            *parity.transformers*), None in earlier schema-2 builds.
        extra: keys this version does not know, kept.
    """

    AT = "parity"
    bounds: Mapping | None = None
    prompt_tokens: int | None = None
    cases: tuple = ()
    transformers: Mapping | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        cases = r.array(data.get("cases", []), f"{at}.cases")
        return None if cases is None else cls(bounds=data.get("bounds"), prompt_tokens=data.get("prompt_tokens"),
                                              cases=tuple(cases), transformers=data.get("transformers"),
                                              extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {**_present(bounds=self.bounds, prompt_tokens=self.prompt_tokens), "cases": list(self.cases),
                **_present(transformers=self.transformers), **self.extra}


@dataclasses.dataclass(frozen=True)
class EngineEntry(_Section):
    """One ``engines[]`` entry: a TensorRT engine (docs/manifest.md, *engines[]*). Only
    ``file`` is required; a key a build did not write is None.

    Attributes:
        file: the plan, relative to the artifact (``engines/NAME.plan``).
        lookahead_profile: the lookahead profile it serves (JSON key ``profile``).
        precision: ``fp32``, ``fp16`` or ``bf16``.
        max_batch, max_prompt, max_context: the bounds of its optimization profiles
            (sequences, tokens, tokens).
        version_compatible, hardware_compatible: TensorRT builder flags.
        optimization_profiles: ``prefill``, ``decode`` (and ``packed``): per input
            ``{min, opt, max}`` shapes.
        tensorrt_version: the TensorRT that built it.
        compute_capability: the GPU it was built on (``9.0``).
        build_s: build time, seconds.
        precision_plan: how the precision was set for that TensorRT.
        graph_parity: the reduced-precision graph's check, None when the float32 graph was parsed.
        sanitize: ``nodes_before``, ``nodes_after`` of the graph cleanup.
        sha256: of the plan file.
        extra: keys this version does not know, kept.
    """

    AT = "engines[]"
    file: str
    lookahead_profile: LookaheadProfile | None = None
    precision: str | None = None
    max_batch: int | None = None
    max_prompt: int | None = None
    max_context: int | None = None
    version_compatible: bool | None = None
    hardware_compatible: bool | None = None
    optimization_profiles: Mapping | None = None
    tensorrt_version: str | None = None
    compute_capability: str | None = None
    build_s: float | None = None
    precision_plan: Mapping | None = None
    graph_parity: Mapping | None = None
    sanitize: Mapping | None = None
    sha256: str | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    _PLAIN = ("precision", "max_batch", "max_prompt", "max_context", "version_compatible", "hardware_compatible",
              "optimization_profiles", "tensorrt_version", "compute_capability", "build_s", "precision_plan")

    @classmethod
    def _read(cls, r, data, at):
        file = r.need(data, "file", at)
        profile = r.profile(data["profile"], f"{at}.profile") if "profile" in data else None
        if file is None or ("profile" in data and profile is None):
            return None
        return cls(file=file, lookahead_profile=profile, **{k: data.get(k) for k in cls._PLAIN},
                   graph_parity=data.get("graph_parity"), sanitize=data.get("sanitize"), sha256=data.get("sha256"),
                   extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"file": self.file, **({"profile": self.lookahead_profile.as_dict()} if self.lookahead_profile is not None else {}),
                **_present(**{k: getattr(self, k) for k in self._PLAIN}), "graph_parity": self.graph_parity,
                **_present(sanitize=self.sanitize, sha256=self.sha256), **self.extra}


@dataclasses.dataclass(frozen=True)
class QuantizationSpec(_Section):
    """``quantization.spec``: how the weights were quantized (:class:`lade_export.export.quantize.QuantSpec`).

    Attributes:
        bits: bits per layer weight (4 or 8).
        head_bits: bits of the LM head and embedding (0: float32).
        block_size: weights per quantization block.
        lookahead_exact: whether the graph computes a token the same at every step shape.
        kernels: ``onnxruntime`` (``MatMulNBits``) or ``lade`` (this project's kernels).
        compute: what the lade kernels compute in, ``float32`` or ``int8`` (None with
            ``onnxruntime`` kernels).
        activations: how int8 compute rounds activations (int8 compute only).
        accuracy_level: ``MatMulNBits`` compute type (``onnxruntime`` kernels only).
        layers, head_and_embedding: the schemes in words.
        extra: keys this version does not know, kept.
    """

    AT = "quantization.spec"
    bits: int | None = None
    head_bits: int | None = None
    block_size: int | None = None
    lookahead_exact: bool | None = None
    kernels: str = "onnxruntime"
    compute: str | None = None
    activations: str | None = None
    accuracy_level: int | None = None
    layers: str | None = None
    head_and_embedding: str | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        kernels = data.get("kernels", "onnxruntime")
        compute = data.get("compute", LADE_DEFAULT_COMPUTE if kernels == "lade" else None)
        return cls(bits=data.get("bits"), head_bits=data.get("head_bits"), block_size=data.get("block_size"),
                   lookahead_exact=data.get("lookahead_exact"), kernels=kernels, compute=compute,
                   activations=data.get("activations"), accuracy_level=data.get("accuracy_level"),
                   layers=data.get("layers"), head_and_embedding=data.get("head_and_embedding"),
                   extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {**_present(bits=self.bits, head_bits=self.head_bits, block_size=self.block_size,
                           lookahead_exact=self.lookahead_exact), "kernels": self.kernels,
                **_present(compute=self.compute, activations=self.activations, accuracy_level=self.accuracy_level,
                           layers=self.layers, head_and_embedding=self.head_and_embedding), **self.extra}


@dataclasses.dataclass(frozen=True)
class QuantizedGraph(_Section):
    """``quantization.graph``: what quantization did to the graph.

    Attributes:
        matmuls: MatMuls quantized.
        embedding: ``shared with the LM head`` or ``own table``.
        bytes_before: float32 weight bytes.
        bytes_after: bytes of the quantized files.
        attention_rows: attentions computed by the lade kernels' ``AttentionRows`` (int8
            compute), None otherwise.
        kv_cache_dtype: ``float16`` where the graph keeps its KV cache in float16
            (:func:`lade_export.export.attention_rows.half_precision_cache`), None for float32.
        rotary_attention_rows: layers whose attention, from the fused query/key/value projection
            to the output projection's input, is one ``RotaryAttentionRows`` of the lade kernels
            (:func:`lade_export.export.attention_rows.fuse_rotary_attention`; int8-compute builds
            made since the operator exists), None where the graph has none (earlier builds: an
            ``AttentionRowsHalfCache`` per layer among the graph's own nodes).
        matmul_row_work: ``{"rms_norm", "swiglu", "residual"}`` → nodes folded into ``MatMulBlockQ``
            (:func:`lade_export.export.row_fusion.fuse_row_work`; int8-compute builds since that
            fusion exists), None where nothing was folded.
        argmax_rows: the tokens' ``ArgMax`` nodes computed by the lade kernels' ``ArgMaxRows``
            (:func:`lade_export.export.quantized_ops.lade_argmax`; lade builds since that operator
            exists: the same indices), None where the graph keeps ONNX Runtime's ``ArgMax``.
        extra: keys this version does not know, kept.
    """

    AT = "quantization.graph"
    matmuls: int | None = None
    embedding: str | None = None
    bytes_before: int | None = None
    bytes_after: int | None = None
    attention_rows: int | None = None
    kv_cache_dtype: str | None = None
    rotary_attention_rows: int | None = None
    matmul_row_work: Mapping | None = None
    argmax_rows: int | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)


@dataclasses.dataclass(frozen=True)
class Quality(_Section):
    """``quantization.quality``: the quantized graph against the float32 one, teacher-forced
    on the float32 engine's greedy answers.

    Attributes:
        sequences: answers compared.
        positions: answer tokens compared.
        top1_agreement: fraction of positions with the same argmax (0–1).
        max_abs_logit_diff: largest |Δlogit| over those positions.
        prompts: what the answers answered, in words (the first MT-Bench questions, or the
            build's parity prompt when the datasets were not at hand); absent on builds made
            before it was recorded.
        extra: keys this version does not know, kept.
    """

    AT = "quantization.quality"
    sequences: int | None = None
    positions: int | None = None
    top1_agreement: float | None = None
    max_abs_logit_diff: float | None = None
    prompts: str | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)


@dataclasses.dataclass(frozen=True)
class Kernels(_Section):
    """``quantization.kernels``: the lade kernels' library (lade builds).

    Attributes:
        library: the ``custom_ops`` file, relative to the artifact.
        compute: ``float32`` or ``int8``.
        paths: per compute type, the code paths the library holds (best first).
        path_at_build: the path the quality was measured on.
        extra: keys this version does not know, kept.
    """

    AT = "quantization.kernels"
    library: str | None = None
    compute: str | None = None
    paths: Mapping | None = None
    path_at_build: str | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        paths = data.get("paths")
        if paths is not None and r.mapping(paths, f"{at}.paths") is None:
            return None
        return cls(library=data.get("library"), compute=data.get("compute"),
                   paths=None if paths is None else MappingProxyType({c: tuple(p) for c, p in paths.items()}),
                   path_at_build=data.get("path_at_build"), extra=_extra(cls, data))

    def to_dict(self) -> dict:
        paths = None if self.paths is None else {c: list(p) for c, p in self.paths.items()}
        return {**_present(library=self.library, compute=self.compute, paths=paths,
                           path_at_build=self.path_at_build), **self.extra}


@dataclasses.dataclass(frozen=True)
class Quantization(_Section):
    """``quantization`` (int4/int8 builds): the spec, what it did to the graph, its quality
    and (lade builds) the kernels' library.

    Attributes:
        spec: :class:`QuantizationSpec`.
        graph: :class:`QuantizedGraph`.
        quality: :class:`Quality`.
        kernels: :class:`Kernels`, or None (``onnxruntime`` kernels, earlier lade builds).
        extra: keys this version does not know, kept.
    """

    AT = "quantization"
    spec: QuantizationSpec = QuantizationSpec()
    graph: QuantizedGraph = QuantizedGraph()
    quality: Quality = Quality()
    kernels: Kernels | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        parts = {}
        for name, part in (("spec", QuantizationSpec), ("graph", QuantizedGraph), ("quality", Quality),
                           ("kernels", Kernels)):
            if data.get(name) is None:
                continue
            where = f"{at}.{name}"
            parts[name] = part._read(r, data[name], where) if r.mapping(data[name], where) is not None else None
            if parts[name] is None:
                return None
        return cls(**parts, extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "graph": self.graph.to_dict(), "quality": self.quality.to_dict(),
                **({"kernels": self.kernels.to_dict()} if self.kernels is not None else {}), **self.extra}


@dataclasses.dataclass(frozen=True)
class FileEntry(_Section):
    """One ``files`` entry: a file of the artifact (docs/manifest.md, *Integrity*).

    Attributes:
        sha256: hex sha256 of the file.
        bytes: its size, bytes.
        extra: keys this version does not know, kept.
    """

    AT = "files[]"
    sha256: str
    bytes: int
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def _read(cls, r, data, at):
        sha256, size = r.need(data, "sha256", at, "string"), r.need(data, "bytes", at, "integer")
        return None if None in (sha256, size) else cls(sha256=sha256, bytes=size, extra=_extra(cls, data))

    def to_dict(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.bytes, **self.extra}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """An artifact's ``manifest.json`` (schema_version 2, docs/manifest.md), typed.

    Attributes:
        source: :class:`Source`.
        model: :class:`ModelInfo`.
        graph: :class:`GraphInfo`.
        tokenizer: :class:`TokenizerInfo`.
        files: every file of the artifact, relative path → :class:`FileEntry`.
        schema_version: :data:`SCHEMA_VERSION`.
        created: UTC build time, ISO 8601.
        versions: versions of the libraries the build used (``lade_export``, ``python``,
            ``torch``, ``transformers``, ``onnx``, ``onnxruntime``).
        default_profile: the name of the profile a request gets when it names none, or None.
        profiles: the lookahead profiles built (:class:`lade_export.profile.LookaheadProfile`).
        parity: :class:`Parity`, or None when not recorded.
        timings_s: build stage times in seconds (``load``, ``export``, ``parity``,
            ``transformers_parity``).
        engines: TensorRT engines (:class:`EngineEntry`), empty without ``--engine tensorrt``.
        quantization: :class:`Quantization` (int4/int8 builds), else None.
        extra: top-level keys this version does not know, kept.
    """

    source: Source
    model: ModelInfo
    graph: GraphInfo
    tokenizer: TokenizerInfo
    files: Mapping
    schema_version: int = SCHEMA_VERSION
    created: str | None = None
    versions: Mapping | None = None
    default_profile: str | None = None
    profiles: tuple = ()
    parity: Parity | None = None
    timings_s: Mapping | None = None
    engines: tuple = ()
    quantization: Quantization | None = None
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    @classmethod
    def from_dict(cls, data, where=None) -> "Manifest":
        """Read and check a parsed ``manifest.json``.

        Args:
            data: the JSON object.
            where: what the messages start with (the manifest's path), or None.

        Raises:
            ArtifactError: one line, starting with ``where``: not a JSON object; a
                ``schema_version`` other than :data:`SCHEMA_VERSION`; a section of
                :data:`REQUIRED_SECTIONS` missing (``manifest lacks model; rebuild with
                lade-export build``); a required key missing or a value of the wrong kind
                (``manifest lacks graph.file, …``, :data:`REQUIRED_KEYS`, the fields of
                ``ModelDims``, ``profiles (a list)``); a ``model.dims`` size that is not a
                positive integer or a ``tied_embeddings`` that is not a bool; a profile the
                runtime refuses.
        """
        prefix = f"{where}: " if where else ""
        if not isinstance(data, dict):
            raise ArtifactError(f"{prefix}not a lade-export manifest (expected a JSON object)")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(
                f"{prefix}schema_version {version!r} is not supported by this lade-export (expects {SCHEMA_VERSION}); "
                "rebuild with lade-export build"
            )
        missing = [k for k in REQUIRED_SECTIONS if not isinstance(data.get(k), dict)]
        if missing:
            raise ArtifactError(f"{prefix}manifest lacks {', '.join(missing)}; rebuild with lade-export build")
        r = _Reader()
        graph = GraphInfo._read(r, data["graph"], "graph")
        model = ModelInfo._read(r, data["model"], "model")
        entries = r.array(data.get("profiles", []), "profiles")
        profiles = [r.profile(p, f"profiles[{i}]") for i, p in enumerate(entries or [])]
        tokenizer = TokenizerInfo._read(r, data["tokenizer"], "tokenizer")
        source = Source._read(r, data["source"], "source")
        optional = {}
        for name, section in (("parity", Parity), ("quantization", Quantization)):
            if data.get(name) is not None and r.mapping(data[name], name) is not None:
                optional[name] = section._read(r, data[name], name)
        engines = [EngineEntry._read(r, e, f"engines[{i}]") if r.mapping(e, f"engines[{i}]") is not None else None
                   for i, e in enumerate(r.array(data.get("engines", []), "engines") or [])]
        files = {name: FileEntry._read(r, e, f"files.{name}") if r.mapping(e, f"files.{name}") is not None else None
                 for name, e in data["files"].items()}
        r.raise_if_any(where)
        return cls(source=source, model=model, graph=graph, tokenizer=tokenizer, files=MappingProxyType(files),
                   schema_version=version, created=data.get("created"), versions=data.get("versions"),
                   default_profile=data.get("default_profile"), profiles=tuple(profiles),
                   timings_s=data.get("timings_s"), engines=tuple(engines), **optional, extra=_extra(cls, data))

    def to_dict(self) -> dict:
        """The JSON object of ``manifest.json`` (what the build writes; see the module doc)."""
        return {"schema_version": self.schema_version, **_present(created=self.created, versions=self.versions),
                "source": self.source.to_dict(), "model": self.model.to_dict(), "graph": self.graph.to_dict(),
                "tokenizer": self.tokenizer.to_dict(), "default_profile": self.default_profile,
                "profiles": [p.as_dict() for p in self.profiles],
                **({"parity": self.parity.to_dict()} if self.parity is not None else {}),
                **_present(timings_s=self.timings_s), "engines": [e.to_dict() for e in self.engines],
                **({"quantization": self.quantization.to_dict()} if self.quantization is not None else {}),
                "files": {name: e.to_dict() for name, e in self.files.items()}, **self.extra}

    @property
    def kernel_compute(self) -> str:
        """What the lade kernels compute in (``quantization.spec.compute``; ``float32`` when
        the build did not record it)."""
        spec = self.quantization.spec if self.quantization is not None else None
        return (spec.compute if spec is not None else None) or LADE_DEFAULT_COMPUTE
