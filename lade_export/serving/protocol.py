"""The served model's contract: tensors, parameters, request parsing, responses.

One request is one generation. Triton calls the model with named input tensors; the
model answers with a stream of responses (decoupled transaction policy), one per decode
step, each holding the step's text and token ids; the last one also holds the stop
reason and the statistics, and carries Triton's final flag. The tables :data:`INPUTS`
and :data:`OUTPUTS` are the single source of the names, Triton data types and shapes:
``config.pbtxt`` is written from them, the model parses with them, the client builds
requests from them, and docs/serving.md lists them (a test keeps the three in step).

Shapes follow Triton's ``max_batch_size: 0`` convention (the dims are the full shape,
no batch dimension): ``[1]`` is one value, ``[-1]`` a variable-length vector.
``TYPE_STRING`` is Triton's BYTES type: UTF-8 text here.

Everything here is plain Python and numpy, so it runs (and is tested) without Triton.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from ..errors import GenerationError, ProfileError, ServingError
from ..sampling import SamplingParams
from ..profile import GREEDY as GREEDY_PROFILE
from ..profile import LookaheadProfile
from ..scheduler import TOKEN_BUDGET, WIDTH_POLICY
from ..width_policy import POLICY_NAMES as WIDTH_POLICIES

#: The profile name that means plain greedy decoding (no lookahead) on the server: the name
#: of :data:`lade_export.profile.GREEDY`.
GREEDY = GREEDY_PROFILE.name


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of the served model.

    Attributes:
        name: the tensor name clients use.
        data_type: Triton's config type (``TYPE_STRING`` is BYTES, UTF-8 here).
        dims: shape without a batch dimension (``-1``: any length).
        optional: inputs only; an optional input may be left out of a request.
        meaning: one line for the docs.
    """

    name: str
    data_type: str
    dims: tuple
    optional: bool
    meaning: str

    @property
    def client_dtype(self) -> str:
        """The datatype string of Triton's clients and wire protocol (``BYTES``, ``INT64`` …)."""
        return {"TYPE_STRING": "BYTES"}.get(self.data_type, self.data_type.removeprefix("TYPE_"))


#: Request tensors. Exactly one of ``prompt`` and ``prompt_token_ids`` must be given.
INPUTS = (
    TensorSpec("prompt", "TYPE_STRING", (1,), True, "prompt text (UTF-8); give this or prompt_token_ids"),
    TensorSpec("prompt_token_ids", "TYPE_INT64", (-1,), True, "prompt token ids, used as given (no chat template)"),
    TensorSpec("chat", "TYPE_BOOL", (1,), True,
               "wrap a text prompt as one user turn in the model's chat template (default: when the model has one)"),
    TensorSpec("parse_special_in_messages", "TYPE_BOOL", (1,), True,
               "read special-token strings (<|im_end|> …) inside a chat-wrapped prompt as control tokens "
               "(default false: they are text)"),
    TensorSpec("max_new_tokens", "TYPE_INT32", (1,), True,
               "new tokens at most, 1 … the model's max_new_tokens_limit (default: default_max_new_tokens)"),
    TensorSpec("profile", "TYPE_STRING", (1,), True,
               "lookahead profile name from the model's list, or greedy (default: the model's default_profile)"),
    TensorSpec("stop", "TYPE_STRING", (-1,), True, "stop strings: the text ends before the first one that appears"),
    TensorSpec("temperature", "TYPE_FP32", (1,), True,
               "sampling temperature (absent or 0: greedy); lookahead keeps plain sampling's distribution"),
    TensorSpec("top_k", "TYPE_INT32", (1,), True, "sample among the k most likely tokens (absent or 0: off)"),
    TensorSpec("top_p", "TYPE_FP32", (1,), True, "nucleus sampling mass (absent or 1: off)"),
    TensorSpec("seed", "TYPE_UINT64", (1,), True, "random seed of the request (same seed, same output on one engine)"),
)

#: Response tensors, present in every response of the stream.
OUTPUTS = (
    TensorSpec("text", "TYPE_STRING", (1,), False,
               "text released by this step (may be empty while a character or a stop string is incomplete)"),
    TensorSpec("token_ids", "TYPE_INT64", (-1,), False, "token ids accepted in this step (a lookahead step may accept several)"),
    TensorSpec("stop_reason", "TYPE_STRING", (1,), False,
               "empty until the last response: stop_token, stop_string, max_new_tokens, cancelled or timeout"),
    TensorSpec("stats", "TYPE_STRING", (1,), False,
               "empty until the last response: JSON statistics (prompt_tokens, new_tokens, steps, "
               "compression_ratio, first_token_s, decode_s, profile, instance, scheduler …)"),
)

#: Optional inputs reserved for later features (none now). Adding optional inputs keeps
#: every existing client working.
RESERVED_INPUTS: tuple = ()


@dataclasses.dataclass
class ServingSettings:
    """The served model's settings, kept as ``parameters`` in ``config.pbtxt``.

    Attributes:
        artifact_dir: the artifact as the server sees it: an absolute path, or a path
            relative to the model's version directory (``REPO/<name>/1``) for a copy.
        backend: ``ort`` or ``tensorrt`` (see :func:`lade_export.load`).
        device: ``cpu`` or ``cuda``.
        threads: engine threads per instance (0: the engine's default, one per core).
        profiles: the profiles clients may name, by name (``greedy`` is always served).
        default_profile: the profile of a request that names none (a key of
            ``profiles``, or ``greedy``).
        max_new_tokens_limit: the largest ``max_new_tokens`` a request may ask for.
        default_max_new_tokens: ``max_new_tokens`` of a request that gives none.
        max_concurrent_requests: requests one instance decodes at once (more wait); with
            ``batching``, the scheduler's ``max_batch`` (requests that share its passes).
        verify: artifact check on load: ``quick``, ``full`` or ``none``.
        batching: run every request of an instance through one
            :class:`lade_export.scheduler.Scheduler` (continuous batching: concurrent
            requests share forward passes, each output equal to its solo run); False: each
            request runs its own passes on the shared engine. The ort backend only.
        token_budget: the scheduler's rows per pass that holds decode steps (a latency
            bound; see :class:`~lade_export.scheduler.Scheduler`); with ``batching`` only.
        kv_tokens: the most tokens the scheduler's KV pool holds over all the instance's
            requests (float32 keys and values, allocated as requests need them); 0: the
            scheduler's default (``max_concurrent_requests`` × the model's context, capped
            on ``group-query-attention`` graphs); with ``batching`` only.
        width_policy: how wide the scheduler makes each request's lookahead step:
            ``adaptive`` (from the step-cost curve and each request's acceptance, the
            default) or ``profile`` (every request's profile at full width, pass after
            pass: steps and tokens per step as when the request runs alone);
            :mod:`lade_export.width_policy`. With ``batching`` only.
    """

    artifact_dir: str
    profiles: dict
    default_profile: str
    backend: str = "ort"
    device: str = "cpu"
    threads: int = 0
    max_new_tokens_limit: int = 512
    default_max_new_tokens: int = 128
    max_concurrent_requests: int = 8
    verify: str = "quick"
    batching: bool = True
    token_budget: int = TOKEN_BUDGET
    kv_tokens: int = 0
    width_policy: str = WIDTH_POLICY

    def __post_init__(self) -> None:
        if GREEDY in self.profiles:
            raise ServingError(f"profile name {GREEDY!r} is reserved: on the server it means plain greedy decoding")
        if self.default_profile != GREEDY and self.default_profile not in self.profiles:
            raise ServingError(f"default profile {self.default_profile!r} is not among the served profiles "
                               f"({', '.join(self.profile_names)})")
        if self.backend not in ("ort", "tensorrt"):
            raise ServingError(f"backend must be ort or tensorrt, got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ServingError(f"device must be cpu or cuda, got {self.device!r}")
        if self.batching and self.backend == "tensorrt":
            raise ServingError("batching needs the ort backend: TensorRT engines' optimization profiles do not cover "
                               "packed passes yet (write the model with --no-batching)")
        for key, low in (("threads", 0), ("max_new_tokens_limit", 1), ("default_max_new_tokens", 1),
                         ("max_concurrent_requests", 1), ("token_budget", 1), ("kv_tokens", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ServingError(f"{key} must be an integer ≥ {low}, got {value!r}")
        if self.width_policy not in WIDTH_POLICIES:
            raise ServingError(f"width_policy must be {' or '.join(WIDTH_POLICIES)}, got {self.width_policy!r}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ServingError(f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds "
                               f"max_new_tokens_limit ({self.max_new_tokens_limit})")
        if self.verify not in ("quick", "full", "none"):
            raise ServingError(f"verify must be quick, full or none, got {self.verify!r}")

    @property
    def profile_names(self) -> list:
        """Names a request may give: the served profiles, then ``greedy``."""
        return [*self.profiles, GREEDY]

    def to_parameters(self) -> dict:
        """``{key: string}`` for ``config.pbtxt``'s ``parameters`` (Triton keeps strings)."""
        return {
            "artifact_dir": self.artifact_dir,
            "backend": self.backend,
            "device": self.device,
            "threads": str(self.threads),
            "profiles": json.dumps({n: p.as_dict() for n, p in self.profiles.items()}, separators=(",", ":")),
            "default_profile": self.default_profile,
            "max_new_tokens_limit": str(self.max_new_tokens_limit),
            "default_max_new_tokens": str(self.default_max_new_tokens),
            "max_concurrent_requests": str(self.max_concurrent_requests),
            "verify": self.verify,
            "batching": "true" if self.batching else "false",
            "token_budget": str(self.token_budget),
            "kv_tokens": str(self.kv_tokens),
            "width_policy": self.width_policy,
        }

    @classmethod
    def from_parameters(cls, params: dict) -> "ServingSettings":
        """Inverse of :meth:`to_parameters`.

        Raises:
            ServingError: a parameter is missing or invalid.
        """
        def integer(key, default):
            raw = params.get(key, str(default))
            try:
                return int(raw)
            except ValueError:
                raise ServingError(f"parameter {key} must be an integer, got {raw!r}") from None

        def flag(key, default):
            raw = params.get(key, "true" if default else "false").strip().lower()
            if raw not in ("true", "false"):
                raise ServingError(f"parameter {key} must be true or false, got {params[key]!r}")
            return raw == "true"

        if "artifact_dir" not in params or "profiles" not in params:
            raise ServingError("config.pbtxt lacks the artifact_dir or profiles parameter; rewrite it with lade-export triton")
        try:
            raw_profiles = json.loads(params["profiles"])
        except json.JSONDecodeError as err:
            raise ServingError(f"parameter profiles is not JSON ({err.msg})") from None
        try:
            profiles = {name: LookaheadProfile.from_dict(p, name=name) for name, p in raw_profiles.items()}
        except ProfileError as err:
            raise ServingError(f"parameter profiles: {err}") from None
        backend = params.get("backend", "ort")
        return cls(
            artifact_dir=params["artifact_dir"],
            profiles=profiles,
            default_profile=params.get("default_profile", next(iter(profiles), GREEDY)),
            backend=backend,
            device=params.get("device", "cpu"),
            threads=integer("threads", 0),
            max_new_tokens_limit=integer("max_new_tokens_limit", 512),
            default_max_new_tokens=integer("default_max_new_tokens", 128),
            max_concurrent_requests=integer("max_concurrent_requests", 8),
            verify=params.get("verify", "quick"),
            batching=flag("batching", backend != "tensorrt"),
            token_budget=integer("token_budget", TOKEN_BUDGET),
            kv_tokens=integer("kv_tokens", 0),
            width_policy=params.get("width_policy", WIDTH_POLICY).strip().lower(),
        )


@dataclasses.dataclass
class Request:
    """A parsed request.

    Attributes:
        prompt: text, or token ids (a list of int).
        chat: apply the chat template (None: when the model has one); text only.
        max_new_tokens: 1 … the model's limit.
        profile: a served profile name or ``greedy``.
        stop: stop strings.
        sampling: :class:`lade_export.sampling.SamplingParams` (temperature 0: greedy).
        parse_special_in_messages: special-token strings in a chat-wrapped text prompt
            are control tokens (default False: they are text).
    """

    prompt: object
    chat: bool | None
    max_new_tokens: int
    profile: str
    stop: list
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    parse_special_in_messages: bool = False

    def stream_kwargs(self, settings: ServingSettings) -> dict:
        """Keyword arguments of :meth:`lade_export.api.Model.stream` (after the prompt):
        the profile object (:data:`lade_export.profile.GREEDY` for ``greedy``) and the
        :class:`~lade_export.sampling.SamplingParams`."""
        return {
            "chat": self.chat,
            "max_new_tokens": self.max_new_tokens,
            "profile": GREEDY_PROFILE if self.profile == GREEDY else settings.profiles[self.profile],
            "sampling": self.sampling,
            "stop": list(self.stop),
            "parse_special_in_messages": self.parse_special_in_messages,
        }


def _text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise GenerationError(f"input {name} is not UTF-8 text (byte {err.start})") from None
    raise GenerationError(f"input {name} must be BYTES (UTF-8 text), got {type(value).__name__}")


def _one(name: str, array: np.ndarray):
    if array.size != 1:
        raise GenerationError(f"input {name} must hold one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def parse_request(get_input, settings: ServingSettings) -> Request:
    """Read a request's tensors.

    Args:
        get_input: ``name -> numpy array or None`` (None: the input is absent); BYTES
            inputs are object arrays of ``bytes``.
        settings: the served model's settings (profiles, limits).

    Returns:
        :class:`Request`.

    Raises:
        GenerationError: no prompt or both prompt inputs, text that is not UTF-8, a
            value of the wrong shape, ``chat`` with token ids, ``max_new_tokens`` out of
            1 … ``max_new_tokens_limit``, an empty stop string.
        ProfileError: a profile the model does not serve.
    """
    text = get_input("prompt")
    ids = get_input("prompt_token_ids")
    if (text is None) == (ids is None):
        raise GenerationError("give exactly one of the inputs prompt (text) and prompt_token_ids")
    chat_in = get_input("chat")
    chat = None if chat_in is None else bool(_one("chat", chat_in))
    if text is not None:
        prompt = _text("prompt", _one("prompt", text))
    else:
        if ids.ndim != 1:
            raise GenerationError(f"input prompt_token_ids must be a vector, got shape {list(ids.shape)}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise GenerationError(f"input prompt_token_ids must be integers, got {ids.dtype}")
        prompt = [int(t) for t in ids]
        if chat:
            raise GenerationError("chat=true needs a text prompt (prompt_token_ids are used as given)")
    limit = settings.max_new_tokens_limit
    mnt_in = get_input("max_new_tokens")
    max_new_tokens = settings.default_max_new_tokens if mnt_in is None else int(_one("max_new_tokens", mnt_in))
    if not 1 <= max_new_tokens <= limit:
        raise GenerationError(f"max_new_tokens must be between 1 and {limit} on this model, got {max_new_tokens}")
    prof_in = get_input("profile")
    profile = settings.default_profile if prof_in is None else _text("profile", _one("profile", prof_in)).strip()
    if not profile:
        profile = settings.default_profile
    if profile not in settings.profile_names:
        raise ProfileError(f"unknown profile {profile!r}; this model serves: {', '.join(settings.profile_names)}")
    stop_in = get_input("stop")
    stop = [] if stop_in is None else [_text("stop", s) for s in stop_in.reshape(-1)]
    if any(s == "" for s in stop):
        raise GenerationError("stop strings must not be empty")
    values = {}
    for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
        given = get_input(name)
        if given is not None:
            values[name] = kind(_one(name, given))
    sampling = SamplingParams(**values)  # GenerationError names a value out of range
    special_in = get_input("parse_special_in_messages")
    special = False if special_in is None else bool(_one("parse_special_in_messages", special_in))
    return Request(prompt, chat, max_new_tokens, profile, stop, sampling, special)


def chunk_outputs(chunk, extra_stats: dict | None = None) -> dict:
    """The response tensors of one streamed chunk (see :data:`OUTPUTS`).

    Args:
        chunk: a :class:`lade_export.runtime.Chunk`.
        extra_stats: merged into the final response's statistics (profile, instance …).

    Returns:
        ``{name: numpy array}``: ``text`` object [1] (UTF-8 bytes), ``token_ids`` int64
        [n], ``stop_reason`` object [1], ``stats`` object [1] (JSON, or empty bytes
        before the last chunk).
    """
    stats = b""
    if chunk.stats is not None:
        stats = json.dumps({**chunk.stats.as_dict(), "stop_reason": chunk.stop_reason, **(extra_stats or {})},
                           separators=(",", ":")).encode()
    return {
        "text": np.array([chunk.text.encode("utf-8")], dtype=np.object_),
        "token_ids": np.asarray(chunk.token_ids, dtype=np.int64).reshape(-1),
        "stop_reason": np.array([(chunk.stop_reason or "").encode()], dtype=np.object_),
        "stats": np.array([stats], dtype=np.object_),
    }
