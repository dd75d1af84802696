"""A build's options and the checks that they go together (``lade-export build`` flags).

:class:`BuildOptions` holds what ``build`` is told about the engine, the weights' precision,
the quantization, the attention formulation and the TensorRT engines' bounds.
:meth:`BuildOptions.check` refuses combinations that cannot be built — an ONNX Runtime
build in float16, TensorRT with MatMulNBits weights or this project's custom operators,
quantization flags on a float32 build, lookahead profiles on an engine that is not exact
for them — each in one line naming the flags, raising
:class:`~lade_export.errors.BuildOptionError`. :func:`lade_export.export.build.build_artifact`
runs it before anything is written, and the CLI runs the same checks before its own work
(toolchain, dry run), so API callers and the command line get the same messages.

:meth:`BuildOptions.attention_for` does the checks that need the loaded model (head width
for ``group-query-attention``, the model's hidden size for ``--block-size``).

No torch here: the checks run before anything heavy is imported or loaded.
"""

from __future__ import annotations

import dataclasses

from ..errors import BuildOptionError, ProfileError
from .quantize import ORT_PRECISIONS, QuantSpec

#: ``--engine``: the ONNX graph for ONNX Runtime, or also TensorRT engines.
ENGINES = ("onnx", "tensorrt")
#: ``--precision`` values: ONNX Runtime takes fp32, int8, int4; TensorRT fp16, bf16, fp32.
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
#: ``--attention`` values (``auto``: :func:`choose_attention` decides).
ATTENTION = ("auto", "onnx-ops", "group-query-attention")
#: Precisions TensorRT engines are built in.
TENSORRT_PRECISIONS = ("fp16", "bf16", "fp32")

#: The shipped profile an artifact gets by default, per weight precision: the step-cost
#: curve differs (an int4 step grows with its width much faster than a float32 one), so
#: each precision has its own (measured on CPUs; bench/results/README.md).
DEFAULT_PROFILES = {"fp32": "default", "fp16": "default", "bf16": "default", "int8": "greedy-only",
                    "int4": "default-int4"}


def default_profile_for(precision: str, kernels: str = "onnxruntime") -> str:
    """Name of the shipped profile a build records as its default for ``precision``: with
    the lade kernels (exact lookahead at 8 bits too) int8 gets int4's."""
    if kernels == "lade" and precision in ("int8", "int4"):
        return DEFAULT_PROFILES["int4"]
    return DEFAULT_PROFILES.get(precision, "default")


def refuse_fused_attention_on_tensorrt(requested: str, tensorrt: bool) -> None:
    """Raise before any work when a TensorRT build asks for ``group-query-attention``.

    Raises:
        BuildOptionError: ``requested`` is ``group-query-attention`` and ``tensorrt`` is set.
    """
    if requested == "group-query-attention" and tensorrt:
        raise BuildOptionError("--attention group-query-attention is an ONNX Runtime contrib op that TensorRT cannot "
                               "parse; --engine tensorrt takes --attention onnx-ops")


def refuse_fused_attention_on_rows_exact(requested: str) -> None:
    """Raise before any work when an int8-compute lade build asks for ``group-query-attention``.

    Raises:
        BuildOptionError: ``requested`` is ``group-query-attention``.
    """
    if requested == "group-query-attention":
        raise BuildOptionError("--compute int8 computes attention with the lade kernels (each row over the keys it "
                               "sees, for exact lookahead), on the onnx-ops graph: drop --attention "
                               "group-query-attention")


def choose_attention(requested: str, dims, tensorrt: bool = False, rows_exact: bool = False) -> str:
    """The attention formulation of a build (``--attention``).

    ``auto`` picks ``group-query-attention`` — ONNX Runtime's fused RoPE + attention op
    (``com.microsoft.GroupQueryAttention``) over a shared head-major cache buffer, which
    removes the per-layer attention operators and the per-step transposes of the cache —
    for ONNX Runtime builds whose head width it accepts (a multiple of 16), else
    ``onnx-ops`` (standard operators, sequence-major cache; what TensorRT parses).

    ``rows_exact`` (int8-compute lade builds, whose attention becomes the kernels'
    ``AttentionRows``, :func:`lade_export.export.quantize.exact_attention`) takes ``onnx-ops``.

    Args:
        requested: ``auto``, ``onnx-ops`` or ``group-query-attention``.
        dims: the model's :class:`lade_export.specs.ModelDims` (``head_dim`` is read).

    Raises:
        BuildOptionError: ``group-query-attention`` asked for a TensorRT build, for
            ``rows_exact`` or for a head width of the model that ONNX Runtime's kernel refuses;
            an unknown value.
    """
    fits = dims.head_dim % 16 == 0
    if rows_exact:
        refuse_fused_attention_on_rows_exact(requested)
    if requested == "auto":
        return "group-query-attention" if fits and not tensorrt and not rows_exact else "onnx-ops"
    kinds = ATTENTION[1:]
    if requested not in kinds:
        raise BuildOptionError(f"--attention must be auto, {' or '.join(kinds)}, got {requested!r}")
    refuse_fused_attention_on_tensorrt(requested, tensorrt)
    if requested == "group-query-attention" and not fits:
        raise BuildOptionError(f"--attention group-query-attention needs a head width that is a multiple of 16 (ONNX "
                               f"Runtime's kernel); this model's is {dims.head_dim}: use --attention onnx-ops")
    return requested


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What a build is asked to make, as ``lade-export build``'s flags say it.

    Attributes:
        engine: ``onnx`` (the graph for ONNX Runtime) or ``tensorrt`` (also one TensorRT
            engine per lookahead profile).
        precision: the weights' format, one of :data:`PRECISIONS`; None: ``fp32`` for
            ONNX Runtime, ``fp16`` for TensorRT (:attr:`weights`).
        block_size, accuracy_level, head_bits, kernels, compute: the quantization of an
            int8/int4 ONNX Runtime build
            (:meth:`lade_export.export.quantize.QuantSpec.for_precision`); None (and
            ``kernels="onnxruntime"``): its defaults. ``head_bits`` 0 is float32 and allowed
            on any build.
        attention: one of :data:`ATTENTION` (:func:`choose_attention`).
        max_batch, max_prompt, max_context, version_compatible, hardware_compatible: the
            TensorRT engines' bounds and flags
            (:func:`lade_export.export.optimization_profiles.engine_plans`); max_prompt and
            max_context in tokens, None for their defaults.
    """

    engine: str = "onnx"
    precision: str | None = None
    block_size: int | None = None
    accuracy_level: int | None = None
    head_bits: int | None = None
    kernels: str = "onnxruntime"
    compute: str | None = None
    attention: str = "auto"
    max_batch: int = 1
    max_prompt: int | None = None
    max_context: int | None = None
    version_compatible: bool = False
    hardware_compatible: bool = False

    @classmethod
    def from_parts(cls, quantization: QuantSpec | None = None, engine_options: dict | None = None,
                   attention: str = "auto") -> "BuildOptions":
        """The options :func:`lade_export.export.build.build_artifact`'s older keywords
        describe: a :class:`~lade_export.export.quantize.QuantSpec`, the TensorRT
        ``engine_options`` dict (keywords of ``engine_plans``) and ``attention``."""
        fields = {"attention": attention}
        if engine_options is not None:
            fields.update(engine="tensorrt", **engine_options)
        if quantization is not None:
            q = quantization
            lade = q.kernels == "lade"
            fields.update(precision=f"int{q.bits}", block_size=q.block_size,
                          accuracy_level=None if lade else q.accuracy_level, head_bits=q.head_bits,
                          kernels=q.kernels, compute=q.compute if lade else None)
        return cls(**fields)

    @property
    def tensorrt(self) -> bool:
        """Whether TensorRT engines are built."""
        return self.engine == "tensorrt"

    @property
    def weights(self) -> str:
        """The weights' precision, with the engine's default filled in."""
        return self.precision or ("fp16" if self.tensorrt else "fp32")

    @property
    def quantized(self) -> bool:
        """Whether this is a weight-only quantized (int8/int4) ONNX Runtime build."""
        return not self.tensorrt and bool(ORT_PRECISIONS.get(self.weights))

    @property
    def quantization(self) -> QuantSpec | None:
        """The quantization of an int8/int4 ONNX Runtime build, None for other builds.

        Raises:
            BuildOptionError: the quantization flags do not go together (``QuantSpec``'s own
                one-line message).
        """
        if not self.quantized:
            return None
        try:
            return QuantSpec.for_precision(self.weights, self.block_size, self.accuracy_level,
                                           None if self.head_bits is None else int(self.head_bits), self.kernels,
                                           self.compute)
        except ProfileError as err:  # QuantSpec's message, under the build's own error type
            raise BuildOptionError(str(err)) from None

    @property
    def rows_exact(self) -> bool:
        """Whether the attention is the lade kernels' ``AttentionRows`` (int8 compute)."""
        q = self.quantization
        return q is not None and q.kernels == "lade" and q.compute == "int8"

    @property
    def engine_options(self) -> dict | None:
        """Keyword arguments of ``engine_plans`` for a TensorRT build, None for ONNX Runtime."""
        if not self.tensorrt:
            return None
        return dict(precision=self.weights, max_batch=self.max_batch, max_prompt=self.max_prompt,
                    max_context=self.max_context, version_compatible=self.version_compatible,
                    hardware_compatible=self.hardware_compatible)

    @property
    def default_profile(self) -> str:
        """The shipped profile recorded as the default when none is given (:func:`default_profile_for`)."""
        return default_profile_for(self.weights, self.kernels)

    def check(self, profiles=None) -> None:
        """Refuse options that cannot be built together, before any work.

        Args:
            profiles: the build's :class:`lade_export.profile.LookaheadProfile` list; when
                given, an engine that is not exact for lookahead (int8 activations) is refused
                for any lookahead (enabled) profile.

        Raises:
            BuildOptionError: the first combination that does not go together, in one line
                naming the flags (docs/errors.md, ``build-*`` rows).
        """
        if self.engine not in ENGINES:
            raise BuildOptionError(f"--engine must be {' or '.join(ENGINES)}, got {self.engine!r}")
        if self.weights not in PRECISIONS:
            raise BuildOptionError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.weights!r}")
        precision = self.weights
        if not self.tensorrt and precision not in ORT_PRECISIONS:
            raise BuildOptionError(f"--precision {precision} is a TensorRT (or torch backend) precision; ONNX Runtime "
                                   "engines take fp32, int8 or int4")
        if self.tensorrt and self.kernels == "lade":
            raise BuildOptionError("--kernels lade makes ONNX Runtime custom operators, which TensorRT cannot parse; "
                                   "--engine tensorrt takes fp16, bf16 or fp32")
        if self.tensorrt and precision not in TENSORRT_PRECISIONS:
            raise BuildOptionError(f"--precision {precision} makes MatMulNBits weights, which TensorRT cannot parse; "
                                   "--engine tensorrt takes fp16, bf16 or fp32")
        refuse_fused_attention_on_tensorrt(self.attention, self.tensorrt)
        self._check_engine_bounds()
        for option, value in (("--block-size", self.block_size), ("--accuracy-level", self.accuracy_level),
                              ("--kernels", None if self.kernels == "onnxruntime" else self.kernels),
                              ("--compute", self.compute)):
            if value is not None and not self.quantized:
                raise BuildOptionError(f"{option} applies to int8/int4 ONNX Runtime builds (--precision int8 or "
                                       f"int4); this build is {precision}")
        if self.head_bits is not None and int(self.head_bits) and not self.quantized:
            raise BuildOptionError(f"--head-bits {self.head_bits} quantizes the head of an int8/int4 ONNX Runtime "
                                   "build; give --precision int8 or int4")
        quantization = self.quantization
        if self.rows_exact:
            refuse_fused_attention_on_rows_exact(self.attention)
        if profiles is not None and quantization is not None and not quantization.lookahead_exact \
                and any(p.enabled for p in profiles):
            raise BuildOptionError(f"--precision {precision} with accuracy level {quantization.accuracy_level} computes "
                                   "one-token and multi-token steps differently (int8 activations), so lookahead would "
                                   "not be exact; give --profile greedy-only, or build int4 (float32 compute)")

    def check_timing_cache(self, timing_cache) -> None:
        """Refuse a TensorRT timing cache (``--timing-cache``) for a build without TensorRT.

        Raises:
            BuildOptionError: ``timing_cache`` given and this is not a TensorRT build.
        """
        if timing_cache is not None and not self.tensorrt:
            raise BuildOptionError("--timing-cache is TensorRT's builder cache; this build is for ONNX Runtime only: "
                                   "add --engine tensorrt or drop it")

    def _check_engine_bounds(self) -> None:
        """The TensorRT engines' bounds: given only for a TensorRT build, each ≥ 1.

        Raises:
            BuildOptionError: a TensorRT flag on an ONNX Runtime build, or a bound < 1.
        """
        given = [flag for flag, on in (("--max-batch", self.max_batch != 1), ("--max-prompt", self.max_prompt is not None),
                                       ("--max-context", self.max_context is not None),
                                       ("--version-compatible", self.version_compatible),
                                       ("--hardware-compatible", self.hardware_compatible)) if on]
        if given and not self.tensorrt:
            raise BuildOptionError(f"{given[0]} bounds the TensorRT engines; this build is for ONNX Runtime only: "
                                   "add --engine tensorrt or drop it")
        for flag, value, least in (("--max-batch", self.max_batch, 1), ("--max-prompt", self.max_prompt, 1),
                                   ("--max-context", self.max_context, 2)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise BuildOptionError(f"{flag} must be an integer ≥ {least}, got {value!r}")
        if self.max_prompt is not None and self.max_context is not None and self.max_prompt >= self.max_context:
            raise BuildOptionError(f"--max-prompt {self.max_prompt} must be below --max-context {self.max_context} "
                                   "(a prompt leaves room for new tokens)")

    def attention_for(self, dims) -> str:
        """The checks that need the loaded model; returns the attention formulation the
        build exports (:func:`choose_attention`).

        Args:
            dims: the model's :class:`lade_export.specs.ModelDims`.

        Raises:
            BuildOptionError: ``--block-size`` does not divide the model's hidden size, the
                model's head width does not take ``group-query-attention``, or a TensorRT
                bound (``--max-context``, ``--max-prompt``) exceeds the model's context.
        """
        if self.max_context is not None and self.max_context > dims.max_context:
            raise BuildOptionError(f"--max-context {self.max_context} exceeds the model's context of "
                                   f"{dims.max_context} tokens")
        if self.max_prompt is not None and self.max_prompt >= (self.max_context or dims.max_context):
            raise BuildOptionError(f"--max-prompt {self.max_prompt} must be below the engines' context of "
                                   f"{self.max_context or dims.max_context} tokens")
        attention = choose_attention(self.attention, dims, tensorrt=self.tensorrt, rows_exact=self.rows_exact)
        quantization = self.quantization
        if quantization is not None and dims.hidden % quantization.block_size:
            raise BuildOptionError(f"--block-size {quantization.block_size} does not divide the model's hidden size "
                                   f"{dims.hidden}; give a power of two ≥ 16 that does (e.g. 32)")
        return attention

    def prepare_kernels(self, fetch: bool = True) -> tuple[bool, list[str]]:
        """For ``--kernels lade``: check, before any work, that the kernel library can be
        compiled (:func:`lade_export.kernels.require_toolchain`; the headers are downloaded
        now when missing and ``fetch``), and say when this CPU runs the kernels' slow
        portable path. Other builds: nothing to do.

        Returns:
            whether the headers are at hand (False only when ``fetch`` is false and they
            would be downloaded by the build), and notes for the user (one line each).

        Raises:
            BackendUnavailableError: no compiler, or the headers cannot be had.
        """
        if self.kernels != "lade" or not self.quantized:
            return True, []
        from ..kernels import cpu_has_avx2, cpu_has_avx512, require_toolchain

        headers_at_hand = require_toolchain(fetch=fetch)
        compute = self.quantization.compute
        notes = []
        if compute == "float32" and cpu_has_avx512() is False:
            notes.append("this CPU lacks AVX-512 (avx512f/bw/vl/dq); the float32-compute lade kernels take their "
                         "portable path here, about 12x slower than on an AVX-512 CPU: --compute int8 (AVX2) is "
                         "faster on it")
        elif compute == "int8" and cpu_has_avx2() is False:
            notes.append("this CPU lacks AVX2 (avx2/fma/f16c); the lade kernels take their portable path here, many "
                         "times slower: --kernels onnxruntime is faster on it")
        return headers_at_hand, notes
