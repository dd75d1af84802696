"""Rotary position embedding (RoPE) variants of LLaMA-family configurations: which ones
the exported step graph reproduces exactly, over which declared context, and which ones
the export refuses.

The step graph (:class:`lade_export.graph.DecoderStep`) computes ``cos``/``sin`` from one
fixed vector of inverse frequencies and one attention scale, taken from transformers'
rotary module as it is initialised. That is exact for every variant whose frequencies do
not depend on the positions of the call (RoPE, Su et al. 2021, arXiv 2104.09864):

* ``default``; ``linear`` (position interpolation, Chen et al. 2023, arXiv 2306.15595);
  ``yarn`` (Peng et al. 2023, arXiv 2309.00071); ``llama3`` (Llama 3.1's band-wise
  scaling); ``proportional`` (partial rotation with zero frequencies) — static.

Two variants change their frequencies with the call (transformers
``modeling_rope_utils.dynamic_rope_update``):

* ``longrope`` (Ding et al. 2024, arXiv 2402.13753): each forward call uses
  ``short_factor`` while its largest position + 1 is at most
  ``original_max_position_embeddings`` and ``long_factor`` for *every* position of a call
  that goes past it. The result depends on how the sequence is split into calls, and a
  lookahead step's speculative positions would decide the choice for the real tokens
  fed with them. The artifact therefore declares a context of
  ``original_max_position_embeddings`` tokens (where transformers always uses the short
  factors) — unless the two factor lists are equal, when nothing switches.
* ``dynamic`` (dynamic NTK scaling): transformers keeps the unscaled frequencies until a
  call reaches past ``max_position_embeddings``, then rescales them by that call's length
  and keeps the result for later calls. The artifact declares ``max_position_embeddings``
  tokens, where the frequencies are the unscaled ones.

Refused: a rope type transformers' LLaMA has no implementation for here, and
``partial_rotary_factor`` < 1 with a type whose frequency vector then no longer covers
the head (transformers' own LLaMA fails on it).

Runs without PyTorch: it reads only the configuration object.
"""

from __future__ import annotations

import dataclasses

from ..errors import ModelSourceError

#: Rope types whose inverse frequencies do not depend on the call (exact at every position).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
#: Rope types whose frequencies transformers switches or rescales per call.
POSITION_DEPENDENT_ROPE_TYPES = ("longrope", "dynamic")
SUPPORTED_ROPE_TYPES = STATIC_ROPE_TYPES + POSITION_DEPENDENT_ROPE_TYPES
#: Types whose frequency vector covers the whole head even with ``partial_rotary_factor`` < 1.
_WHOLE_HEAD_TYPES = ("default", "proportional")


@dataclasses.dataclass(frozen=True)
class RopePlan:
    """How the export handles a configuration's rotary embedding.

    Attributes:
        rope_type: transformers' ``rope_type`` (``default`` when the config has none).
        max_position_embeddings: the configuration's context, tokens.
        declared_context: the context the artifact declares (``model.dims.max_context``),
            tokens; every position below it is exact against transformers.
        handling: ``exact`` (the configuration's whole context is exact) or ``capped``
            (``declared_context`` stops where transformers' frequencies start to depend on
            the call).
        thresholds: sequence lengths (tokens) where transformers' rope behaviour changes
            or the configuration draws a line (``original_max_position_embeddings``); the
            build's transformers parity check runs prompts on both sides of those below
            ``declared_context``.
        reason: one sentence for the user when ``handling`` is ``capped``, else ``""``.
    """

    rope_type: str
    max_position_embeddings: int
    declared_context: int
    handling: str
    thresholds: tuple
    reason: str = ""

    @property
    def position_dependent(self) -> bool:
        """Whether transformers changes this type's frequencies per call."""
        return self.rope_type in POSITION_DEPENDENT_ROPE_TYPES

    def as_dict(self) -> dict:
        """The manifest's ``model.rope`` section (see docs/manifest.md)."""
        return {"type": self.rope_type, "position_dependent": self.position_dependent, "handling": self.handling,
                "max_position_embeddings": self.max_position_embeddings, "declared_context": self.declared_context,
                "thresholds": list(self.thresholds), "reason": self.reason}


def rope_parameters(config) -> dict:
    """The configuration's rope parameters as one flat dict with ``rope_type``.

    Reads transformers 5's ``rope_parameters`` and falls back to the older
    ``rope_scaling`` (with ``type`` or ``rope_type``) and ``rope_theta`` attributes.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type") or "default")
    return params


def _number_list(values) -> list:
    return [float(v) for v in values] if isinstance(values, (list, tuple)) else []


def plan_rope(config) -> RopePlan:
    """Decide the declared context for ``config``'s rotary embedding (see module doc).

    Args:
        config: a transformers ``LlamaConfig`` (or an object with its attributes).

    Raises:
        ModelSourceError: an unsupported rope type, or ``partial_rotary_factor`` < 1 with
            a type that transformers' LLaMA cannot run that way; one line naming the type
            and what to do.
    """
    params = rope_parameters(config)
    rope_type = str(params["rope_type"])
    mpe = int(config.max_position_embeddings)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelSourceError(
            f"rope type {rope_type!r} is not supported by the export; it handles "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (set rope_parameters.rope_type to one of them)")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) < 1.0 and rope_type not in _WHOLE_HEAD_TYPES:
        raise ModelSourceError(
            f"rope type {rope_type!r} with partial_rotary_factor {partial}: transformers' LLaMA rotates the whole head "
            "and cannot run this configuration, so there is no reference to export against (remove "
            "partial_rotary_factor or use rope type 'proportional')")
    omp = params.get("original_max_position_embeddings")
    omp = int(omp) if omp else None
    if rope_type == "dynamic":
        return RopePlan(rope_type, mpe, mpe, "capped", (mpe,), (
            f"rope type 'dynamic': transformers rescales the frequencies (dynamic NTK) only once a call goes past "
            f"max_position_embeddings ({mpe}), by that call's length and what earlier calls saw, which lookahead's "
            f"speculative positions would decide; the artifact declares {mpe} tokens of context, where the "
            f"frequencies are unscaled and exact (use a static rope type such as 'yarn' or 'linear' for a longer "
            f"context)"))
    if rope_type == "longrope":
        if omp is None:
            raise ModelSourceError("rope type 'longrope' without original_max_position_embeddings: transformers cannot "
                                   "tell short from long context; add it to rope_parameters")
        short, long = _number_list(params.get("short_factor")), _number_list(params.get("long_factor"))
        if short == long or omp >= mpe:
            return RopePlan(rope_type, mpe, mpe, "exact", (omp,) if omp < mpe else ())
        return RopePlan(rope_type, mpe, omp, "capped", (omp,), (
            f"rope type 'longrope': transformers uses long_factor for every position of a call that reaches past "
            f"original_max_position_embeddings ({omp}) and short_factor otherwise, so the result depends on how the "
            f"sequence is split into calls and lookahead's speculative positions would pick the factors; the "
            f"artifact declares {omp} tokens of context instead of {mpe} (longer prompts are refused; to serve "
            f"{mpe} tokens with the long factors at every length, set short_factor equal to long_factor in "
            f"config.json)"))
    thresholds = (omp,) if rope_type in ("yarn", "llama3") and omp and omp < mpe else ()
    return RopePlan(rope_type, mpe, mpe, "exact", thresholds)


#: Longest prompt the build's transformers parity check runs (keeps builds of long-context models short).
REFERENCE_MAX_TOKENS = 1024
#: The modest extra length checked when the configuration has no threshold below it.
REFERENCE_PLAIN_TOKENS = 128


def reference_lengths(plan: RopePlan, base_tokens: int, limit: int = REFERENCE_MAX_TOKENS) -> list[int]:
    """Sequence lengths (tokens) at which the build compares the graph with transformers.

    Each length ``L`` is one transformers call on ``L`` tokens, against the graph's
    prefill of them and its decode step at position ``L − 1``
    (:func:`lade_export.export.parity.check_against_transformers`). The set holds
    ``base_tokens`` (the parity prompt), ``t − 1``, ``t`` and ``t + 1`` for every
    threshold ``t`` (calls and decode steps on both sides of it), the whole declared
    context when it is at most ``limit`` tokens, and :data:`REFERENCE_PLAIN_TOKENS`
    otherwise. Lengths above ``limit`` are left out.

    Returns:
        sorted distinct lengths, each in ``2 … min(declared_context, limit)``.
    """
    top = min(plan.declared_context, limit)
    wanted = {base_tokens}
    for t in plan.thresholds:
        wanted.update((t - 1, t, t + 1))
    wanted.add(plan.declared_context if plan.declared_context <= limit else REFERENCE_PLAIN_TOKENS)
    return sorted(n for n in wanted if 2 <= n <= top)
