"""The one-call API: load a built artifact, then generate or stream.

    import lade_export

    model = lade_export.load("artifacts/smollm2")            # ONNX Runtime on the CPU
    result = model.generate("Hi!", max_new_tokens=64)    # chat template applied when the model has one
    print(result.text, result.stats.line())

    for chunk in model.stream("Tell me a story.", max_new_tokens=200, stop=["\\n\\n"]):
        print(chunk.text, end="", flush=True)

A request's decoding is given by two objects, each also accepted spelled out:
``profile=`` (a :class:`~lade_export.profile.LookaheadProfile`, a profile name, or
``"greedy"`` — :data:`lade_export.profile.GREEDY` — for plain greedy decoding; the older
``lookahead=False`` stays an alias of it) and ``sampling=`` (a
:class:`~lade_export.sampling.SamplingParams`, or the flat ``temperature=``, ``top_k=``,
``top_p=``, ``seed=`` keywords, not both). ``stop_token_ids=`` replaces the artifact's
stop ids for one request (``()``: no stop token).

One :class:`Model` serves many requests at once from threads; each request owns its KV
cache and lookahead state. Nothing here imports PyTorch or transformers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from .artifact import Artifact
from .errors import GenerationError
from .profile import LookaheadProfile, request_profile
from .runtime import Chunk, Decoder, GenerationResult, collect
from .sampling import SamplingParams, is_integer_number, shown_value


def load(artifact_dir: str | Path, backend: str = "ort", *, threads: int | None = None, device: str = "cpu",
         verify: str | bool = "quick", dtype: str = "float32", batching: bool = False,
         width_policy: str | None = None, max_batch: int | None = None, token_budget: int | None = None,
         kv_tokens: int | None = None) -> "Model":
    """Open a built artifact and its engine.

    Args:
        artifact_dir: what ``lade-export build --out`` wrote.
        backend: ``"ort"`` (ONNX Runtime), ``"tensorrt"`` (engines built with
            ``--engine tensorrt``), or ``"torch"`` (the PyTorch reference; needs the
            ``export`` extra and the checkpoint named in the manifest).
        threads: engine threads (None: one per core).
        device: ``"cpu"`` or ``"cuda"``.
        verify: ``"quick"`` (sizes, and hashes of the small files), ``"full"`` (the
            weights' sha256 too) or ``"none"``; see :class:`lade_export.artifact.Artifact`.
        dtype: compute dtype of the torch backend (``"float32"``, ``"float16"``,
            ``"bfloat16"``); ONNX Runtime and TensorRT compute in the artifact's precision.
        batching: True runs every request of the model through one
            :class:`lade_export.scheduler.Scheduler` (continuous batching: concurrent
            requests share forward passes; each output equals its unbatched one), with
            its default options (``model.scheduler``); with the tensorrt backend the
            engines need their packed optimization profile (built since it exists).
        width_policy: the scheduler's option of that name (``batching`` only): how wide
            lookahead steps are under load, ``"adaptive"`` or ``"profile"``
            (:mod:`lade_export.width_policy`); None: the scheduler's default.
        max_batch, token_budget, kv_tokens: the scheduler's options of those names
            (``batching`` only): requests in flight at once, rows of a pass that holds
            decode steps, most tokens its KV pool holds; None: the scheduler's defaults.

    Raises:
        ArtifactError: not a build, another schema version, or a damaged file.
        BackendUnavailableError: the backend or device is missing.
        GenerationError: ``dtype`` other than float32 with the ort or tensorrt backend;
            ``batching`` with TensorRT engines whose packed optimization profile is missing
            (built before it existed: rebuild) or smaller than the scheduler's passes;
            ``threads`` not an integer ≥ 1.
    """
    from .backends import open_engine

    if threads is not None and (not is_integer_number(threads) or threads < 1):
        raise GenerationError(f"threads must be an integer ≥ 1 (None: one per core), got {shown_value(threads)}")

    if backend == "torch":  # the PyTorch reference engine is the export side's: importing it registers it
        from . import export  # noqa: F401

    t0 = time.perf_counter()
    artifact = Artifact(artifact_dir, verify=verify)
    tokenizer = artifact.tokenizer()
    engine = open_engine(artifact, backend, threads=threads, device=device, dtype=dtype)
    options = {k: v for k, v in (("width_policy", width_policy), ("max_batch", max_batch),
                                 ("token_budget", token_budget), ("kv_tokens", kv_tokens)) if v is not None}
    try:
        model = Model(artifact, tokenizer, engine, batching=batching, scheduler_options=options)
    except BaseException:  # a refused scheduler option: the engine's sessions are not left to the collector
        engine.close()
        raise
    if batching:  # the scheduler's passes must fit the engine's shapes (TensorRT: its packed profile)
        s = model.scheduler
        try:
            engine.check_batching(s.token_budget, s.prefill_chunk, s.kv_tokens)
        except GenerationError:
            model.close()
            raise
    model.load_s = time.perf_counter() - t0
    return model


class Stream:
    """An iterator of :class:`lade_export.runtime.Chunk` for one request.

    ``for chunk in stream`` yields the text and token ids of each decode step; the last
    chunk carries ``stop_reason`` and ``stats``, and :attr:`result` is then set.
    :meth:`cancel` (from any thread) stops the request before its next step;
    :meth:`close` (or leaving a ``with`` block, or breaking out of the loop and dropping
    the stream) ends it at once and frees its KV cache — called from another thread while
    the reader is inside a step, it cancels instead (the reader then gets the last chunk).
    """

    def __init__(self, start, cancel: threading.Event):
        self._cancel = cancel
        self._chunks = start()
        self._taken: list[Chunk] = []
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        chunk = next(self._chunks)
        self._taken.append(chunk)
        if chunk.final:
            self.result = collect(iter(self._taken))
            self._taken = []
        return chunk

    def cancel(self) -> None:
        """Ask the request to stop before its next step (thread-safe)."""
        self._cancel.set()

    def close(self) -> None:
        """End the request now and free its KV cache; while another thread is inside a step of
        this stream (a generator cannot be closed under its reader), ask it to stop before its
        next step instead, as :meth:`cancel` does."""
        try:
            self._chunks.close()
        except ValueError as err:  # "generator already executing": the reader's thread is in it
            if "already executing" not in str(err):
                raise
            self._cancel.set()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Model:
    """A loaded artifact: tokenizer, engine and decoding loop (see :func:`load`).

    Attributes:
        artifact: the :class:`lade_export.artifact.Artifact`.
        tokenizer: the :class:`lade_export.tokenizer.Tokenizer`.
        decoder: the :class:`lade_export.runtime.Decoder` on the engine.
        scheduler: the :class:`lade_export.scheduler.Scheduler` that runs every request
            (``batching=True``), else None (each request runs its own passes).
        default_profile: the profile used when a request names none (the artifact's;
            None or a profile of ``enabled = false``: plain greedy decoding).
        load_s: seconds :func:`load` took.
    """

    def __init__(self, artifact: Artifact, tokenizer, engine, batching: bool = False,
                 scheduler_options: dict | None = None):
        self.artifact = artifact
        self.tokenizer = tokenizer
        self.engine = engine
        self.decoder = Decoder(engine, artifact.stop_token_ids, artifact.max_context, tokenizer,
                               lookahead_exact=bool(artifact.spec.graph.lookahead_exact))
        self.default_profile = artifact.default_profile()
        self.load_s = 0.0
        self.scheduler = None
        if batching:
            from .scheduler import Scheduler

            self.scheduler = Scheduler(self.decoder, **(scheduler_options or {}))

    def encode(self, prompt, chat: bool | None = None, *, parse_special_in_messages: bool = False) -> list[int]:
        """Prompt token ids.

        Control tokens are parsed only where the caller writes the prompt raw (token ids,
        text with ``chat=False``): special-token strings such as ``<|im_end|>`` inside
        chat messages, or inside text wrapped as a user turn, are tokenized as text, so
        user text cannot forge a turn (docs/embedding.md, *Control tokens*).

        Args:
            prompt: text; a list of chat messages (``[{"role", "content"}]``); or token
                ids (used as given: a list or tuple of Python or numpy integers, or a 1-D
                numpy integer array).
            chat: for text, wrap it as one user turn in the chat template; None: when the
                model has one.
            parse_special_in_messages: bool; True parses special-token strings inside
                chat messages (and wrapped text) as control tokens too.

        Returns:
            list[int]: the prompt ids.

        Raises:
            GenerationError: an empty prompt without BOS, chat asked for without a chat
                template, or a prompt of another type.
        """
        special = bool(parse_special_in_messages)
        if isinstance(prompt, str):
            use_chat = self.tokenizer.has_chat_template if chat is None else chat
            return self.tokenizer.encode_prompt(prompt, chat=use_chat, parse_special_in_messages=special)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(list(prompt), parse_special_in_messages=special)
        if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # a numpy vector of ids
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)) and all(is_integer_number(t) for t in prompt):
            return [int(t) for t in prompt]
        raise GenerationError("prompt must be text, a list of chat messages, or a list of token ids")

    def resolve_profile(self, profile, lookahead: bool = True) -> LookaheadProfile:
        """The profile of a request (:func:`lade_export.profile.request_profile`): the
        model's default for None; ``"greedy"``, a :data:`~lade_export.profile.GREEDY`,
        ``lookahead=False`` or a profile of ``enabled = false`` give
        :data:`~lade_export.profile.GREEDY` (plain greedy decoding); else a shipped name,
        a TOML path, ``W,N,G[,K[,B]]`` or a :class:`~lade_export.profile.LookaheadProfile`.

        Raises:
            ProfileError: the profile is unknown or invalid.
        """
        return request_profile(profile, lookahead=lookahead, default=self.default_profile)

    @staticmethod
    def sampling_params(sampling: SamplingParams | None = None, *, temperature=None, top_k=None, top_p=None,
                        seed=None) -> SamplingParams:
        """The sampling of a request: ``sampling`` as given, else one built from the flat
        keywords (each None: :class:`~lade_export.sampling.SamplingParams`' default).

        Raises:
            GenerationError: ``sampling`` together with a flat keyword, ``sampling`` of
                another type, or a value out of range (SamplingParams' one-line errors).
        """
        flat = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                  ("seed", seed)) if v is not None}
        if sampling is None:
            return SamplingParams(**flat)
        if flat:
            raise GenerationError(f"give sampling= or {', '.join(f'{k}=' for k in flat)}, not both "
                                  "(sampling= holds temperature, top_k, top_p and seed)")
        if not isinstance(sampling, SamplingParams):
            raise GenerationError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        return sampling

    def stream(self, prompt, *, chat: bool | None = None, max_new_tokens: int = 256, profile=None,
               sampling: SamplingParams | None = None, stop=None, stop_token_ids=None, cancel=None,
               timeout_s: float | None = None, lookahead: bool = True, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               parse_special_in_messages: bool = False) -> Stream:
        """Start a request and return its :class:`Stream` of chunks.

        Args:
            prompt, chat, parse_special_in_messages: see :meth:`encode`.
            max_new_tokens: ≥ 1; prompt + new tokens must fit the context.
            profile: the lookahead profile (None: the model's default; ``"greedy"``: plain
                greedy decoding); see :meth:`resolve_profile`.
            sampling: :class:`lade_export.sampling.SamplingParams`, the decoding rule
                (None: greedy, or the flat keywords below): temperature 0 is greedy
                decoding; > 0 samples, with lookahead keeping plain sampling's
                distribution. The same seed gives the same output on the same engine.
            stop: a stop string or a list of them; the text is cut before the first match.
            stop_token_ids: the token ids that end this request, instead of the
                artifact's (``()``: none; None: the artifact's ``stop_token_ids``).
            cancel: an extra ``threading.Event`` that cancels the request when set.
            timeout_s: stop at the first step boundary after this many seconds.
            lookahead: False is plain greedy decoding (an alias of ``profile="greedy"``).
            temperature, top_k, top_p, seed: the fields of ``sampling`` spelled out (give
                these or ``sampling``, not both).

        Raises:
            GenerationError, ProfileError: bad request (before any work).
        """
        params = self.sampling_params(sampling, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = self.encode(prompt, chat, parse_special_in_messages=parse_special_in_messages)
        prof = self.resolve_profile(profile, lookahead)
        stops = [stop] if isinstance(stop, str) else stop  # a list (or iterable) of strings: checked by the runner
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise GenerationError(f"cancel must be a threading.Event (anything with is_set()), got "
                                  f"{type(cancel).__name__}")
        own = threading.Event()
        either = _AnyEvent(own, cancel) if cancel is not None else own
        runner = self.scheduler or self.decoder
        chunks = runner.stream(ids, max_new_tokens, prof, stop=stops, cancel=either, timeout_s=timeout_s,
                               sampling=params, stop_token_ids=stop_token_ids)
        return Stream(lambda: chunks, own)

    def generate(self, prompt, **request) -> GenerationResult:
        """Run a request to the end (keyword arguments as in :meth:`stream`).

        Returns:
            :class:`lade_export.runtime.GenerationResult`: new token ids, text, stop reason, stats.

        Raises:
            GenerationError, ProfileError: bad request (before any work), as :meth:`stream`.
            TypeError: a keyword :meth:`stream` does not take.
        """
        stream = self.stream(prompt, **request)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        """Release the engine (after stopping the scheduler, if any)."""
        if self.scheduler is not None:
            self.scheduler.close()
        self.engine.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AnyEvent:
    """Set when any of the given events is set (``is_set`` only)."""

    def __init__(self, *events):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)
