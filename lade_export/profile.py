"""Lookahead profiles: the validated (W, N, G) value and its TOML files.

A profile names the three knobs of lookahead decoding (Fu, Bailis, Stoica, Zhang,
"Break the Sequential Dependency of LLM Inference Using Lookahead Decoding",
arXiv 2402.02057):

* ``W`` (window) — lookahead window width: positions decoded in parallel per level;
* ``N`` (ngram) — n-gram size; the window keeps N−1 Jacobi levels and every
  verification candidate holds N−1 tokens;
* ``G`` (guesses) — at most G candidates in the verification branch per step;
* ``K`` (lookup, optional, default 0) — one more candidate of up to K tokens: what
  followed the latest earlier occurrence of the sequence's suffix in the prompt or the
  output so far (prompt-lookup style). 0 keeps the paper's algorithm unchanged.
  ``lookup_branches`` (default 1) takes that many such continuations, from distinct
  earlier occurrences (shorter for weaker suffix matches; see
  :class:`lade_export.ngram.HistoryIndex`); ``lookup_min_match`` (1–3, default 1) is the
  shortest suffix match that proposes one at all — 2 drops the one-token matches, whose
  ≤ 2-token guesses rarely pay for a wider step on engines where any multi-token step
  costs twice a one-token step (int4 with float32 compute).

One decode step then feeds at most ``1 + (W + G)·(N−1) + K·branches`` tokens: the last
accepted token, the W×(N−1) window and the verification branch (candidates sharing a
prefix share its tokens, as a trie). ``W = 0`` drops the Jacobi window: a step holds the
last token and the candidates only (pool n-grams seeded from the prompt and the accepted
output, history lookup), and is a one-token step whenever no candidate applies — the shape
that pays on engines whose multi-token steps cost much more than a one-token step (int4
with float32 compute). ``N = 1`` is not a lookahead profile; plain greedy decoding is its
own mode.

Plain greedy decoding (no lookahead) is spelled one way in the package: :data:`GREEDY`, a
profile named ``greedy`` (``profile="greedy"`` where a profile is given by name). Users'
older spellings stay accepted — ``lookahead=False``, a profile of ``enabled = false``
(what ``tune`` writes when no profile beats greedy), and None at the decoder, which has no
default profile of its own — and :func:`request_profile` alone turns each of them into
:data:`GREEDY` (the decoder does it once per request, for itself and the scheduler), and
past it the package tests ``profile is GREEDY``.

TOML layout (``profiles/default.toml`` in the repository, shipped with the package)::

    name = "default"          # optional, defaults to the file stem
    description = "..."       # optional
    [lookahead]
    window = 5                # W ≥ 0
    ngram = 4                 # N ≥ 2
    guesses = 5               # G ≥ 0
    lookup = 0                # K ≥ 0, optional
    lookup_branches = 1       # ≥ 1, optional
    lookup_min_match = 1      # 1..3, optional
    seed_pool_from_prompt = true   # optional
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from .errors import ProfileError

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")
_LOOKAHEAD_KEYS = {"window", "ngram", "guesses", "lookup", "lookup_branches", "lookup_min_match", "enabled",
                   "seed_pool_from_prompt"}
_TOP_KEYS = {"name", "description", "lookahead"}


@dataclasses.dataclass(frozen=True)
class LookaheadProfile:
    """A validated lookahead configuration (W, N, G).

    Attributes:
        window: W, lookahead window width (≥ 0; 0: no Jacobi window).
        ngram: N, n-gram size (≥ 2); the window has N−1 levels.
        guesses: G, maximum verification candidates per step (≥ 0).
        name: a short label used in manifests, engine file names and reports.
        seed_pool_from_prompt: whether the n-gram pool starts with the prompt's own n-grams.
        lookup: K, tokens of a history-lookup candidate (≥ 0; 0 disables it).
        lookup_branches: history-lookup candidates per step (≥ 1).
        lookup_min_match: shortest suffix match (tokens, 1–3) that proposes a history
            candidate.
        enabled: False makes this the plain greedy setting (what ``tune`` writes when no
            profile beats greedy on the machine); W, N, G are then ignored, and a request
            decodes with :data:`GREEDY` (:func:`request_profile`).

    Raises:
        ProfileError: on construction, if a value is not an int or out of range.
    """

    window: int
    ngram: int
    guesses: int
    name: str = "custom"
    seed_pool_from_prompt: bool = True
    lookup: int = 0
    lookup_branches: int = 1
    enabled: bool = True
    lookup_min_match: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ProfileError(
                f"profile name {self.name!r} must be letters, digits, '.', '_' or '-' (it names engine files)"
            )
        for key, low in (("window", 0), ("ngram", 2), ("guesses", 0), ("lookup", 0), ("lookup_branches", 1),
                         ("lookup_min_match", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProfileError(f"profile {self.name!r}: {key} must be an integer, got {value!r}")
            if value < low:
                letter = {"window": "W", "ngram": "N", "guesses": "G", "lookup": "K", "lookup_branches": "B",
                          "lookup_min_match": "M"}[key]
                raise ProfileError(f"profile {self.name!r}: {key} ({letter}) must be ≥ {low}, got {value}")
        for key in ("lookup_branches", "lookup_min_match"):
            if getattr(self, key) != 1 and self.lookup == 0:
                raise ProfileError(f"profile {self.name!r}: {key} applies to history lookup, which is off "
                                   f"(lookup = 0); set lookup (K) ≥ 1 or drop {key}")
        if self.lookup_min_match > 3:
            raise ProfileError(f"profile {self.name!r}: lookup_min_match (M) must be 1, 2 or 3 (the longest suffix "
                               f"match the history index keeps), got {self.lookup_min_match}")
        if not isinstance(self.enabled, bool):
            raise ProfileError(f"profile {self.name!r}: enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.seed_pool_from_prompt, bool):
            raise ProfileError(
                f"profile {self.name!r}: seed_pool_from_prompt must be true or false, got {self.seed_pool_from_prompt!r}"
            )

    @property
    def levels(self) -> int:
        """N − 1: Jacobi levels in the window, and tokens per verification candidate."""
        return self.ngram - 1

    @property
    def max_step(self) -> int:
        """Largest decode-step length in tokens: 1 + (W + G)·(N−1) + K·B (1 when disabled)."""
        if not self.enabled:
            return 1
        return 1 + (self.window + self.guesses) * self.levels + self.lookup * self.lookup_branches

    @property
    def max_logit_rows(self) -> int:
        """Rows of logits a decode step reads: the last token, the W last-level window
        positions and every verification token, 1 + W + G·(N−1) + K·B (1 when disabled)."""
        if not self.enabled:
            return 1
        return 1 + self.window + self.guesses * self.levels + self.lookup * self.lookup_branches

    def check_fits(self, max_context: int) -> None:
        """Raise :class:`ProfileError` when the largest step does not fit ``max_context`` tokens."""
        if self.enabled and self.max_step >= max_context:
            raise ProfileError(
                f"profile {self.name!r}: its largest step ({self.max_step} tokens) does not fit the model's context "
                f"of {max_context} tokens"
            )

    def as_dict(self) -> dict:
        """Plain-dict form for manifests and reports (includes the derived ``max_step``)."""
        return {
            "name": self.name,
            "window": self.window,
            "ngram": self.ngram,
            "guesses": self.guesses,
            "lookup": self.lookup,
            "lookup_branches": self.lookup_branches,
            "lookup_min_match": self.lookup_min_match,
            "enabled": self.enabled,
            "seed_pool_from_prompt": self.seed_pool_from_prompt,
            "max_step": self.max_step,
        }

    @classmethod
    def from_dict(cls, data: dict, name: str = "custom") -> "LookaheadProfile":
        """Inverse of :meth:`as_dict` (``max_step`` is ignored, it is derived). With
        ``enabled = false`` (plain greedy) window, ngram and guesses may be left out.

        Raises:
            ProfileError: a key is missing or a value is invalid.
        """
        off = data.get("enabled", True) is False  # plain greedy: the shape may be left out
        try:
            return cls(
                window=data.get("window", 1) if off else data["window"],
                ngram=data.get("ngram", 2) if off else data["ngram"],
                guesses=data.get("guesses", 0) if off else data["guesses"],
                lookup=data.get("lookup", 0),
                lookup_branches=data.get("lookup_branches", 1),
                lookup_min_match=data.get("lookup_min_match", 1),
                enabled=data.get("enabled", True),
                name=data.get("name", name),
                seed_pool_from_prompt=data.get("seed_pool_from_prompt", True),
            )
        except KeyError as err:
            raise ProfileError(f"profile {name!r}: missing key {err.args[0]!r}") from None

    def to_toml(self, description: str = "", comments: str = "") -> str:
        """Render as TOML text that :func:`load_profile` reads back to an equal profile.

        ``comments`` lines are emitted as ``#`` comments at the top (measurements, provenance).
        """
        lines = [f"# {line}" if line else "#" for line in comments.splitlines()]
        lines.append(f'name = "{self.name}"')
        if description:
            lines.append(f'description = "{description}"')
        lines += [
            "",
            "[lookahead]",
            f"window = {self.window}     # W: lookahead window width",
            f"ngram = {self.ngram}      # N: n-gram size (N-1 Jacobi levels)",
            f"guesses = {self.guesses}    # G: verification candidates per step",
            f"lookup = {self.lookup}     # K: tokens of a history-lookup candidate (0: off)",
            f"lookup_branches = {self.lookup_branches}  # history-lookup candidates per step",
            f"lookup_min_match = {self.lookup_min_match}  # shortest suffix match that proposes a candidate (1-3)",
            f"enabled = {'true' if self.enabled else 'false'}  # false: plain greedy decoding",
            f"seed_pool_from_prompt = {'true' if self.seed_pool_from_prompt else 'false'}",
            f"# max step = 1 + (W + G)*(N - 1) + K*branches = {self.max_step} tokens",
            "",
        ]
        return "\n".join(lines)


#: Plain greedy decoding, no lookahead: one token per step (with sampling parameters of
#: temperature > 0, plain sampling). The one spelling of it in the package;
#: :func:`request_profile` turns every other spelling into this object.
GREEDY = LookaheadProfile(window=1, ngram=2, guesses=0, name="greedy", enabled=False)


def request_profile(value=None, *, lookahead: bool = True, default: LookaheadProfile | None = None) -> LookaheadProfile:
    """The profile a request decodes with, every spelling of plain greedy decoding turned
    into :data:`GREEDY` (the one place that knows them).

    Args:
        value: None (the default below); ``"greedy"``; a shipped profile name, a TOML
            path or an inline ``W,N,G[,K[,B]]`` (:func:`resolve_profile`); or a
            :class:`LookaheadProfile`. A profile of ``enabled = false`` is plain greedy.
        lookahead: False means plain greedy decoding whatever ``value`` says (the
            older spelling ``lookahead=False``).
        default: the profile for ``value`` None (a model's default profile); None: plain
            greedy (a decoder has no default profile).

    Returns:
        :data:`GREEDY` for plain greedy decoding, else an enabled :class:`LookaheadProfile`.

    Raises:
        ProfileError: the value names no profile, the profile is invalid, or ``lookahead``
            is not a bool.
    """
    if not isinstance(lookahead, bool):
        raise ProfileError(f"lookahead must be True or False, got {lookahead!r}")
    if not lookahead:
        return GREEDY
    chosen = default if value is None else resolve_profile(value)
    if chosen is None or not chosen.enabled:
        return GREEDY
    return chosen


def load_profile(path: str | Path) -> LookaheadProfile:
    """Read and validate a profile TOML file.

    Raises:
        ProfileError: file missing or unreadable, TOML syntax error (with line and column),
            unknown keys, missing keys, or invalid values.
    """
    path = Path(path)
    if path.is_dir():
        raise ProfileError(f"profile path is a directory, not a TOML file: {path}")
    if not path.is_file():
        raise ProfileError(f"profile file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"cannot read profile {path}: {err}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"{path}: TOML syntax error: {err}") from None
    except (ValueError, RecursionError) as err:  # an integer over Python's digit limit, nesting too deep
        raise ProfileError(f"{path}: unreadable TOML: {err}") from None
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{path}: unknown key(s) {', '.join(unknown)}; expected name, description, [lookahead]")
    section = data.get("lookahead")
    if not isinstance(section, dict):
        raise ProfileError(f"{path}: missing [lookahead] table with window, ngram, guesses")
    unknown = sorted(set(section) - _LOOKAHEAD_KEYS)
    if unknown:
        raise ProfileError(
            f"{path}: unknown key(s) in [lookahead]: {', '.join(unknown)}; expected {', '.join(sorted(_LOOKAHEAD_KEYS))}"
        )
    name = data.get("name", path.stem)
    try:
        return LookaheadProfile.from_dict(section, name=name)
    except ProfileError as err:
        raise ProfileError(f"{path}: {err}") from None


def bundled_profiles_dir() -> Path:
    """Folder of the profiles shipped with the package (``default``, ``small``, …): the
    repository's ``profiles/``, installed as ``lade_export/profiles/`` (pyproject.toml maps
    it there); in a source checkout or an editable install, ``profiles/`` beside the package."""
    package = Path(__file__).resolve().parent
    installed = package / "profiles"
    return installed if installed.is_dir() else package.parent / "profiles"


def bundled_profile_names() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in bundled_profiles_dir().glob("*.toml"))


def resolve_profile(value: str | Path) -> LookaheadProfile:
    """Accept ``"greedy"`` (:data:`GREEDY`), a TOML path, the name of a shipped profile
    (:func:`bundled_profile_names`: ``default``, ``small``, ``paper`` …), or an inline
    ``W,N,G``, ``W,N,G,K`` or ``W,N,G,K,B``; a :class:`LookaheadProfile` is returned as it is.

    Raises:
        ProfileError: nothing matches, the profile is invalid, or ``value`` is of another type.
    """
    if isinstance(value, LookaheadProfile):
        return value
    if not isinstance(value, (str, Path)):
        raise ProfileError(f"profile must be a name, a TOML path, W,N,G[,K[,B]], \"greedy\" or a LookaheadProfile, "
                           f"got {type(value).__name__} {value!r}")
    text = str(value)
    if text == GREEDY.name:
        return GREEDY
    if not text.strip():
        raise ProfileError("empty profile: give a TOML path, a shipped name "
                           f"({', '.join(bundled_profile_names())}), W,N,G[,K[,B]], or 'greedy' for plain greedy "
                           "decoding")
    path = Path(text)
    if path.is_file() or path.is_dir():
        return load_profile(path)  # a directory: refused there, by name
    bundled = bundled_profiles_dir() / f"{text}.toml"
    if _NAME.match(text) and bundled.is_file():
        return load_profile(bundled)
    parts = text.split(",")
    if len(parts) in (3, 4, 5) and all(p.strip().lstrip("-").isdigit() for p in parts):
        values = [int(p) for p in parts]
        w, n, g, k, b = values + [0, 1][len(values) - 3:]
        name = f"w{w}n{n}g{g}" + (f"k{k}" if len(parts) >= 4 else "") + (f"b{b}" if len(parts) == 5 else "")
        try:
            return LookaheadProfile(w, n, g, name=name, lookup=k, lookup_branches=b)
        except ProfileError as err:  # name what the user typed, not the generated name
            internal = f"profile {name!r}:"
            if not str(err).startswith(internal):
                raise
            raise ProfileError(f"profile {text!r}:{str(err)[len(internal):]}") from None
    if "," in text and not text.endswith(".toml"):
        raise ProfileError(f"inline profile {text!r} must be 3 to 5 comma-separated integers: W,N,G[,K[,B]]")
    raise ProfileError(f"profile file not found: {text} (give a TOML path, a shipped name ({', '.join(bundled_profile_names())}), "
                       f"W,N,G[,K[,B]], or {GREEDY.name!r} for plain greedy decoding)")
