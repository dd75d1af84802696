"""Streaming text out of token ids: UTF-8-safe incremental detokenization and stop strings.

A character can span several tokens (byte-level BPE pieces, SentencePiece byte
fallback): decoding a prefix of the ids then ends in U+FFFD. The
:class:`IncrementalDetokenizer` decodes a short window of recent ids, releases only text
that no later token can change, and holds back an incomplete character until it is
complete; whatever is still held back is released by :meth:`~IncrementalDetokenizer.flush`.
The concatenated pieces equal ``tokenizer.decode(all ids)`` (same tokenizer, same
``skip_special_tokens``), and the work per token is bounded by the window, so a whole
stream costs time linear in its length.

Method (the two-offset window of streaming servers such as Hugging Face's
text-generation-inference, extended to release complete characters early): ``prefix``
marks where the window starts, ``read`` the first token whose text is not yet known to
be final. Each push decodes ``ids[prefix:]`` and releases what goes beyond the text
already known for the window, minus a trailing U+FFFD run. Both the known text and the
new decode start at the same token, which keeps decoders that depend on context (a
SentencePiece leading space, stripped at the start of a decode) correct.

:class:`TextStream` adds stop strings on top: it releases text only when no stop string
can still begin inside it, and reports the token at which one completes.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids, pushed one at a time, into text pieces.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...) -> str``
            (:class:`lade_export.tokenizer.Tokenizer`).
        skip_special_tokens: as in ``decode``.

    Complete characters before an incomplete one are released at once; only the
    incomplete tail (decoded as U+FFFD) waits for the token that completes it. With a
    byte-fallback tokenizer (``tokenizer.byte_fallback_ids``), a run of byte pieces
    decodes as a whole — to its UTF-8 text, or to one U+FFFD per byte when the run is
    not valid UTF-8 — so the text of a run is held back until a non-byte token ends it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.byte_ids = getattr(tokenizer, "byte_fallback_ids", frozenset())
        # skipped special tokens vanish before the decoder runs, so they do not end a byte run
        self.transparent = getattr(tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
        self._in_run = False
        self.ids: list[int] = []
        self.prefix = 0  # window start (token index)
        self.read = 0  # tokens before this index decode to completed text
        self._known = ""  # decode(ids[prefix:read]) + what was released of the window since
        self._released: list[str] = []  # every piece, for the rare fallback path

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        """Add one token id; return the text that became final (possibly "")."""
        self.ids.append(int(token))
        if token in self.byte_ids or (self._in_run and token in self.transparent):
            self._in_run = True
            return ""  # inside a byte run: its text is known only when the run ends
        self._in_run = False
        text = self._decode(self.ids[self.prefix:])
        complete = not text.endswith(REPLACEMENT)
        stable = text if complete else text.rstrip(REPLACEMENT)
        if stable.startswith(self._known):
            piece = stable[len(self._known):]
        else:  # the window's decode changed its start (not seen with LLaMA tokenizers): use the full text
            piece = self._full_delta(complete)
        self._known += piece
        if piece:
            self._released.append(piece)
        if complete:  # every id so far decodes to final text: move the window up
            newest = self._decode(self.ids[self.read:])
            if newest:  # never start a window at tokens that decode to nothing (a later leading space could be stripped)
                self.prefix, self._known = self.read, newest
            self.read = len(self.ids)
        return piece

    def _full_delta(self, complete: bool) -> str:
        full = self._decode(self.ids)
        if not complete:
            full = full.rstrip(REPLACEMENT)
        done = "".join(self._released)
        return full[len(done):] if full.startswith(done) else ""

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character stays U+FFFD, as in the
        full decode). Call once, at the end of the stream."""
        text = self._decode(self.ids[self.prefix:])
        piece = text[len(self._known):] if text.startswith(self._known) else self._full_delta(True)
        self.prefix = self.read = len(self.ids)
        self._known = ""
        self._in_run = False
        if piece:
            self._released.append(piece)
        return piece


class TextStream:
    """Text of a generation, released piece by piece, cut before the first stop string.

    Args:
        detokenizer: an :class:`IncrementalDetokenizer` (or None: no text, no stop strings).
        stop: stop strings; the generation ends as soon as the text contains one, also
            when it spans tokens. Empty strings are ignored.

    :meth:`push` is the per-token callback of :class:`lade_export.lookahead.StopRules`.
    Text is held back while its end could still be the start of a stop string, so the
    released pieces never contain any part of a stop string that later completes.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | None, stop=()):
        self.detok = detokenizer
        self.stop = tuple(s for s in (stop or ()) if s)
        self.pending = ""  # decoded, not released
        self.ready: list[str] = []  # released, not yet taken
        self.stopped = False

    def push(self, token: int) -> bool:
        """Add one token; True when a stop string completed with it (the stream is then cut)."""
        if self.detok is None or self.stopped:
            return False
        self.pending += self.detok.push(token)
        return self._scan(final=False)

    def _scan(self, final: bool) -> bool:
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.ready.append(self.pending[: min(hits)])
            self.pending = ""
            self.stopped = True
            return True
        keep = 0 if final else self._partial_stop_suffix()
        cut = len(self.pending) - keep
        if cut > 0:
            self.ready.append(self.pending[:cut])
            self.pending = self.pending[cut:]
        return False

    def _partial_stop_suffix(self) -> int:
        """Length of the longest end of ``pending`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if s.startswith(self.pending[-n:]):
                    best = n
                    break
        return best

    def take(self) -> str:
        """Text released since the last call."""
        out = "".join(self.ready)
        self.ready.clear()
        return out

    def finish(self) -> tuple[str, bool]:
        """End of the generation: flush held-back text (cut at a stop string found in it).

        Returns:
            ``(text released since the last take, whether a stop string cut it)``.
        """
        hit = False
        if self.detok is not None and not self.stopped:
            self.pending += self.detok.flush()
            hit = self._scan(final=True)
        return self.take(), hit
