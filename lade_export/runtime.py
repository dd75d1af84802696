"""The decoding loop around a compiled step engine: plain greedy and lookahead decoding,
streamed, with stop strings, cancellation and many requests at once.

Both modes run on the same engine, so their outputs can be compared token for token.
Lookahead decoding (Fu et al. 2023, arXiv 2402.02057) is exact for greedy decoding:
every accepted token is the argmax the model gives after exactly the accepted prefix,
so the output equals plain greedy output (up to float ties). The algorithm itself lives
in :mod:`lade_export.lookahead`; this module only drives it.

Cache invariant: after every step, the KV cache holds all tokens of the sequence except
the last accepted one, which is the first token fed at the next step.

Concurrency: a :class:`Decoder` holds no per-request state. Each request owns its KV
cache, its algorithm state, its text stream and the engine's plan for its profile
(:meth:`Engine.check_profile`, passed with each of its steps), so one decoder (one engine) serves
requests from several threads at once; ONNX Runtime allows concurrent ``Run`` calls on
one session and releases the GIL while it runs. Nothing here imports PyTorch.

Length (over the package's ~400 lines, about half of it docstrings): this module is the
decoding contract, read as one — the interface every backend implements (:class:`Engine`,
member by member; the README and the backends cite it as ``lade_export.runtime.Engine``),
a request as the loop and the scheduler decode it (:class:`CheckedRequest`), the result
types (:class:`GenerationStats`, :class:`GenerationResult`, :class:`Chunk`) and the loop
(:class:`Decoder`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
import time
from collections import Counter
from typing import Callable, Iterator, Protocol

from .detokenize import TextStream
from .errors import GenerationError, ProfileError
from .feeds import causal_feeds
from .kv_cache import KVCache
from .lookahead import StopRules, new_state
from .profile import GREEDY, LookaheadProfile, request_profile
from .sampling import SamplingParams, is_integer_number, is_real_number, shown_value
from .specs import ModelDims
from .tokenizer import check_text


class Engine(Protocol):
    """What the decoding loop (:class:`Decoder`) and the scheduler
    (:class:`lade_export.scheduler.Scheduler`) need from a backend: ONNX Runtime
    (:class:`~lade_export.backends.onnxruntime.OrtEngine`), PyTorch
    (:class:`~lade_export.export.torch_engine.TorchEngine`), TensorRT
    (:class:`~lade_export.backends.tensorrt.TensorRTEngine`). Every engine has every
    member below; nothing else is read from an engine.

    Attributes:
        name: the backend's short name (``"ort"``, ``"torch"``, ``"tensorrt"``).
        dims: the model's shape facts (:class:`lade_export.specs.ModelDims`).
        kv_layout: the KV cache layout ``run`` takes (:data:`lade_export.specs.KV_LAYOUTS`):
            ``"sequence-major"`` (``past_key_values.*`` float32 [batch, past, kv_heads,
            head_dim]) or ``"head-major-shared"`` (float32 [batch, kv_heads, capacity,
            head_dim] buffers the step writes into, see :mod:`lade_export.kv_cache`).
        kv_dtype: numpy dtype of those cache tensors (float32; float16 for the integer
            path's half-precision cache): the dtype the runtime allocates caches in.
        step_room: for a graph whose rotary table ends ``step_room`` tokens after the
            context (``GroupQueryAttention``), that number of tokens: no step is wider
            and a packed pass's keys stay below ``max_context + step_room``; None: no such limit.
        attention_skips: key-block width in tokens (16) when the attention costs only the
            key blocks a row may see (``AttentionRows`` that skip fully masked blocks; the
            scheduler then gives each request its own region of the pool,
            :class:`lade_export.packed.TokenPool`), else 0.
    """

    name: str
    dims: ModelDims
    kv_layout: str
    kv_dtype: object  # a numpy dtype
    step_room: int | None
    attention_skips: int

    def check_profile(self, profile: LookaheadProfile) -> str | None:
        """Refuse a lookahead profile whose steps the engine cannot take, before any work,
        and say how the engine runs that profile's steps.

        Args:
            profile: an enabled :class:`~lade_export.profile.LookaheadProfile` (its
                ``max_step`` tokens and ``max_logit_rows`` rows are the widest step).

        Returns:
            the engine's plan for that profile's steps, to pass to :meth:`run` as ``plan``
            with each of the request's steps (TensorRT: the name of the engine whose decode
            optimization profile covers them); None for an engine with one graph for
            every step. A value, never state kept by the engine: requests of different
            profiles in different threads each carry their own.

        Raises:
            ProfileError: the widest step is beyond the engine's graph (rotary rows,
                TensorRT optimization profiles), naming the limits.
        """

    def check_batching(self, token_budget: int, prefill_chunk: int, kv_tokens: int) -> None:
        """Refuse continuous batching whose packed passes the engine cannot take.

        Args:
            token_budget, prefill_chunk, kv_tokens: the scheduler's options (rows of a
                decode pass, rows of a prefill chunk, tokens of the KV pool).

        Raises:
            GenerationError: the passes exceed the engine's shapes (TensorRT's packed
                optimization profile); engines of dynamic shapes accept any.
        """

    def run(self, feeds: dict, with_logits: bool = False, plan: str | None = None) -> dict:
        """One forward pass of the step graph.

        Args:
            feeds: numpy arrays by input name (:mod:`lade_export.specs`: ``input_ids``,
                ``position_ids`` int64 [batch, step], ``attention_mask`` bool [batch, 1,
                step, past + step], ``logits_positions`` int64 [batch, n_logits], the
                ``past_key_values.*`` cache in :attr:`kv_layout`).
            with_logits: also return ``logits`` float32 [batch, n_logits, vocab] (else
                only ``next_token_ids`` int64 [batch, n_logits] and ``present.*``).
            plan: what :meth:`check_profile` returned for the request's profile; None
                (greedy steps, a scheduler's packed pass of several requests): the engine
                chooses by the feeds' shapes alone. Callers pass it only when
                :meth:`check_profile` returned one, so an engine whose
                :meth:`check_profile` always returns None is always called as
                ``run(feeds, with_logits=...)``.

        Returns:
            numpy arrays by output name.

        Raises:
            EngineError: the backend failed to run the feeds.
            GenerationError: the engine's shapes do not cover the step (TensorRT).
        """

    def close(self) -> None:
        """Release the engine's resources."""


@dataclasses.dataclass
class GenerationStats:
    """Statistics of one generation.

    Attributes:
        prompt_tokens: prompt length in tokens.
        new_tokens: generated tokens (including a final stop token).
        steps: decode forward passes (prefill not counted).
        prefill_s: prefill wall time, seconds.
        decode_s: decode wall time, seconds.
        acceptance_histogram: {tokens accepted in a step: number of steps}.
        host_s: time spent outside the engine during decode, seconds.
        cache_tokens: tokens in the KV cache at the end (never above the context).
        first_token_s: seconds from the start of the request to the first new token.
        drafts_checked: verification candidates tested (lookahead; greedy compares every
            child of each visited trie node with the argmax, sampling tests children one
            by one until one is accepted).
        drafts_accepted: candidates accepted (tokens gained beyond one per step).
        decoding: ``"greedy"`` or the sampling parameters (``sampling T=0.8 top-p 0.9 seed 3``).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    acceptance_histogram: dict = dataclasses.field(default_factory=dict)
    host_s: float = 0.0
    cache_tokens: int = 0
    first_token_s: float = 0.0
    drafts_checked: int = 0
    drafts_accepted: int = 0
    decoding: str = "greedy"

    @property
    def compression_ratio(self) -> float:
        """Tokens per decode forward pass: new_tokens / steps (1.0 for greedy)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput, new tokens per second of decode time."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance_histogram"] = {str(k): v for k, v in sorted(self.acceptance_histogram.items())}
        d["compression_ratio"] = self.compression_ratio
        d["tokens_per_s"] = self.tokens_per_s
        return d

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        return (f"steps {self.steps} · tokens {self.new_tokens} · compression {self.compression_ratio:.2f} · "
                f"{self.tokens_per_s:.1f} tok/s (prefill {self.prompt_tokens} token{'' if self.prompt_tokens == 1 else 's'} "
                f"in {self.prefill_s:.2f}s)")


#: Why a generation ended.
STOP_REASONS = ("stop_token", "stop_string", "max_new_tokens", "cancelled", "timeout")


@dataclasses.dataclass
class GenerationResult:
    """A finished generation.

    Attributes:
        token_ids: new token ids (a final stop token included; for a stop string, up to
            and including the token that completed it).
        text: their text (special tokens left out), cut before a stop string; "" without
            a tokenizer.
        stop_reason: one of :data:`STOP_REASONS`.
        stats: :class:`GenerationStats`.
    """

    token_ids: list
    text: str
    stop_reason: str
    stats: GenerationStats


@dataclasses.dataclass
class Chunk:
    """One piece of a streamed generation (one decode step, or the prefill's end).

    Attributes:
        text: newly released text (may be "" while a character or a possible stop
            string is incomplete).
        token_ids: token ids accepted in this step.
        stop_reason: set on the last chunk only (one of :data:`STOP_REASONS`).
        stats: set on the last chunk only.
    """

    text: str
    token_ids: list
    stop_reason: str | None = None
    stats: GenerationStats | None = None

    @property
    def final(self) -> bool:
        return self.stats is not None


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request that passed :meth:`Decoder.validate`: what the decoding loop and the
    scheduler decode, every value in its one form.

    Attributes:
        prompt: the prompt's token ids, Python ints in ``[0, vocab)``, at least one.
        max_new_tokens: int ≥ 1; prompt + new tokens fit the context.
        profile: the request's profile: an enabled
            :class:`~lade_export.profile.LookaheadProfile`, or
            :data:`~lade_export.profile.GREEDY` for plain greedy decoding.
        stop: the stop strings (a tuple; none empty).
        stop_token_ids: frozenset of the ids that end this request.
        sampling: :class:`~lade_export.sampling.SamplingParams` (temperature 0: greedy).
        timeout_s: seconds, a finite number > 0, or None (no limit).
        plan: the engine's plan for the profile's steps (:meth:`Engine.check_profile`);
            None for plain decoding or an engine with one graph for every step.
    """

    prompt: list
    max_new_tokens: int
    profile: LookaheadProfile
    stop: tuple
    stop_token_ids: frozenset
    sampling: SamplingParams
    timeout_s: float | None
    plan: str | None


class Decoder:
    """Greedy and lookahead decoding on one engine, for any number of concurrent requests.

    Args:
        engine: a backend engine (see :class:`Engine`).
        stop_token_ids: the ids that end a request that gives none of its own (the stop
            token is emitted, nothing after it); a request's ``stop_token_ids`` replace them.
        max_context: the context in tokens (prompt + new tokens may not exceed it);
            default ``engine.dims.max_context``.
        tokenizer: optional (:class:`lade_export.tokenizer.Tokenizer`), to stream text
            and match stop strings.
        lookahead_exact: False for an engine that computes a token differently in one-token
            and many-token steps (an int8-activation graph, see :mod:`lade_export.export.quantize`):
            lookahead requests are then refused instead of being inexact.

    State (window, pool, KV cache, text) is created per request, so consecutive and
    concurrent calls on one object are independent.
    """

    def __init__(self, engine: Engine, stop_token_ids=(), max_context: int | None = None, tokenizer=None,
                 lookahead_exact: bool = True):
        self.engine = engine
        self.lookahead_exact = lookahead_exact
        self.dims = engine.dims
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_context = max_context or self.dims.max_context
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # request id -> KV cache bytes

    # -- validation, once for the library and the CLI -------------------------------------

    def check_request(self, prompt_len: int, max_new_tokens, profile: LookaheadProfile | None = None) -> str | None:
        """Refuse a request that cannot be served, before any work.

        Args:
            prompt_len: prompt tokens.
            max_new_tokens: new tokens asked for.
            profile: the request's profile, any spelling
                :func:`~lade_export.profile.request_profile` takes (None: plain greedy).

        Returns:
            the engine's plan for the profile's steps (:meth:`Engine.check_profile`), None
            for plain decoding or an engine with one graph for every step.

        Raises:
            GenerationError: empty prompt, ``max_new_tokens`` not an integer ≥ 1 (Python's
                or numpy's), or prompt + new tokens beyond the context.
            ProfileError: the profile's largest step does not fit the context, the
                engine's shapes do not cover it (TensorRT engines), or lookahead would not
                be exact on this engine.
        """
        if prompt_len < 1:
            raise GenerationError("empty prompt: give at least one token (the tokenizer's BOS counts)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer ≥ 1, got {shown_value(max_new_tokens)}")
        max_new_tokens = int(max_new_tokens)  # a numpy integer's sum below would wrap around at its width
        if prompt_len + max_new_tokens > self.max_context:
            raise GenerationError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
                f"exceeds the model's context of {self.max_context} tokens"
            )
        profile = request_profile(profile)
        if profile is not GREEDY:
            if not self.lookahead_exact:
                raise ProfileError(f"profile {profile.name!r}: this engine computes one-token and multi-token steps "
                                   "differently (int8 activations), so lookahead would not be exact; decode without "
                                   "lookahead, or use an int4 or fp32 build")
            profile.check_fits(self.max_context)
            return self.engine.check_profile(profile)
        return None

    # -- live requests ---------------------------------------------------------------------

    @property
    def active_requests(self) -> int:
        """Requests holding a KV cache right now."""
        with self._lock:
            return len(self._live)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache held by the live requests."""
        with self._lock:
            return sum(self._live.values())

    # -- decoding --------------------------------------------------------------------------

    def stream(self, prompt_ids, max_new_tokens: int, profile: LookaheadProfile | None = None, *, stop=(),
               cancel=None, timeout_s: float | None = None, sampling: SamplingParams | None = None,
               stop_token_ids=None) -> Iterator[Chunk]:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, step by step.

        Args:
            prompt_ids: int token ids, at least one (the BOS token counts).
            max_new_tokens: ≥ 1.
            profile: a lookahead profile; :data:`~lade_export.profile.GREEDY` for plain
                greedy decoding (so are None, ``"greedy"`` and a profile of ``enabled =
                false``: :func:`~lade_export.profile.request_profile`).
            stop: stop strings (need a tokenizer; none may be empty): generation ends as
                soon as the text contains one, even across tokens or inside a block
                accepted in one step; the text is cut before it.
            cancel: an object with ``is_set()`` (e.g. ``threading.Event``); once set, the
                request stops before its next step (``stop_reason`` ``"cancelled"``).
            timeout_s: a finite number of seconds > 0 (or None: no limit); the request stops
                at the first step boundary after it (``stop_reason`` ``"timeout"``).
            sampling: :class:`lade_export.sampling.SamplingParams` (None or temperature 0:
                greedy). Lookahead with sampling keeps plain sampling's distribution.
            stop_token_ids: the ids that end this request (an iterable of ints; empty: no
                stop token), instead of the decoder's ``stop_token_ids``; None: the decoder's.

        Yields:
            :class:`Chunk` per decode step; the last one carries ``stop_reason`` and
            ``stats``. Closing the generator early (``break`` + ``close()``, or garbage
            collection) ends the request and frees its KV cache.

        Raises:
            GenerationError, ProfileError: see :meth:`check_request` (before any work);
                GenerationError also for a prompt token id outside ``[0, vocab)``, an empty
                stop string, a ``timeout_s`` that is not a finite number > 0, ``sampling``
                that is not a :class:`~lade_export.sampling.SamplingParams`, or
                ``stop_token_ids`` that are not token ids of the vocabulary.
        """
        req = self.validate(prompt_ids, max_new_tokens, profile, stop, timeout_s, sampling=sampling,
                            stop_token_ids=stop_token_ids)
        return self._stream(req, cancel)

    def validate(self, prompt_ids, max_new_tokens, profile=None, stop=(), timeout_s=None, *, sampling=None,
                 stop_token_ids=None) -> CheckedRequest:
        """The checks of :meth:`stream` before any work (also the scheduler's,
        :class:`lade_export.scheduler.Scheduler`).

        Returns:
            :class:`CheckedRequest`: the request's values in their one form.

        Raises:
            GenerationError, ProfileError: as :meth:`stream`.
        """
        prompt = [int(t) for t in prompt_ids]
        profile = request_profile(profile)
        plan = self.check_request(len(prompt), max_new_tokens, profile)
        max_new_tokens = int(max_new_tokens)
        if timeout_s is not None and not (is_real_number(timeout_s) and math.isfinite(timeout_s) and timeout_s > 0):
            raise GenerationError(f"timeout_s must be a finite number of seconds > 0, got {shown_value(timeout_s)}")
        if isinstance(stop, (str, bytes)) or not hasattr(stop or (), "__iter__"):
            raise GenerationError(f"stop must be a list of strings, got {shown_value(stop)}")
        stop = tuple(stop or ())
        for s in stop:
            if not isinstance(s, str):
                raise GenerationError(f"stop strings must be strings, got {shown_value(s)}")
            check_text(s, "a stop string")
        if any(s == "" for s in stop):
            raise GenerationError("stop strings must not be empty")
        outside = next((t for t in prompt if not 0 <= t < self.dims.vocab), None)
        if outside is not None:
            raise GenerationError(f"token id {outside} is outside the vocabulary (0..{self.dims.vocab - 1})")
        if stop and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise GenerationError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        return CheckedRequest(prompt, max_new_tokens, profile, stop, self.request_stop_ids(stop_token_ids),
                              sampling or SamplingParams(), timeout_s, plan)

    def request_stop_ids(self, stop_token_ids=None) -> frozenset:
        """The stop ids of a request: ``stop_token_ids`` checked (an iterable of token ids;
        empty: none), or the decoder's for None.

        Raises:
            GenerationError: not an iterable of integers, or an id outside ``[0, vocab)``.
        """
        if stop_token_ids is None:
            return self.stop_token_ids
        vocab = self.dims.vocab
        shape = f"stop_token_ids must be a list of token ids (integers 0..{vocab - 1})"
        if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
            raise GenerationError(f"{shape}, got {shown_value(stop_token_ids)}")
        ids = list(stop_token_ids)
        for t in ids:
            if not is_integer_number(t) or not 0 <= t < vocab:
                raise GenerationError(f"{shape}, got {shown_value(t)}")
        return frozenset(int(t) for t in ids)

    def _stream(self, req: CheckedRequest, cancel) -> Iterator[Chunk]:
        t0 = time.perf_counter()
        prompt, max_new_tokens, profile, plan = req.prompt, req.max_new_tokens, req.profile, req.plan
        deadline = t0 + req.timeout_s if req.timeout_s is not None else None
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        text = TextStream(detok, req.stop)
        rules = StopRules(req.stop_token_ids, max_new_tokens, text.push if detok is not None else None)
        state = new_state(profile, self.dims.vocab, prompt, rules, req.sampling)
        stats = GenerationStats(prompt_tokens=len(prompt), decoding=req.sampling.describe())
        # one block for all layers where the engine's bound steps write their presents as one block
        # too (OrtEngine.binds_steps): a step's kept rows are then stored in one copy
        cache = KVCache(self.dims, capacity=len(prompt) + max_new_tokens, layout=self.engine.kv_layout,
                        dtype=self.engine.kv_dtype, step_room=profile.max_step,
                        stacked=getattr(self.engine, "binds_steps", False))
        key = id(cache)
        # the request's steps carry the engine's plan for its profile (none: the engine's own choice)
        run = self.engine.run if plan is None else functools.partial(self.engine.run, plan=plan)
        with self._lock:
            self._live[key] = cache.nbytes
        try:
            if len(prompt) > 1:
                cache.append(run({**causal_feeds(prompt[:-1], 0), **cache.feeds()}), step=len(prompt) - 1)
            stats.prefill_s = time.perf_counter() - t0
            histogram: Counter = Counter()
            engine_s = 0.0
            last_ids: list[int] = []
            t1 = time.perf_counter()
            while True:
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                if deadline is not None and time.perf_counter() >= deadline:
                    reason = "timeout"
                    break
                layout = state.prepare(state.sequence[-1], cache.length)
                feeds = layout.feeds()
                feeds.update(cache.feeds())
                te = time.perf_counter()
                outputs = run(feeds, with_logits=state.needs_logits)
                engine_s += time.perf_counter() - te
                verdict = state.update(layout, outputs)
                stats.steps += 1
                stats.new_tokens += len(verdict.accepted)
                histogram[len(verdict.accepted)] += 1
                if stats.steps == 1:
                    stats.first_token_s = time.perf_counter() - t0
                if verdict.stop_reason is not None:
                    reason, last_ids = verdict.stop_reason, verdict.accepted
                    break
                cache.append(outputs, verdict.kept_rows, step=layout.step)
                yield Chunk(text.take(), verdict.accepted)
            stats.decode_s = time.perf_counter() - t1
            stats.host_s = max(stats.decode_s - engine_s, 0.0)
            stats.cache_tokens = cache.length
            stats.acceptance_histogram = dict(histogram)
            stats.drafts_checked, stats.drafts_accepted = state.rule.checked, state.rule.accepted
            tail, cut = text.finish()
            if cut and reason in ("stop_token", "max_new_tokens"):
                reason = "stop_string"  # a stop string completed in text held back until the end
            yield Chunk(tail, last_ids, reason, stats)
        finally:
            with self._lock:
                self._live.pop(key, None)
            del cache

    def generate(self, prompt_ids, max_new_tokens: int, profile: LookaheadProfile | None = None,
                 on_tokens: Callable[[list], None] | None = None, *, stop=(), cancel=None,
                 timeout_s: float | None = None, sampling: SamplingParams | None = None,
                 stop_token_ids=None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (see :meth:`stream`).

        Args:
            on_tokens: called with each step's newly emitted token ids.

        Returns:
            :class:`GenerationResult`; its text is the concatenation of the streamed chunks.

        Raises:
            GenerationError, ProfileError: see :meth:`check_request` (before any work).
        """
        return collect(self.stream(prompt_ids, max_new_tokens, profile, stop=stop, cancel=cancel,
                                   timeout_s=timeout_s, sampling=sampling, stop_token_ids=stop_token_ids), on_tokens)


def collect(chunks, on_tokens: Callable[[list], None] | None = None) -> GenerationResult:
    """Drain a stream of :class:`Chunk` into a :class:`GenerationResult`."""
    ids: list[int] = []
    pieces: list[str] = []
    for chunk in chunks:
        ids += chunk.token_ids
        pieces.append(chunk.text)
        if on_tokens is not None and chunk.token_ids:
            on_tokens(list(chunk.token_ids))
        if chunk.final:
            return GenerationResult(ids, "".join(pieces), chunk.stop_reason, chunk.stats)
    raise GenerationError("the stream ended without its final chunk")
