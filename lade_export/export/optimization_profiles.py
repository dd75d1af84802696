"""TensorRT optimization-profile shapes derived from a lookahead profile.

TensorRT needs, for every dynamic input, a (min, opt, max) shape per optimization
profile (TensorRT developer guide, "Working with Dynamic Shapes"). One engine serves a
lookahead profile (W, N, G) with three optimization profiles:

* ``prefill`` — the prompt in one pass: step 1..max_prompt (opt max_prompt), past 0
  (the runtime prefills an empty cache), logits for 1..max_prompt rows (opt 1: the
  runtime reads none during prefill but the graph needs one row);
* ``decode`` — greedy and lookahead steps: step 1..S with S = 1 + (W + G)·(N − 1)
  (opt S), past 0..max_context − 1 (opt max_context / 2), logits rows
  1..1 + W + G·(N − 1) (opt that maximum);
* ``packed`` — the continuous-batching scheduler's passes (:mod:`lade_export.packed`):
  batch 1, step 1..R rows of several requests (R = ``packed_rows``, default the largest
  of the scheduler's token budget, its prefill chunk and S; opt the token budget), past
  0..T − 1 columns of the shared token pool (T = ``packed_tokens``, default the
  scheduler's pool, ``MAX_BATCH × max_context``; opt min((T − 1) / 2, 2 × max_context):
  four requests at half the context),
  logits for 1..R rows (opt the token budget). Engines built before this optimization
  profile existed have only the first two and decode unbatched.

The key length ``past+step`` of the mask follows from the two. Batch is
1..max_batch with opt 1 in the first two (the runtime decodes one sequence). Shapes are
derived from the single tensor declaration in :mod:`lade_export.specs`. TensorRT sizes an
execution context's activation memory for the largest shapes of its optimization
profile, so the packed optimization profile's bounds (attention scores of R rows over
T + R keys per layer) are what batching costs in device memory; give smaller
``packed_rows``/``packed_tokens`` to spend less.

Here "profile" alone is always a lookahead profile
(:class:`lade_export.profile.LookaheadProfile`); TensorRT's are "optimization profiles",
named by their phase (``prefill``, ``decode``, ``packed``), in their index order in an
engine.
"""

from __future__ import annotations

import dataclasses

from ..errors import ProfileError
from ..profile import LookaheadProfile
from ..specs import step_io_specs


@dataclasses.dataclass(frozen=True)
class AxisRange:
    """(min, opt, max) of one symbolic axis, in elements."""

    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not 0 <= self.min <= self.opt <= self.max:
            raise ProfileError(f"invalid axis range min={self.min} opt={self.opt} max={self.max}")


def packed_defaults(profile: LookaheadProfile, max_context: int) -> tuple[int, int, int]:
    """``(rows, tokens, opt rows)`` of the ``packed`` optimization profile for the
    scheduler's defaults (:data:`lade_export.scheduler.TOKEN_BUDGET`, ``PREFILL_CHUNK``,
    ``MAX_BATCH``): rows = max(token budget, prefill chunk, the profile's largest step),
    tokens = ``MAX_BATCH × max_context`` (the scheduler's default pool), opt rows = the
    token budget."""
    from ..scheduler import MAX_BATCH, PREFILL_CHUNK, TOKEN_BUDGET

    return max(TOKEN_BUDGET, PREFILL_CHUNK, profile.max_step), MAX_BATCH * max_context, TOKEN_BUDGET


def axis_ranges(profile: LookaheadProfile, max_batch: int, max_prompt: int, max_context: int,
                packed_rows: int | None = None, packed_tokens: int | None = None) -> dict:
    """Symbol ranges for the ``prefill``, ``decode`` and ``packed`` optimization profiles.

    Args:
        profile: the lookahead profile (W, N, G).
        max_batch: largest batch (≥ 1).
        max_prompt: longest prompt prefilled in one pass, tokens (≥ 1, < max_context).
        max_context: the model's context, tokens.
        packed_rows: most rows of a packed pass (≥ the profile's largest step); None: see
            :func:`packed_defaults`.
        packed_tokens: most columns of the scheduler's token pool (≥ 1); None: see
            :func:`packed_defaults`.

    Returns:
        ``{"prefill": {symbol: AxisRange}, "decode": {...}, "packed": {...}}`` for the
        symbols batch, step, past, past+step, n_logits.

    Raises:
        ProfileError: a bound is out of range, or the profile's largest step does not fit
            the context or the packed rows.
    """
    if max_batch < 1:
        raise ProfileError(f"max batch must be ≥ 1, got {max_batch}")
    if not 1 <= max_prompt < max_context:
        raise ProfileError(f"max prompt must be in 1..{max_context - 1} (the context), got {max_prompt}")
    if profile.max_step >= max_context:
        raise ProfileError(
            f"profile {profile.name!r}: its largest step ({profile.max_step} tokens) does not fit the model's context "
            f"of {max_context} tokens"
        )
    batch = AxisRange(1, 1, max_batch)
    prefill = {
        "batch": batch,
        "step": AxisRange(1, max_prompt, max_prompt),
        "past": AxisRange(0, 0, 0),
        "past+step": AxisRange(1, max_prompt, max_prompt),
        "n_logits": AxisRange(1, 1, max_prompt),
    }
    s = profile.max_step
    rows = profile.max_logit_rows
    past_max = max_context - 1
    past_opt = max_context // 2
    decode = {
        "batch": batch,
        "step": AxisRange(1, s, s),
        "past": AxisRange(0, past_opt, past_max),
        "past+step": AxisRange(1, past_opt + s, past_max + s),
        "n_logits": AxisRange(1, rows, rows),
    }
    default_rows, default_tokens, opt_rows = packed_defaults(profile, max_context)
    packed_rows = default_rows if packed_rows is None else packed_rows
    packed_tokens = default_tokens if packed_tokens is None else packed_tokens
    if packed_rows < s:
        raise ProfileError(f"packed rows must be ≥ the profile's largest step ({s} tokens; a step wider than the "
                           f"token budget runs alone), got {packed_rows}")
    if packed_tokens < 1:
        raise ProfileError(f"packed tokens must be ≥ 1, got {packed_tokens}")
    opt_rows = min(opt_rows, packed_rows)
    pool_opt = min((packed_tokens - 1) // 2, 2 * max_context)
    packed = {
        "batch": AxisRange(1, 1, 1),
        "step": AxisRange(1, opt_rows, packed_rows),
        "past": AxisRange(0, pool_opt, packed_tokens - 1),
        "past+step": AxisRange(1, pool_opt + opt_rows, packed_tokens - 1 + packed_rows),
        "n_logits": AxisRange(1, opt_rows, packed_rows),
    }
    return {"prefill": prefill, "decode": decode, "packed": packed}


def optimization_profiles(profile: LookaheadProfile, dims, max_batch: int = 1, max_prompt: int | None = None,
                          max_context: int | None = None, packed_rows: int | None = None,
                          packed_tokens: int | None = None) -> dict:
    """Per-input (min, opt, max) shapes for every dynamic graph input, per optimization
    profile (phase).

    Args:
        profile: the lookahead profile.
        dims: :class:`lade_export.graph.ModelDims` (layers, kv heads, head dim, vocab, context).
        max_batch: largest batch.
        max_prompt: longest prompt (default: half the context).
        max_context: context bound (default: the model's).
        packed_rows, packed_tokens: bounds of the packed optimization profile (see
            :func:`axis_ranges`); ``packed_tokens`` defaults to ``MAX_BATCH ×
            dims.max_context``, the pool the scheduler of ``lade_export.load(...,
            batching=True)`` sizes from the model's context, so its passes fit even when
            ``max_context`` bounds the engines lower.

    Returns:
        ``{"prefill": {input: {"min": [...], "opt": [...], "max": [...]}}, "decode": {...},
        "packed": {...}}`` covering ``input_ids``, ``position_ids``, ``attention_mask``,
        ``logits_positions`` and every ``past_key_values.*`` input, in graph order.
    """
    max_context = max_context or dims.max_context
    max_prompt = max_prompt or max_context // 2
    if packed_tokens is None:  # the scheduler's default pool is sized by the model's context, whatever the engines'
        packed_tokens = packed_defaults(profile, dims.max_context)[1]
    ranges = axis_ranges(profile, max_batch, max_prompt, max_context, packed_rows, packed_tokens)
    inputs, _ = step_io_specs(dims.num_layers, dims.kv_heads, dims.head_dim, dims.vocab)
    result = {}
    for phase, axes in ranges.items():
        shapes = {}
        for spec in inputs:
            shapes[spec.name] = {
                which: [getattr(axes[d], which) if isinstance(d, str) else d for d in spec.shape]
                for which in ("min", "opt", "max")
            }
        result[phase] = shapes
    return result


def engine_plans(profiles, dims, precision: str = "fp16", max_batch: int = 1, max_prompt: int | None = None,
                 max_context: int | None = None, version_compatible: bool = False,
                 hardware_compatible: bool = False, packed_rows: int | None = None,
                 packed_tokens: int | None = None) -> list[dict]:
    """What ``build --engine tensorrt`` builds: one entry per lookahead profile with its
    engine file (``engines/NAME.plan``), precision, flags and optimization profiles
    (prefill, decode, packed; ``packed_rows``/``packed_tokens`` as in :func:`axis_ranges`).

    Raises:
        ProfileError: two profiles share a name, or a bound is invalid (see :func:`axis_ranges`).
    """
    names = [p.name for p in profiles]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ProfileError(f"two profiles are named {dup[0]!r}; engine files are named after profiles")
    plans = []
    for p in profiles:
        plans.append({
            "file": f"engines/{p.name}.plan",
            "profile": p.as_dict(),
            "precision": precision,
            "max_batch": max_batch,
            "max_prompt": max_prompt or (max_context or dims.max_context) // 2,
            "max_context": max_context or dims.max_context,
            "version_compatible": version_compatible,
            "hardware_compatible": hardware_compatible,
            "optimization_profiles": optimization_profiles(p, dims, max_batch, max_prompt, max_context, packed_rows,
                                                           packed_tokens),
        })
    return plans


def describe_plan(plan: dict, num_layers: int) -> list[str]:
    """Human-readable lines for one engine plan: its lookahead profile and bounds, then
    each optimization profile's shapes (the KV inputs folded into one line)."""
    la = plan["profile"]  # the lookahead profile
    lines = [f"engine {plan['file']}: profile {la['name']} (W={la['window']}, N={la['ngram']}, G={la['guesses']}), "
             f"precision {plan['precision']}, max batch {plan['max_batch']}, max prompt {plan['max_prompt']}, "
             f"max context {plan['max_context']}"]
    for index, (phase, shapes) in enumerate(plan["optimization_profiles"].items()):
        lines.append(f"  optimization profile {index} ({phase}):")
        for name, s in shapes.items():
            if name.startswith("past_key_values.") and name != "past_key_values.0.key":
                continue
            label = f"past_key_values.{{0..{num_layers - 1}}}.key/.value" if name.startswith("past_key_values.") else name
            lines.append(f"    {label:<36} min {s['min']}  opt {s['opt']}  max {s['max']}")
    return lines
