"""Parity of an exported step graph: ONNX Runtime against the PyTorch step module
(:func:`check_parity`) and against transformers' own model (:func:`check_against_transformers`),
on real prompt tokens, at float32 bounds (:data:`PARITY_MAX_ABS`, :data:`PARITY_MAX_REL`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from ..feeds import causal_feeds, empty_past_feeds, run_sequence_major
from ..graph import DecoderStep, run_torch_step
from ..specs import ModelDims, past_key_name, past_value_name, present_key_name, present_value_name

# Float32 parity bounds (ONNX Runtime vs PyTorch): max |Δlogit| and max |Δlogit| / max |logit|.
PARITY_MAX_ABS = 1e-3
PARITY_MAX_REL = 1e-5


@dataclasses.dataclass
class ParityCase:
    """Result of one ONNX-vs-PyTorch comparison at a (step, past) shape."""

    label: str
    step: int
    past: int
    max_abs: float
    max_logit: float
    argmax_equal: bool
    kv_max_abs: float

    @property
    def rel(self) -> float:
        """max |Δlogit| / max |logit|."""
        return self.max_abs / max(self.max_logit, 1e-30)

    def ok(self, max_abs: float = PARITY_MAX_ABS, max_rel: float = PARITY_MAX_REL) -> bool:
        return self.max_abs <= max_abs and self.rel <= max_rel and self.argmax_equal and self.kv_max_abs <= max_abs


def parity_feeds(dims: ModelDims, prompt_ids: list[int], profile=None) -> list[tuple[str, dict]]:
    """Real-token feeds for the parity check: prefill of the prompt, a greedy step over it,
    and (with ``profile``) a lookahead-shaped step with its custom mask and
    non-contiguous positions. The cache comes from running the PyTorch step on the prompt
    (filled in by :func:`check_parity`), so it holds real keys and values.
    """
    from ..lookahead import LookaheadState

    ids = np.asarray(prompt_ids, dtype=np.int64)
    p = len(ids)
    cases = [("prefill", causal_feeds(ids, 0, logit_rows=np.arange(p)))]
    if profile is not None:
        state = LookaheadState(profile, dims.vocab, prompt_ids=list(prompt_ids[:-1]))
        # Fill the verification branch for the last token, so all three parts are fed.
        for g in range(profile.guesses):
            state.pool.insert(int(ids[-1]), np.roll(ids, g + 1)[: profile.levels])
        layout = state.prepare(int(ids[-1]), p - 1)
        cases.append((f"lookahead W{profile.window} N{profile.ngram} G{profile.guesses}", layout.feeds(batch=1)))
    cases.append(("greedy", causal_feeds(ids[-1:], p - 1)))
    return cases


def reference_cases(step_module: DecoderStep, prompt_ids: list[int], profile=None) -> list[tuple[str, dict]]:
    """Complete feeds (KV cache included) for comparing engines on real tokens.

    Shapes: prefill (step = prompt length, past 0), a lookahead-shaped step (past =
    prompt length − 1, custom mask, non-contiguous positions, full verification branch)
    when ``profile`` is given, and a greedy step (step 1). The cache of the non-prefill
    cases is the real one from running the prompt prefix through the PyTorch step.

    Returns:
        ``[(label, feeds)]`` with numpy feeds keyed by input name.
    """
    d = step_module.dims
    past_feeds = empty_past_feeds(d)
    prefix = np.asarray(prompt_ids[:-1], dtype=np.int64)
    real_past = dict(past_feeds)
    if len(prefix):
        out = run_torch_step(step_module, {**causal_feeds(prefix, 0), **past_feeds})
        for i in range(d.num_layers):
            real_past[past_key_name(i)] = out[present_key_name(i)]
            real_past[past_value_name(i)] = out[present_value_name(i)]
    cases = []
    for label, feeds in parity_feeds(d, list(prompt_ids), profile):
        cases.append((label, {**feeds, **(past_feeds if label == "prefill" else real_past)}))
    return cases


def check_parity(step_module: DecoderStep, onnx_path: str | Path, prompt_ids: list[int], profile=None,
                 threads: int | None = None, engine=None) -> list[ParityCase]:
    """Compare ONNX Runtime against the PyTorch step on :func:`reference_cases`.

    ``step_module`` is the reference: give the ``onnx-ops`` formulation (sequence-major
    cache) also for a ``group-query-attention`` graph, which is then fed through
    :func:`lade_export.feeds.run_sequence_major`.

    ``engine``: an already open :class:`~lade_export.backends.onnxruntime.OrtEngine` on
    ``onnx_path`` (saves a session creation, seconds for a large graph).

    Returns:
        one :class:`ParityCase` per shape (max abs logits difference, max |logit|,
        argmax equality at every position, max abs difference of the present KV).
    """
    from ..backends.onnxruntime import OrtEngine

    engine = engine or OrtEngine(onnx_path, step_module.dims, threads=threads)
    results = []
    for label, feeds in reference_cases(step_module, prompt_ids, profile):
        ref = run_torch_step(step_module, feeds)
        got = run_sequence_major(engine, feeds, with_logits=True)
        results.append(compare_outputs(label, feeds, ref, got))
    return results


def compare_outputs(label: str, feeds: dict, ref: dict, got: dict) -> ParityCase:
    """Summarize the difference between two engines' outputs on the same feeds."""
    diff = float(np.max(np.abs(ref["logits"] - got["logits"])))
    kv = max(float(np.max(np.abs(ref[n] - got[n]))) if ref[n].size else 0.0 for n in ref if n.startswith("present."))
    return ParityCase(
        label=label,
        step=feeds["input_ids"].shape[1],
        past=feeds[past_key_name(0)].shape[1],
        max_abs=diff,
        max_logit=float(np.max(np.abs(ref["logits"]))),
        argmax_equal=bool(np.array_equal(ref["logits"].argmax(-1), got["logits"].argmax(-1))),
        kv_max_abs=kv,
    )


@dataclasses.dataclass
class ReferenceCase:
    """One comparison of the ONNX graph with transformers' own model.

    Attributes:
        label: ``prefill`` (the graph's prefill of ``tokens`` tokens, every row, against
            transformers on those tokens) or ``decode`` (a prefill of ``tokens − 1``
            tokens, then one step at position ``tokens − 1`` on its cache, against
            transformers' last position on ``tokens`` tokens).
        tokens: sequence length transformers ran, in one call.
        step, past: the graph's step and cache lengths.
        rows: positions compared.
        max_abs: max |Δlogit| over those rows.
        max_logit: max |logit| of transformers over those rows.
        argmax_equal: whether the argmax agrees at every row.
    """

    label: str
    tokens: int
    step: int
    past: int
    rows: int
    max_abs: float
    max_logit: float
    argmax_equal: bool

    def ok(self, max_abs: float = PARITY_MAX_ABS) -> bool:
        """Within the project's parity bound: max |Δlogit| ≤ ``max_abs`` and argmax identical."""
        return self.max_abs <= max_abs and self.argmax_equal

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _reference_case(label, tokens, step, past, ref: np.ndarray, got: np.ndarray) -> ReferenceCase:
    return ReferenceCase(label, tokens, step, past, int(ref.shape[0]), float(np.max(np.abs(ref - got))),
                         float(np.max(np.abs(ref))), bool(np.array_equal(ref.argmax(-1), got.argmax(-1))))


def check_against_transformers(hf_model, onnx_path: str | Path, dims: ModelDims, token_ids, lengths,
                               threads: int | None = None, engine=None) -> list[ReferenceCase]:
    """Compare the exported graph (ONNX Runtime) with transformers' model itself.

    For each length ``L`` of ``lengths``, transformers runs ``token_ids[:L]`` in one call
    from nothing (no cache), as a user's ``model(input_ids)`` or the prefill of
    ``generate`` does, so position-dependent rope variants pick their frequencies from
    that call. Against its logits: the graph's prefill of the ``L`` tokens (every
    position), and the graph's prefill of ``L − 1`` tokens followed by one decode step
    (token ``L − 1`` at position ``L − 1`` on that cache, the last position).

    Args:
        hf_model: the transformers causal LM the graph was exported from (float32, eval).
        onnx_path: the exported graph.
        dims: its :class:`ModelDims`.
        token_ids: at least ``max(lengths)`` token ids.
        lengths: sequence lengths, each in ``2 … dims.max_context``.
        threads: ONNX Runtime threads.
        engine: an already open ``OrtEngine`` on ``onnx_path`` (else one is opened).

    Returns:
        two :class:`ReferenceCase` per length (``prefill``, ``decode``), in length order.

    Raises:
        ValueError: ``token_ids`` too short or a length outside ``2 … dims.max_context``.
    """
    from ..backends.onnxruntime import OrtEngine

    ids = np.asarray(token_ids, dtype=np.int64)
    lengths = sorted(lengths)
    if lengths and (len(ids) < lengths[-1] or lengths[0] < 2 or lengths[-1] > dims.max_context):
        raise ValueError(f"lengths {lengths} need 2 ≤ L ≤ {dims.max_context} and {lengths[-1]} tokens")
    engine = engine or OrtEngine(onnx_path, dims, threads=threads)
    empty = empty_past_feeds(dims)
    cases = []
    for n in lengths:
        with torch.inference_mode():
            ref = hf_model(torch.from_numpy(ids[None, :n])).logits[0].float().numpy()  # [n, vocab]
        out = run_sequence_major(engine, {**causal_feeds(ids[:n], 0, logit_rows=np.arange(n)), **empty}, with_logits=True)
        cases.append(_reference_case("prefill", n, n, 0, ref, out["logits"][0]))
        head = run_sequence_major(engine, {**causal_feeds(ids[: n - 1], 0), **empty})
        past = {}
        for i in range(dims.num_layers):
            past[past_key_name(i)] = head[present_key_name(i)]
            past[past_value_name(i)] = head[present_value_name(i)]
        nxt = run_sequence_major(engine, {**causal_feeds(ids[n - 1 : n], n - 1), **past}, with_logits=True)
        cases.append(_reference_case("decode", n, 1, n - 1, ref[-1:], nxt["logits"][0]))
    return cases
