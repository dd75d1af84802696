"""Continuous batching: one scheduler owns the engine and runs every active request's
next step in one forward pass.

Design (the split of serving engines: the model is shared, the request is state, the
scheduler owns the step — vLLM's scheduler builds one flattened batch per iteration;
TensorRT-LLM's in-flight batching packs every request's tokens without padding and
admits and retires requests between iterations):

* A request is state: its prompt, its decoding state (:mod:`lade_export.lookahead`:
  greedy or lookahead with its own profile, window, pool and history; greedy or sampling
  rule with its own random generator), its stop rules and text stream, and its columns of
  the scheduler's KV pool. The lookahead algorithm does not know it is batched:
  ``prepare`` / ``update`` are called as the single-request loop calls them (under the
  adaptive policy a greedy history-lookup step that could not pay for its rows is a plain
  one-token step instead, without a ``prepare``: ``Scheduler._prepare``).
* Each iteration (a *pass*) the scheduler takes the next decode step of every active
  request (round robin from a rotating start) while the rows fit the token budget, then
  fills what is left of the budget with chunks of new requests' prompts (so a long prompt
  does not stall running streams), packs them (:mod:`lade_export.packed`), runs one
  forward pass and hands every request its rows. A pass with no decode step may prefill up
  to ``prefill_chunk`` tokens. A step wider than the budget runs in a pass of its own.
* Requests join and leave only between passes. A finished, cancelled, timed-out or closed
  request leaves and its KV columns are freed; the others' outputs do not change. An
  error in one request's host work fails that request only; an engine error in a packed
  pass is retried item by item, each alone, so it fails only the request that causes it.
* A request whose consumer has ``max_unread`` chunks waiting is skipped (paused) until
  the consumer reads; it never holds the others back, nor one of the ``max_batch`` places:
  a waiting request is admitted beside it (KV room permitting), and a pass takes at most
  ``max_batch`` decode steps when paused requests read again.
* Passes run in the threads of the readers (leader/follower): whichever reader is waiting
  for a chunk and finds no pass running runs the next one for everybody; the others wait
  for their chunks. No pass runs while no reader waits.

Why this formulation (``bench/batched_step_options.py``: one packed pass over a shared pool
against one pass per request and against the same rows over a single request's cache;
figures in ``bench/results/serving-batched.md``): batching pays where the weight MatMuls
share their reads, greedy-width steps above all, and less as steps widen. The packed pass
over a pool needs no new graph input, so every artifact built before batches as it is
(``onnx-ops`` and ONNX Runtime's ``GroupQueryAttention``, whose kernel refuses batch > 1
for a multi-token step with a cache but takes a batch-1 step of any rows with a
block-diagonal mask). On those engines its cost is attention over columns a row cannot
see, growing with requests × context, so they keep the compact pool
(:mod:`lade_export.packed`). On int8 lade builds whose ``AttentionRows`` skips fully
masked key blocks (:attr:`lade_export.runtime.Engine.attention_skips`) a row's attention
costs its own request's key blocks (each request one contiguous region of the pool,
``TokenPool(regions=True)``); what still grows with the pass is reading each request's
own keys and the mask (``step × past`` bytes).

Limits: on a ``group-query-attention`` graph the pool holds at most ``max_context``
tokens over all requests (the graph's rotary table bounds the key length of a pass).
``kv_tokens`` bounds the pool; requests wait for room.

Width policy under load (``width_policy``, :mod:`lade_export.width_policy`): with
``"adaptive"`` (the default) each pass decides how wide every greedy lookahead request's
step is — its profile's, half its window, its candidates without the window, or a
one-token step — from the step-cost curve (fitted online from this scheduler's own
passes) and the request's recent acceptance, widening only where the expected tokens pay
for the rows; sampled requests keep their profile's steps (narrowing would change their
output against their solo run). With ``"profile"`` every request's step is its profile's.
Either way the token budget defers a step that does not fit to the next pass. A decode
step is prepared once, at its profile (kept while the budget defers it); a narrower class
is cut from it (:func:`lade_export.width_policy.narrowed`); in a pass of several decode
steps, a greedy history-lookup step whose best case could not pay for its rows is given a
one-token step without being prepared (:meth:`Scheduler._prepare`). What the policy gains against
``"profile"`` and against batched greedy is measured by ``bench/serve_batched.py``
(docs/serving.md, *Lookahead width under load*; ``bench/results/serving.md``). ``timeline=True`` records
every pass's phases (:class:`PassRecord`; ``bench/scheduler_timeline.py``, figures in
``bench/results/serving.md``: where a closed-loop level's time goes).
``width_steps`` and ``width_passes`` count decode steps per width class and passes per
widest class.

Exactness: every request's output equals its output alone on the same engine (the
single-request :class:`~lade_export.runtime.Decoder`), token for token: each row's
attention sees exactly its own request's columns, and each MatMul row is computed from
its own input row (the property lookahead's exactness already relies on). Tests:
``tests/test_scheduler.py``.

Length (over the package's ~400 lines): :class:`Scheduler` is one state machine —
admission, a pass's plan within the token budget, narrowing, the packed pass and its
retry item by item, leaving — whose parts share the requests' state under one lock and
the leader/follower hand-off; what stands alone already lives apart (packing and the KV
pool in :mod:`lade_export.packed`, the width policy in :mod:`lade_export.width_policy`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from typing import Iterator, NamedTuple

import numpy as np

from .detokenize import TextStream
from .errors import GenerationError
from .lookahead import ONE_TOKEN, StopRules, new_state
from .ngram import StepLayout
from .packed import PackedItem, TokenPool, item_outputs, pack
from .profile import LookaheadProfile
from .runtime import Chunk, Decoder, GenerationResult, GenerationStats, collect
from .sampling import GreedyRule, SamplingParams
from .width_policy import WIDTHS, Option, candidate_depth, make_policy, narrowed, width_caps

#: Default rows of a pass that holds decode steps (4 requests' 11-token lookahead steps fit).
TOKEN_BUDGET = 64
#: Default prompt tokens a pass without decode steps may prefill.
PREFILL_CHUNK = 512
#: Default requests in flight at once.
MAX_BATCH = 8
#: Default chunks a consumer may leave unread before its request is paused.
MAX_UNREAD = 64
#: Default width policy (why: docs/serving.md, *Lookahead width under load*, measured with bench/serve_batched.py).
WIDTH_POLICY = "adaptive"

#: With the adaptive policy, a greedy lookahead request whose steps could not be widened at
#: their best is given one-token steps without its candidates being looked up; one step in
#: this many is prepared anyway (its trie then measured in hindsight: see
#: :meth:`Scheduler._prepare`).
PREPARE_EVERY = 8

ONE_TOKEN_OPTION = Option("one-token", ONE_TOKEN, 1, 1.0)


class PassRecord(NamedTuple):
    """One pass of a scheduler's timeline (``Scheduler(timeline=True)``: ``scheduler.timeline``,
    one record per pass that ran, in order). Times are ``time.perf_counter()`` seconds; the
    phases of a pass follow each other, ``start ≤ planned ≤ engine ≤ engine_end ≤ updated ≤
    end``, and the time from one record's ``end`` to the next one's ``start`` is time when no
    pass ran (the lead handed to the next reader, readers waking, the GIL, no reader waiting).

    Attributes:
        start: the leading reader began the iteration (admission of waiting requests).
        planned: the pass's items are chosen and every decode step prepared (widths chosen).
        engine: the feeds are packed (mask, ids, positions, the pool's cache views); the
            engine's run starts.
        engine_end: the engine's run returned.
        updated: every item is handled: decode steps verified (``state.update``), stop
            rules, detokenized text, chunks handed to their readers' queues.
        end: the pool kept the pass's rows and finished requests were handed their last
            chunk; the lead is released right after.
        steps: decode steps of the pass (one per decoding request in it).
        chunks: prompt chunks of the pass (one per prefilling request in it).
        decode_rows: rows of its decode steps.
        prefill_rows: rows of its prompt chunks (``decode_rows + prefill_rows`` is the
            pass's ``step``, the tokens fed).
        tokens: new tokens its decode steps accepted (after the stop rules).
        waiting: requests still waiting for admission when it was planned.
        leader: ``threading.get_ident()`` of the reader thread that ran it.
    """

    start: float
    planned: float
    engine: float
    engine_end: float
    updated: float
    end: float
    steps: int
    chunks: int
    decode_rows: int
    prefill_rows: int
    tokens: int
    waiting: int
    leader: int


def _end_reason(req: "_Request") -> str | None:
    """Why ``req`` ends at this pass boundary without another step: ``"cancelled"`` (closed,
    or its cancel event set), ``"timeout"`` (past its deadline), else None. Raises what the
    request's own cancel event raises."""
    if req.closed.is_set() or (req.cancel is not None and req.cancel.is_set()):
        return "cancelled"
    if req.deadline is not None and time.perf_counter() >= req.deadline:
        return "timeout"
    return None


class _RequestChunks:
    """The iterator :meth:`Scheduler.stream` returns: the request's chunks, and a ``close``
    that ends the request whether or not its chunks were ever read. (A generator closed or
    dropped before its first ``next`` never runs its ``finally``; the request was queued
    already and would keep its batch slot and KV room.) Closing from another thread while
    the reader waits in ``next`` ends the request at the next pass boundary; the reader then
    gets a last chunk, ``stop_reason`` "cancelled"."""

    __slots__ = ("_chunks", "_req", "_sweep")

    def __init__(self, chunks: Iterator[Chunk], req: "_Request", sweep):
        self._chunks, self._req, self._sweep = chunks, req, sweep

    def __iter__(self) -> "_RequestChunks":
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._req.closed.set()  # before the lead is tried (Scheduler._sweep_closed)
        try:
            self._chunks.close()
        except ValueError:  # "generator already executing": a reader waits in next(); it ends as above
            pass
        self._sweep()  # a generator never started runs no finally: the request leaves here

    def __del__(self):
        try:
            self.close()
        except Exception:  # an interpreter shutting down
            pass


class _Request:
    """One request's state inside the scheduler (private: only the thread running a pass changes it)."""

    __slots__ = ("id", "prompt", "state", "text", "stats", "out", "cancel", "deadline", "closed", "t0", "t1",
                 "prefilled", "cache_len", "layout", "histogram", "engine_s", "max_step", "need", "error",
                 "width", "widest", "depth", "acceptance", "full", "menu", "widened", "unprepared")

    def __init__(self, rid, prompt, state, text, stats, cancel, deadline, max_step, need):
        self.id = rid
        self.prompt = prompt
        self.state = state
        self.text = text
        self.stats = stats
        self.out: deque = deque()  # chunks not read yet (appended by the pass's thread, taken by the reader's)
        self.cancel = cancel
        self.deadline = deadline
        self.closed = threading.Event()
        self.t0 = time.perf_counter()
        self.t1 = None  # decode start
        self.prefilled = 0  # prompt tokens in the pool
        self.cache_len = 0
        self.layout = None  # the next step as this pass runs it (the profile's, or narrowed)
        self.full = None  # its next step: the profile's, prepared once (kept when a pass defers it), or one token
        self.menu = ()  # the width classes of the prepared step that verify its trie (hindsight acceptance)
        self.histogram: Counter = Counter()
        self.engine_s = 0.0
        self.max_step = max_step
        self.need = need  # KV tokens reserved: prompt + max_new_tokens
        self.error = None
        self.width = "one-token"  # width class of the prepared step
        self.widest = False  # whether it is the widest of several classes the request had this pass
        self.depth = 0  # tokens of the deepest candidate of the prepared step
        self.acceptance = None  # the adaptive width policy's record of this request
        self.widened = None  # extra tokens the policy expected of this pass's step, when it widened it
        self.unprepared = 0  # its decode steps in a row given a one-token step without being prepared

    @property
    def ready(self) -> bool:
        """Prefill done: the request decodes."""
        return self.prefilled >= len(self.prompt) - 1


class Scheduler:
    """Continuous batching of greedy, sampled and lookahead requests on one engine.

    Args:
        decoder: the :class:`~lade_export.runtime.Decoder` whose engine, stop ids, context,
            tokenizer and exactness flag the scheduler uses (and whose
            :meth:`~lade_export.runtime.Decoder.validate` checks requests).
        token_budget: rows of a pass that holds decode steps (latency bound; default
            :data:`TOKEN_BUDGET`). A step wider than it runs alone.
        prefill_chunk: prompt tokens a pass without decode steps may take (default
            :data:`PREFILL_CHUNK`).
        max_batch: requests running at once, paused ones (``max_unread``) not counted, and
            the most decode steps of a pass; later ones wait (default :data:`MAX_BATCH`).
        kv_tokens: most tokens the KV pool holds over all requests (keys and values in
            the engine's ``kv_dtype``: float32, ``dims.kv_bytes_per_token`` bytes each, or
            float16 on the integer path, half that; allocated as requests need it).
            Default: ``max_batch × max_context``; on a ``group-query-attention`` graph at
            most ``max_context`` (a pass's keys, pool and step, must fit the graph's rotary
            table of ``max_context + step_room`` rows).
        max_unread: chunks a consumer may leave unread before its request is paused.
        width_policy: ``"adaptive"`` (default: widths per pass from the step-cost curve
            and acceptance), ``"profile"`` (every step its profile's), or a policy object
            such as :class:`lade_export.width_policy.AdaptiveWidth` with a fixed cost curve;
            see :mod:`lade_export.width_policy`.
        timeline: record a :class:`PassRecord` of every pass in :attr:`timeline` (off by
            default; off, no clock is read for it). ``bench/scheduler_timeline.py`` reads it.

    Attributes:
        width_steps: ``Counter`` width class (:data:`lade_export.width_policy.WIDTHS`) →
            decode steps run at it.
        width_passes: ``Counter`` widest class of a pass's decode steps → passes.
        timeline: ``list[PassRecord]`` (``timeline=True``; the caller may clear it), else None.

    :meth:`stream` may be called from any number of threads. There is no thread of its
    own: a reader waiting for its next chunk runs the next pass when no other reader is
    running one (leader/follower), so a request alone runs its passes in its own thread
    as the single-request loop does, and an idle scheduler costs nothing.

    Raises:
        GenerationError: an option out of range.
    """

    def __init__(self, decoder: Decoder, *, token_budget: int = TOKEN_BUDGET, prefill_chunk: int = PREFILL_CHUNK,
                 max_batch: int = MAX_BATCH, kv_tokens: int | None = None, max_unread: int = MAX_UNREAD,
                 width_policy=WIDTH_POLICY, timeline: bool = False):
        for name, value in (("token_budget", token_budget), ("prefill_chunk", prefill_chunk),
                            ("max_batch", max_batch), ("max_unread", max_unread)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationError(f"{name} must be an integer ≥ 1, got {value!r}")
        self.width_policy = make_policy(width_policy)
        self.decoder = decoder
        self.engine = decoder.engine
        self.token_budget = token_budget
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.max_unread = max_unread
        dims = decoder.dims
        limit = max_batch * decoder.max_context
        rotary = self.engine.step_room
        if rotary is not None:  # GroupQueryAttention: a pass's key length ≤ the rotary table's rows
            limit = min(limit, dims.max_context + rotary - max(token_budget, prefill_chunk, rotary))
        if kv_tokens is not None:
            if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 2:
                # fewer than 2 holds no request: a prompt token and one new token
                raise GenerationError(f"kv_tokens must be an integer ≥ 2, got {kv_tokens!r}")
            limit = min(limit, kv_tokens) if rotary is not None else kv_tokens
        self.kv_tokens = limit
        layout = self.engine.kv_layout
        # one contiguous region per request where attention skips the key blocks a row cannot see
        regions = layout == "sequence-major" and self.engine.attention_skips > 0
        self.pool = TokenPool(dims, layout, 0, limit, initial=min(limit, 1024), regions=regions,
                              dtype=self.engine.kv_dtype)
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._active: list[_Request] = []
        self._reserved = 0
        self._ids = itertools.count(1)
        self._lead = threading.Lock()  # held by the reader thread that runs the current pass
        self._closing = False
        self.passes = 0
        #: (requests in a pass, rows of the pass) -> passes
        self.pass_shapes: Counter = Counter()
        self.width_steps: Counter = Counter()
        self.width_passes: Counter = Counter()
        self.timeline: list[PassRecord] | None = [] if timeline else None

    # -- requests ---------------------------------------------------------------------------

    def stream(self, prompt_ids, max_new_tokens: int, profile: LookaheadProfile | None = None, *, stop=(),
               cancel=None, timeout_s: float | None = None, sampling: SamplingParams | None = None,
               stop_token_ids=None) -> Iterator[Chunk]:
        """Submit a request; returns its chunks (as :meth:`lade_export.runtime.Decoder.stream`).

        Arguments, chunks and errors as :meth:`lade_export.runtime.Decoder.stream`; the
        request runs in the scheduler's passes. Closing the iterator (or dropping it)
        ends the request at the next pass boundary and frees its KV columns. An error the
        request meets while running (its engine step fails alone, its host work raises)
        is raised from the iterator.

        Raises:
            GenerationError, ProfileError: before any work, as the decoder's; also
                GenerationError when prompt + max_new_tokens exceed the KV pool
                (``kv_tokens``), and after :meth:`close`.
        """
        d = self.decoder
        checked = d.validate(prompt_ids, max_new_tokens, profile, stop, timeout_s, sampling=sampling,
                             stop_token_ids=stop_token_ids)
        prompt = checked.prompt
        need = len(prompt) + checked.max_new_tokens
        if need > self.kv_tokens:
            raise GenerationError(f"prompt + max_new_tokens ({need} tokens) exceed the scheduler's KV pool of "
                                  f"{self.kv_tokens} tokens (kv_tokens); ask for fewer tokens or a larger pool")
        detok = d.tokenizer.detokenizer() if d.tokenizer is not None else None
        text = TextStream(detok, checked.stop)
        rules = StopRules(checked.stop_token_ids, checked.max_new_tokens, text.push if detok is not None else None)
        state = new_state(checked.profile, d.dims.vocab, prompt, rules, checked.sampling)
        stats = GenerationStats(prompt_tokens=len(prompt), decoding=checked.sampling.describe())
        deadline = time.perf_counter() + checked.timeout_s if checked.timeout_s is not None else None
        req = _Request(next(self._ids), prompt, state, text, stats, cancel, deadline, checked.profile.max_step, need)
        with self._cond:
            if self._closing:
                raise GenerationError("the scheduler is closed")
            self._pending.append(req)
            self._cond.notify_all()
        return _RequestChunks(self._chunks(req), req, self._sweep_closed)

    def _chunks(self, req: _Request) -> Iterator[Chunk]:
        try:
            while True:
                item = self._next_item(req)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.final:
                    return
        finally:
            req.closed.set()  # before the lead is tried: a reader that holds it sweeps after its pass
            self._sweep_closed()
            with self._cond:
                self._cond.notify_all()

    def _sweep_closed(self) -> None:
        """Requests whose iterators were closed or dropped leave now, KV columns freed, if no
        pass is running; else the reader running it sweeps when it lets go of the lead (its
        next plan may never come: the pass may be the last anyone waits for). Each gets a
        last chunk, "cancelled", as the next plan would give it (a reader still waiting in
        ``next``, closed from another thread, ends with it)."""
        # checked again after each sweep: a close whose try of the lead met this sweep is swept too
        while self._closed_requests() and self._lead.acquire(blocking=False):
            try:
                gone = self._closed_requests()
                with self._cond:
                    self._pending = [req for req in self._pending if req not in gone]
                for req in gone:
                    self._finish(req, "cancelled", [])
            finally:
                self._lead.release()

    def _closed_requests(self) -> list:
        """Requests waiting or running whose iterators were closed or dropped."""
        with self._cond:
            return [req for req in self._pending + self._active if req.closed.is_set()]

    def _next_item(self, req: _Request):
        """The request's next chunk (or error), running passes while none is there and no
        other reader runs them (leader/follower: the thread that waits works)."""
        while True:
            try:
                return req.out.popleft()
            except IndexError:
                pass
            if self._lead.acquire(blocking=False):
                try:
                    worked = self._iterate()
                finally:
                    self._lead.release()
                    self._sweep_closed()  # streams closed while the pass ran
                    with self._cond:
                        self._cond.notify_all()  # chunks for the others, and the lead is free
                if worked:
                    continue
            with self._cond:  # another reader runs the pass, or every request is paused
                if not req.out:
                    self._cond.wait(timeout=0.005 if not self._lead.locked() else 0.05)

    def generate(self, prompt_ids, max_new_tokens: int, profile: LookaheadProfile | None = None, **kw
                 ) -> GenerationResult:
        """Run a request to its end (arguments as :meth:`stream`)."""
        return collect(self.stream(prompt_ids, max_new_tokens, profile, **kw))

    @property
    def active_requests(self) -> int:
        """Requests admitted and not yet finished (not counting those waiting)."""
        with self._cond:
            return len(self._active)

    def close(self) -> None:
        """Stop serving: requests still running or waiting end with a GenerationError
        (raised by their iterators), later ones are refused."""
        with self._lead:  # after the pass in flight
            with self._cond:
                self._closing = True
                for req in self._pending + self._active:
                    self._send(req, GenerationError("the scheduler was closed while the request ran"))
                    self.pool.release(req.id)
                self._pending.clear()
                self._active.clear()
                self._reserved = 0
                self._cond.notify_all()

    # -- one iteration (run by whichever reader holds the lead) --------------------------------

    def _send(self, req: _Request, item) -> None:
        req.out.append(item)

    def _iterate(self) -> bool:
        """Admit waiting requests, plan and run one pass; False when there was nothing to run."""
        clock = self.timeline is not None
        t0 = time.perf_counter()  # the pass's cost, host work included, is what the width policy weighs
        ended = self._expire_pending()
        with self._cond:
            # a paused request keeps its KV room but not its place: a consumer that reads one stream at a
            # time, in any order, is not left waiting on requests it has not read yet
            running = sum(1 for req in self._active if not self._paused(req))
            while (self._pending and running < self.max_batch
                   and self._reserved + self._pending[0].need <= self.kv_tokens):
                req = self._pending.pop(0)
                self.pool.admit(req.id, req.need)  # its region (an engine that skips masked key blocks)
                self._reserved += req.need
                self._active.append(req)
                running += 1
        items = self._plan()
        if not items:
            return ended
        try:
            self._pass(items, (t0, time.perf_counter(), len(self._pending)) if clock else None, t0)
        except Exception as err:  # a fault of the pass itself: fail its requests, keep serving
            for req, _ in items:
                self._fail(req, err)
        return True

    def _paused(self, req: _Request) -> bool:
        """Whether the request's consumer has ``max_unread`` chunks waiting (its decode steps skipped)."""
        return req.ready and len(req.out) >= self.max_unread

    def _expire_pending(self) -> bool:
        """Requests still waiting for admission that were closed, cancelled or timed out end
        now (a last chunk; they hold no KV room yet), not when they would be admitted.
        Returns whether any ended."""
        ended = []
        with self._cond:
            for req in list(self._pending):
                try:
                    reason = _end_reason(req)
                except Exception as err:  # the request's own cancel event failed
                    reason = err
                if reason is not None:
                    self._pending.remove(req)
                    ended.append((req, reason))
        for req, reason in ended:
            if isinstance(reason, BaseException):
                self._fail(req, reason)
            else:
                self._finish(req, reason, [])
        return bool(ended)

    def _leave(self, req: _Request) -> None:
        with self._cond:
            if req in self._active:
                self._active.remove(req)
                self._reserved -= req.need
        self.pool.release(req.id)

    def _fail(self, req: _Request, err: BaseException) -> None:
        if req.error is None:
            req.error = err
            self._send(req, err if isinstance(err, Exception) else GenerationError(str(err)))
        self._leave(req)

    def _finish(self, req: _Request, reason: str, last_ids: list) -> None:
        stats = req.stats
        now = time.perf_counter()
        stats.decode_s = now - req.t1 if req.t1 is not None else 0.0
        stats.host_s = max(stats.decode_s - req.engine_s, 0.0)
        stats.cache_tokens = req.cache_len
        stats.acceptance_histogram = dict(req.histogram)
        stats.drafts_checked, stats.drafts_accepted = req.state.rule.checked, req.state.rule.accepted
        tail, cut = req.text.finish()
        if cut and reason in ("stop_token", "max_new_tokens"):
            reason = "stop_string"
        self._send(req, Chunk(tail, last_ids, reason, stats))
        self._leave(req)

    def _plan(self) -> list:
        """This pass's items: ``[(request, PackedItem)]`` in row order (see the module docstring)."""
        with self._cond:
            active = list(self._active)
        if not active:
            return []
        start = self.passes % len(active)
        order = active[start:] + active[:start]
        adaptive = getattr(self.width_policy, "adaptive", False)
        steps = []  # requests whose decode step is prepared, in row order
        for req in order:
            if req.closed.is_set():  # a last chunk (a reader still waiting in next() gets it), and out
                self._finish(req, "cancelled", [])
                continue
            if not req.ready or self._paused(req):
                continue
            try:
                reason = _end_reason(req)
                if reason is not None:
                    self._finish(req, reason, [])
                    continue
                if req.t1 is None:
                    req.t1 = time.perf_counter()
            except Exception as err:  # the request's own objects (its cancel event) failed
                self._fail(req, err)
                continue
            if len(steps) == self.max_batch:  # more running than max_batch (paused ones read again): the next pass
                continue
            steps.append(req)
            if self.pool.used == 0:
                # A pass over an empty cache is one request's: ONNX Runtime's GroupQueryAttention
                # takes such a step as a first prompt, with positions 0 … step−1 whatever
                # position_ids say, so a second request's rows would get the wrong positions.
                break
        steps = self._prepare(steps, adaptive)
        if adaptive and steps:
            steps = self._narrow(steps)
        items, rows = [], 0
        for req in steps:
            lay = req.layout
            if items and rows + lay.step > self.token_budget:
                continue  # the next pass
            items.append((req, PackedItem(req.id, lay.input_ids, lay.position_ids, lay.step_mask, lay.logit_rows)))
            rows += lay.step
        budget = self.token_budget if items else self.prefill_chunk
        for req in active:  # arrival order
            if req.ready or req.closed.is_set():
                continue
            try:  # cancelled or timed out while its prompt is prefilled: it leaves now, not after its prefill
                reason = _end_reason(req)
                if reason is not None:
                    self._finish(req, reason, [])
                    continue
            except Exception as err:  # its cancel event failed
                self._fail(req, err)
                continue
            if rows >= budget:
                continue
            if items and self.pool.used == 0:
                break  # see below
            n = min(len(req.prompt) - 1 - req.prefilled, budget - rows)
            ids = np.asarray(req.prompt[req.prefilled:req.prefilled + n], dtype=np.int64)
            pos = np.arange(req.prefilled, req.prefilled + n, dtype=np.int64)
            items.append((req, PackedItem(req.id, ids, pos, np.tril(np.ones((n, n), dtype=bool)),
                                          np.zeros(0, np.int64))))
            rows += n
        return items

    def _prepare(self, steps: list, adaptive: bool) -> list:
        """Prepare every decode step of the pass that is not prepared yet (a step deferred by
        the token budget keeps its layout): its profile's step, once per decode step; with the
        adaptive policy and several steps, a greedy lookahead request whose step could not be
        widened even at its best (:meth:`AdaptiveWidth.worth_preparing`) gets a one-token step
        without its candidates being looked up (one in :data:`PREPARE_EVERY` of such steps is
        prepared anyway, so that its acceptance keeps being measured in hindsight). Returns
        the requests still stepping (one whose ``prepare`` raises fails alone)."""
        policy = self.width_policy
        lean = []  # greedy lookahead requests the policy may leave unprepared
        if adaptive and len(steps) > 1 and hasattr(policy, "worth_preparing"):
            lean = [req for req in steps if req.full is None and hasattr(req.state, "profile")
                    and isinstance(req.state.rule, GreedyRule)]

        def prepared(req) -> bool:  # its profile's step; a request whose prepare raises fails alone
            try:
                req.full = req.state.prepare(req.state.sequence[-1], req.cache_len)
            except Exception as err:  # the request's own state failed
                self._fail(req, err)
                return False
            return True

        kept = [req for req in steps if req.full is not None or req in lean or prepared(req)]
        if lean and len(kept) < 2:  # the others failed: a request alone runs its profile's step
            kept = [req for req in kept if req not in lean or prepared(req)]
            lean = []
        if lean:
            # every greedy lookahead step at its narrowest is one row (a deferred one too); others as prepared
            # (tokens: one per step, a lower bound for a sampled lookahead step: the bar only drops)
            rows = sum(1 if req in lean or isinstance(req.state.rule, GreedyRule) else req.full.step for req in kept)
            deepest = max(candidate_depth(req.state.profile) for req in lean)
            need = policy.preparation_bar(rows, len(kept), self._attended([req.cache_len for req in kept]), deepest)
            for req in lean:
                if req.acceptance is None:
                    req.acceptance = policy.tracker()
                if req.unprepared + 1 >= PREPARE_EVERY or policy.worth_preparing(req.acceptance, req.state.profile,
                                                                                  need):
                    if not prepared(req):
                        kept.remove(req)
                        continue
                    req.unprepared = 0
                else:
                    req.full = StepLayout.single(req.state.sequence[-1], req.cache_len)
                    req.unprepared += 1
        for req in kept:
            req.layout = req.full  # as the pass runs it; the adaptive policy cuts narrower classes later
            req.width = "profile" if hasattr(req.state, "profile") else "one-token"
        return kept

    def _attended(self, cache_lens: list) -> int:
        """The cached tokens a row of this pass attends over, for the step-cost curve's
        ``rows × context`` term: the whole pool when every row's scores span it (the compact
        pool), else (regions on an engine whose attention skips masked key blocks) the mean
        cache length of the pass's requests, since a row then pays its own request's columns
        only."""
        if not self.pool.regions or not cache_lens:
            return self.pool.used
        return int(round(sum(cache_lens) / len(cache_lens)))

    def _narrow(self, steps: list) -> list:
        """The adaptive width policy's choice for this pass: each greedy lookahead
        request's prepared profile step is replaced by the class the policy picks
        (:mod:`lade_export.width_policy`); other requests keep theirs. Returns the
        requests still stepping (one whose narrowed ``prepare`` raises fails alone)."""
        for req in steps:  # the depth of each prepared trie (what the acceptance estimate is per)
            lay = req.full
            req.depth = int(lay.position_ids[lay.trie_base:].max()) - lay.past_len if len(lay.trie_tokens) else 0
            req.menu = ()
            req.widened = None
        policy = self.width_policy
        if len(steps) == 1:  # a request alone keeps its profile's step: what it does without a scheduler
            steps[0].widest = True
            return steps
        menus = []
        for req in steps:
            if req.acceptance is None:
                req.acceptance = policy.tracker()
            lay, state, depth = req.layout, req.state, req.depth
            trie = len(lay.trie_tokens)
            if not hasattr(state, "profile") or not isinstance(state.rule, GreedyRule):
                menus.append([Option(req.width, None, lay.step, req.acceptance.expected(req.width, depth))])
                continue
            if lay.step == 1:  # no window, no candidates (or not prepared): a one-token step is all it has
                menus.append([ONE_TOKEN_OPTION])
                continue
            menu = []
            for width, cap in width_caps(state.profile):
                step = 1 if width == "one-token" else 1 + cap.window * state.levels + trie
                if menu and step <= menu[-1].rows:
                    continue  # no wider than a narrower class: the narrower one stands
                tokens = req.acceptance.expected(width, depth)
                if menu:  # a wider class verifies the same trie: it expects no fewer tokens
                    tokens = max(tokens, menu[-1].tokens)
                menu.append(Option(width, cap, step, tokens))
            menus.append(menu)
        if all(len(menu) == 1 for menu in menus):  # nothing to narrow (greedy, sampled, no candidates)
            picks = [0] * len(menus)
        else:
            picks = policy.choose(menus, self._attended([req.cache_len for req in steps]), self.token_budget,
                                  [req.acceptance for req in steps])
        kept = []
        for req, menu, k in zip(steps, menus, picks):
            opt = menu[k]
            if opt.rows != req.full.step:  # cut from the profile's step, not prepared again
                try:
                    req.layout = narrowed(req.full, opt.cap)
                except Exception as err:  # the request's own state failed
                    self._fail(req, err)
                    continue
            req.width = opt.width
            req.widest = len(menu) > 1 and k == len(menu) - 1
            if k > 0:  # the policy's bet: what it expected of the step beyond its narrowest class
                req.widened = opt.tokens - menu[0].tokens
            if len(req.layout.trie_tokens) < len(req.full.trie_tokens):  # its trie goes unverified: judged later
                req.menu = tuple(o.width for o in menu if o.width != "one-token")
            kept.append(req)
        return kept

    def _pass(self, items: list, clock: tuple | None = None, t0: float | None = None) -> None:
        """Run one packed pass and hand every request its rows (item by item on an engine error).
        ``clock``: ``(start, planned, waiting)`` of a pass the timeline records; ``t0``: when
        its iteration began (its planning: the seconds the width policy observes run from there)."""
        step = sum(it.width for _, it in items)
        self.pool.reserve(step)
        feeds = pack([it for _, it in items], self.pool.owner)
        feeds.update(self.pool.feeds())
        with_logits = any(req.ready and req.state.needs_logits for req, _ in items)
        context = self._attended([req.cache_len for req, _ in items])
        te = time.perf_counter()
        try:
            outputs = self.engine.run(feeds, with_logits=with_logits)
        except Exception as err:
            if len(items) == 1:
                self._fail(items[0][0], err)
            else:
                for item in items:
                    self._pass([item])
            return
        t_engine_end = time.perf_counter()
        engine_s = t_engine_end - te
        self.passes += 1
        self.pass_shapes[len(items), step] += 1
        widths = [req.width for req, _ in items if req.ready]
        decode_rows = sum(it.width for req, it in items if req.ready) if clock is not None else 0
        tokens = 0
        if widths:
            self.width_passes[max(widths, key=WIDTHS.index)] += 1
        kept, done = [], []
        for req, it in items:
            rows = None
            if not req.ready:  # a prompt chunk: every row is kept
                req.prefilled += it.width
                rows = np.arange(it.width)
                if req.ready:
                    req.stats.prefill_s = time.perf_counter() - req.t0
            else:
                req.engine_s += engine_s  # decode passes only: stats.host_s is decode time outside the engine
                length = len(req.state.sequence)
                try:
                    verdict = req.state.update(req.layout, item_outputs(outputs, it))
                except Exception as err:  # this request's host work failed: it alone ends
                    req.layout = req.full = None
                    done.append((req, err))
                    continue
                full, req.layout, req.full = req.full, None, None
                stats = req.stats
                stats.steps += 1
                stats.new_tokens += len(verdict.accepted)
                tokens += len(verdict.accepted)
                req.histogram[len(verdict.accepted)] += 1
                self.width_steps[req.width] += 1
                if req.acceptance is not None and isinstance(req.state.rule, GreedyRule):
                    req.acceptance.observe(req.width, len(verdict.accepted), req.depth, req.widest)
                    observe = getattr(self.width_policy, "observe_widened", None)
                    if req.widened is not None and observe is not None and verdict.stop_reason is None:
                        observe(req.widened, len(verdict.accepted) - 1)  # its bet against what it won (uncut)
                    req.widened = None
                    if req.menu:  # what the classes that verify the whole trie would have accepted
                        req.acceptance.defer(length, full, req.depth, req.menu)
                        req.menu = ()
                    req.acceptance.resolve(req.state.sequence)
                if stats.steps == 1:
                    stats.first_token_s = time.perf_counter() - req.t0
                if verdict.stop_reason is not None:
                    done.append((req, (verdict.stop_reason, verdict.accepted)))
                    continue
                rows = np.arange(it.width) if verdict.kept_rows is None else np.asarray(verdict.kept_rows)
                self._send(req, Chunk(req.text.take(), verdict.accepted))
            kept.append((req.id, it.rows + rows))
            req.cache_len += len(rows)
        t_updated = time.perf_counter() if clock is not None else None
        self.pool.commit(outputs, kept, step)
        for req, why in done:
            if isinstance(why, BaseException):
                self._fail(req, why)
            else:
                self._finish(req, *why)
        if widths and len(widths) == len(items):
            # decode steps only: a point of the step-cost curve, the whole pass (plan, engine, update,
            # commit: a lookahead step's host work is part of what its rows cost), else the engine's run
            self.width_policy.observe_pass(step, context, time.perf_counter() - t0 if t0 is not None else engine_s)
        if clock is not None:
            self.timeline.append(PassRecord(clock[0], clock[1], te, t_engine_end, t_updated, time.perf_counter(),
                                            len(widths), len(items) - len(widths), decode_rows, step - decode_rows,
                                            tokens, clock[2],
                                            threading.get_ident()))
