"""Per-request acceptance of each width class, for the adaptive width policy
(:mod:`lade_export.width_policy`).

Per request and width class, the chance ``α`` that a candidate token is accepted once its
prefix was, estimated from the request's recent steps of that class — the steps it ran at
that class, and, in hindsight, the steps that were narrowed below it: a greedy request's
continuation is the same whatever widths its steps had, so once its next tokens are known,
the trie a one-token step left unverified is scored with what verifying it would have
accepted (:meth:`Acceptance.resolve`), measuring wide steps' acceptance without spending
their rows — exponentially decayed (memory ≈ 10 steps) and shrunk toward the estimate over
every request's recent steps of the class (itself starting from
:data:`lade_export.width_policy.PRIOR_ACCEPT`). A step whose trie is ``D`` tokens deep is
then expected to accept ``1 + α + … + α^D`` tokens (this step's trie: a request with a long
history match is worth more rows than one with a 1-token pool guess). A one-token step,
or a step with no candidates, accepts exactly 1.

The estimate is myopic: it credits a step with the tokens it accepts, not with the n-grams
its window rows add to the pool for later steps; the window classes verify the same trie
as ``candidates``, so they expect the same tokens for more rows, and the adaptive policy
feeds window rows only at exploration steps or where rows cost nothing. (The CPU
profiles' windows are W ≤ 1 anyway: their tokens come mostly from history lookup and the
pool's verified n-grams, which every accepted token still feeds.)
"""

from __future__ import annotations


class Acceptance:
    """One request's recent acceptance per width class.

    Model: each candidate token of the trie's deepest path is accepted, given the tokens
    before it were, with probability ``α`` (per request and class), so a step whose trie
    is ``D`` tokens deep accepts ``1 + α + α² + … + α^D = 1 + α·(1 − α^D)/(1 − α)`` tokens
    in expectation. ``α`` is the maximum-likelihood estimate of that geometric model over
    the request's recent steps (exponentially decayed: extra tokens accepted over extra
    tokens accepted plus rejections, a step that accepted all ``D`` having no rejection),
    shrunk toward the pooled estimate over every request's recent steps of the class
    (itself starting from :data:`lade_export.width_policy.PRIOR_ACCEPT`).

    Args:
        policy: the :class:`~lade_export.width_policy.AdaptiveWidth` whose pooled estimates
            are the prior (its ``memory``, ``prior_steps`` and ``explore_every`` too).
    """

    __slots__ = ("policy", "sums", "since_widest", "pending")

    def __init__(self, policy):
        self.policy = policy
        self.sums: dict = {}  # class -> [decayed extra tokens accepted, decayed rejections]
        self.since_widest = policy.explore_every  # steps since its widest class ran (a new request: due)
        self.pending: list = []  # [(sequence length, layout, depth, classes)] of tries not verified (hindsight)

    @property
    def due(self) -> bool:
        """Whether the request's next step should be its widest (exploration, see
        :class:`~lade_export.width_policy.AdaptiveWidth`)."""
        every = self.policy.explore_every
        return every > 0 and self.since_widest >= every

    def rate(self, width: str) -> float:
        """``α`` of class ``width``: the chance a candidate token is accepted after its prefix was."""
        s, f = self.sums.get(width, (0.0, 0.0))
        w = self.policy.prior_steps
        return (s + w * self.policy.pooled(width)) / (s + f + w)

    def expected(self, width: str, depth: int) -> float:
        """Expected tokens of a step of class ``width`` whose trie is ``depth`` tokens deep
        (exactly 1 for ``one-token`` or an empty trie)."""
        if width == "one-token" or depth <= 0:
            return 1.0
        a = min(self.rate(width), 0.999)
        return 1.0 + a * (1.0 - a ** depth) / (1.0 - a)

    def observe(self, width: str, tokens: int, depth: int, widest: bool = False) -> None:
        """A step of class ``width`` with a trie ``depth`` deep accepted ``tokens`` tokens;
        ``widest``: it was the widest of the request's classes that pass."""
        self.since_widest = 0 if widest else self.since_widest + 1
        self._fold(width, tokens, depth)

    def defer(self, length: int, layout, depth: int, widths) -> None:
        """A greedy step ran narrower than the trie it had: ``layout`` (its profile step,
        whose trie is ``depth`` tokens deep) was prepared when the sequence held ``length``
        tokens, and the classes ``widths`` would have verified that trie. What they would
        have accepted is known once the tokens after ``length`` are (:meth:`resolve`)."""
        if depth > 0 and widths:
            self.pending.append((length, layout, depth, tuple(widths)))

    def resolve(self, sequence: list) -> None:
        """Fold in, for every deferred trie whose outcome ``sequence`` now decides, the
        tokens a step verifying it would have accepted: greedy verification accepts, after
        the step's last token, the trie path that equals the greedy continuation (which
        ``sequence`` is, whatever widths the steps had), so a step would have accepted 1 +
        the length of the trie path matching ``sequence[length:]``. Decided when the path
        meets a token it does not match, or when ``depth`` tokens matched. This is the
        acceptance of the wider classes measured without spending their rows."""
        if not self.pending:
            return
        n, keep = len(sequence), []
        for length, layout, depth, widths in self.pending:
            node, matched, decided = -1, 0, False
            for token in sequence[length:length + depth]:
                child = next((c for t, c in layout.children(node) if t == token), None)
                if child is None:
                    decided = True
                    break
                node, matched = child, matched + 1
            if decided or matched >= depth or n >= length + depth:
                for width in widths:
                    self._fold(width, 1 + matched, depth)
            else:
                keep.append((length, layout, depth, widths))
        self.pending = keep

    def _fold(self, width: str, tokens: int, depth: int) -> None:
        if width == "one-token" or depth <= 0:
            return
        extra = min(max(tokens - 1, 0), depth)
        rejected = 1.0 if extra < depth else 0.0
        d = self.policy.memory
        s, f = self.sums.get(width, (0.0, 0.0))
        self.sums[width] = [d * s + extra, d * f + rejected]
        self.policy.observe_pooled(width, extra, rejected)
