"""Side-by-side comparison runs: plain greedy, lookahead profiles and optional peers
(transformers, llama.cpp; see :mod:`lade_export.evaluation.peers`) on the same prompts, interleaved
prompt by prompt.

Interleaving means machine drift (thermal, other load) hits every configuration alike.
Every lookahead configuration's output is checked token for token against plain greedy
on the same engine; the transformers prompt-lookup peer is checked against the
transformers greedy peer (or against the engine's greedy when that peer is absent), and
llama.cpp's lookahead against llama.cpp's greedy (as text).

Under sampling (temperature > 0) the baseline is plain sampling on the same engine
(configuration ``sampling``), each prompt gets its own seed (``seed + prompt index``),
outputs cannot match token for token (the exact column reads n/a and nothing fails on a
mismatch), and the speedup is the ratio of decode tokens per second.

A run is a :class:`Comparison` (:func:`run_compare` runs one): each prompt becomes a
:class:`PromptCase` (its ids, token budget and seed), every configuration on it one
:class:`RunRecord`. Outputs in ``--out``: ``results.jsonl`` (one record per prompt ×
configuration), ``summary.md`` and ``summary.csv`` (per dataset × configuration),
``speedup.png``, written by :mod:`lade_export.evaluation.report` (its names are importable
from here as well).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..errors import GenerationError
from ..profile import GREEDY
from .datasets import load_prompts
from .peer_output import PeerOutput
from .report import (BASELINES, GREEDY_BASELINE, SAMPLING_BASELINE, environment, plot_summary, render_markdown,
                     summarize, write_outputs)

__all__ = ["BASELINES", "GREEDY_BASELINE", "SAMPLING_BASELINE",
           "Comparison", "ExtraEngine", "PromptCase", "RunRecord", "SkippedRecord",
           "environment", "fit_prompts", "open_extra_engines", "plot_summary", "render_markdown", "run_compare",
           "summarize", "write_outputs"]


@dataclasses.dataclass
class RunRecord:
    """One prompt × configuration. Times in seconds; ``exact`` against the reference greedy
    (None under sampling: outputs are not comparable token for token)."""

    dataset: str
    prompt_id: str
    config: str
    prompt_tokens: int
    new_tokens: int
    steps: int
    prefill_s: float
    decode_s: float
    acceptance_histogram: dict
    exact: bool | None
    reference: str
    token_ids: list
    host_s: float = 0.0
    text: str | None = None  # peers that print text only (llama.cpp): their output; token_ids is then empty

    @classmethod
    def of_generation(cls, case: PromptCase, config: str, result, exact: bool | None, reference: str) -> RunRecord:
        """The record of one of our generations (a :class:`lade_export.runtime.GenerationResult`)."""
        s = result.stats
        return cls(case.dataset, case.prompt_id, config, len(case.ids), len(result.token_ids), s.steps, s.prefill_s,
                   s.decode_s, s.as_dict()["acceptance_histogram"], exact, reference, list(result.token_ids), s.host_s)

    @classmethod
    def of_peer(cls, case: PromptCase, name: str, out: PeerOutput, exact: bool | None, reference: str) -> RunRecord:
        """The record of one peer generation (no acceptance histogram, no host time)."""
        return cls(case.dataset, case.prompt_id, name, len(case.ids), out.new_tokens, out.steps, out.prefill_s,
                   out.decode_s, {}, exact, reference, list(out.token_ids or []), text=out.text)

    def as_json(self) -> dict:
        """The record as one line of ``results.jsonl``: its fields and ``compression_ratio``
        (new tokens per forward pass)."""
        d = dataclasses.asdict(self)
        d["compression_ratio"] = self.new_tokens / self.steps if self.steps else 0.0
        return d


@dataclasses.dataclass(frozen=True)
class SkippedRecord:
    """A dataset record left out of a run because it does not fit the model's context.

    Attributes:
        path: the dataset file; record: its 0-based record index; prompt_id: the record's id.
        prompt_tokens: the prompt's length in tokens (chat template included when used).
        context: the artifact's declared context, tokens.
        reason: the runtime's own refusal (:meth:`lade_export.runtime.Decoder.check_request`).
    """

    path: str
    record: int
    prompt_id: str
    prompt_tokens: int
    context: int
    reason: str

    def line(self) -> str:
        """One line for stderr and the summaries."""
        return (f"skipped {self.path} record {self.record} (id {self.prompt_id}), it does not fit the context: "
                f"{self.reason}")


def fit_prompts(decoder, tokenizer, prompts, chat: bool) -> tuple[list, list]:
    """Encode ``prompts`` and split them into those that fit the context and those that do not.

    A record fits when the runtime accepts it with at least one new token
    (``decoder.check_request(prompt_tokens, 1)``); its generations are then capped at what
    the context leaves (``min(max_new_tokens, context − prompt_tokens)``).

    Args:
        decoder: the :class:`lade_export.runtime.Decoder` that will run them.
        tokenizer: its tokenizer; ``chat`` wraps prompts in the chat template.
        prompts: :class:`lade_export.evaluation.datasets.Prompt` objects.

    Returns:
        ``(kept, skipped)``: ``[(prompt, token_ids)]`` in order, and :class:`SkippedRecord` objects.
    """
    kept, skipped = [], []
    for prompt in prompts:
        ids = tokenizer.encode_prompt(prompt.text, chat)
        try:
            decoder.check_request(len(ids), 1)
        except GenerationError as err:
            skipped.append(SkippedRecord(prompt.path or prompt.dataset, prompt.record, prompt.id, len(ids),
                                         decoder.max_context, str(err)))
            continue
        kept.append((prompt, ids))
    return kept, skipped


def _continuation_text(tokenizer, prompt_ids: list, new_ids: list) -> str:
    """Text of ``new_ids`` as it continues the prompt, special tokens rendered (decoded with
    the prompt and the prompt's text cut off, so a leading space that a tokenizer drops at
    the start of a text is kept, as llama.cpp prints it)."""
    whole = tokenizer.decode(list(prompt_ids) + list(new_ids), skip_special_tokens=False)
    head = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new_ids, skip_special_tokens=False)


class ExtraEngine(NamedTuple):
    """Another artifact of the same model (e.g. its int4 build beside the float32 one) run
    on the same prompts in the same loop.

    Attributes:
        label: prefix of its configurations (``"LABEL greedy"``, ``"LABEL PROFILE"``).
        decoder: its :class:`lade_export.runtime.Decoder`.
        profiles: the lookahead profiles run on it, each checked against its own greedy.
    """

    label: str
    decoder: object
    profiles: list


@dataclasses.dataclass(frozen=True)
class PromptCase:
    """One prompt as every configuration of a run gets it.

    Attributes:
        dataset: the dataset's label (its name, or the JSONL file's stem).
        prompt_id: the record's id.
        ids: prompt token ids (chat template applied where the run uses it).
        budget: new tokens at most, ``min(max_new_tokens, context − len(ids))``.
        sampling: this prompt's :class:`lade_export.sampling.SamplingParams` (seed
            ``sampling.seed + prompt index``) under sampling, else None (greedy).
    """

    dataset: str
    prompt_id: str
    ids: list
    budget: int
    sampling: object | None


class Comparison:
    """One interleaved ``compare`` run: for each prompt that fits the context, the baseline
    (greedy, or plain sampling) and every profile on the engine under test, then each extra
    engine the same way, then every peer; one :class:`RunRecord` per prompt × configuration.

    Args:
        decoder: a :class:`lade_export.runtime.Decoder` on the engine under test.
        tokenizer: its tokenizer; ``chat`` wraps prompts in the chat template.
        profiles: lookahead profiles.
        max_new_tokens: per generation (cut to what the context leaves).
        peers: a :class:`lade_export.evaluation.peers.Peers` (set up by the caller), or None.
        progress: optional ``callable(advance_by)``, advanced once per record (and by every
            configuration of a prompt left out).
        sampling: :class:`lade_export.sampling.SamplingParams` (None or temperature 0: greedy).
        extra_engines: :class:`ExtraEngine` or ``(label, decoder, profiles)`` tuples.

    Attributes:
        records: every :class:`RunRecord` so far, in run order.
        skipped: the :class:`SkippedRecord` of each record left out so far.
    """

    def __init__(self, decoder, tokenizer, chat: bool, profiles: list, max_new_tokens: int, peers=None, progress=None,
                 sampling=None, extra_engines=()):
        self.decoder, self.tokenizer, self.chat = decoder, tokenizer, chat
        self.profiles = list(profiles)
        clash = next((p.name for p in self.profiles if p.name in BASELINES), None)
        if clash is not None:  # its records would merge with the baseline's
            raise GenerationError(f"profile {clash!r} is the name of the baseline every comparison runs; compare "
                                  "lookahead profiles against it")
        self.max_new_tokens = max_new_tokens
        self.peers = peers
        self.progress = progress
        self.sampling = sampling
        self.extra_engines = [ExtraEngine(*extra) for extra in extra_engines]
        self.sampled = sampling is not None and not sampling.greedy
        self.baseline = SAMPLING_BASELINE if self.sampled else GREEDY_BASELINE
        self.stop_ids = sorted(decoder.stop_token_ids)
        self.records: list[RunRecord] = []
        self.skipped: list[SkippedRecord] = []
        self._prompts_run = 0

    @property
    def configurations(self) -> int:
        """Records one prompt gives: every engine's baseline and profiles, and every peer."""
        peers = len(self.peers.names) if self.peers is not None else 0
        return 1 + len(self.profiles) + sum(1 + len(extra.profiles) for extra in self.extra_engines) + peers

    def run(self, datasets: list[str], limit: int) -> tuple[list[RunRecord], list[SkippedRecord]]:
        """Run every dataset (names or JSONL paths, see
        :func:`lade_export.evaluation.datasets.load_prompts`), ``limit`` prompts each.

        Returns:
            ``(records, skipped)``, as :attr:`records` and :attr:`skipped`.
        """
        for dataset in datasets:
            self.run_dataset(dataset, limit)
        return self.records, self.skipped

    def run_dataset(self, dataset: str, limit: int) -> None:
        """The first ``limit`` prompts of ``dataset``; those that do not fit the context are
        left out (:func:`fit_prompts`)."""
        prompts = load_prompts(dataset, limit=limit, chat=self.chat)
        kept, left_out = fit_prompts(self.decoder, self.tokenizer, prompts, self.chat)
        self.skipped += left_out
        if left_out:
            self._advance(len(left_out) * self.configurations)
        for prompt, ids in kept:
            self.run_prompt(prompt, ids)

    def run_prompt(self, prompt, ids: list) -> None:
        """Every configuration on one prompt (a :class:`lade_export.evaluation.datasets.Prompt`
        and its token ids), in the order of :class:`Comparison`."""
        case = self._case(prompt, ids)
        base = self._run_engine(case, self.decoder, "", self.profiles)
        for extra in self.extra_engines:
            self._run_engine(case, extra.decoder, extra.label, extra.profiles)
        if self.peers is not None:
            self._run_peers(case, prompt.text, base.token_ids)

    def _case(self, prompt, ids: list) -> PromptCase:
        params = None
        if self.sampled:
            params = dataclasses.replace(self.sampling, seed=(self.sampling.seed or 0) + self._prompts_run)
        self._prompts_run += 1
        budget = min(self.max_new_tokens, self.decoder.max_context - len(ids))
        return PromptCase(prompt.dataset, prompt.id, ids, budget, params)

    def _run_engine(self, case: PromptCase, engine, tag: str, profiles: list):
        """The baseline on ``engine``, then each profile checked against it; returns the
        baseline's :class:`lade_export.runtime.GenerationResult`."""
        own = f"{tag} {self.baseline}" if tag else self.baseline
        ref = engine.generate(case.ids, case.budget, GREEDY, sampling=case.sampling)
        self._add(RunRecord.of_generation(case, own, ref, None if self.sampled else True, own))
        for profile in profiles:
            res = engine.generate(case.ids, case.budget, profile, sampling=case.sampling)
            exact = None if self.sampled else res.token_ids == ref.token_ids
            self._add(RunRecord.of_generation(case, f"{tag} {profile.name}" if tag else profile.name, res, exact, own))
        return ref

    def _run_peers(self, case: PromptCase, prompt_text: str, base_ids: list) -> None:
        text = self.tokenizer.render_chat([{"role": "user", "content": prompt_text}]) if self.chat else prompt_text
        runs = self.peers.run_prompt(text, case.ids, case.budget, self.stop_ids, self.baseline, base_ids,
                                     lambda: _continuation_text(self.tokenizer, case.ids, base_ids), case.sampling)
        for name, out, reference, exact in runs:
            self._add(RunRecord.of_peer(case, name, out, exact, reference))

    def _add(self, record: RunRecord) -> None:
        self.records.append(record)
        self._advance(1)

    def _advance(self, n: int) -> None:
        if self.progress:
            self.progress(n)


def run_compare(decoder, tokenizer, chat: bool, datasets: list[str], profiles: list, limit: int, max_new_tokens: int,
                peers=None, progress=None, sampling=None, extra_engines=()) -> tuple[list[RunRecord], list[SkippedRecord]]:
    """Run the baseline (greedy, or plain sampling), every profile and every peer on each
    prompt, interleaved (a :class:`Comparison` run once).

    Records that do not fit the context are skipped (:func:`fit_prompts`) and returned
    beside the runs; the others generate up to ``min(max_new_tokens, context − prompt)``
    tokens.

    Args:
        decoder: a :class:`lade_export.runtime.Decoder` on the engine under test.
        tokenizer: its tokenizer; ``chat`` wraps prompts in the chat template.
        datasets: names or JSONL paths (see :func:`lade_export.evaluation.datasets.load_prompts`).
        profiles: lookahead profiles.
        limit: prompts per dataset; max_new_tokens: per generation.
        peers: a :class:`lade_export.evaluation.peers.Peers` (set up by the caller), or None.
        progress: optional ``callable(advance_by)``.
        sampling: :class:`lade_export.sampling.SamplingParams` (None or temperature 0:
            greedy); prompt ``i`` of the run samples with seed ``sampling.seed + i``.
        extra_engines: :class:`ExtraEngine` or ``(label, decoder, profiles)`` tuples: more
            artifacts of the same model (e.g. its int4 and int8 builds) run on the same
            prompts in the same loop, as configurations ``"LABEL greedy"`` and
            ``"LABEL PROFILE"``; each lookahead configuration is checked against its own
            engine's greedy output.

    Returns:
        ``(records, skipped)``: every :class:`RunRecord` in run order, and the
        :class:`SkippedRecord` of each record left out.

    Raises:
        GenerationError: a dataset cannot be read (:func:`lade_export.evaluation.datasets.load_prompts`),
            or a profile is named as a baseline (``greedy``, ``sampling``: its records would merge).
    """
    comparison = Comparison(decoder, tokenizer, chat, profiles, max_new_tokens, peers=peers, progress=progress,
                            sampling=sampling, extra_engines=extra_engines)
    return comparison.run(datasets, limit)


def open_extra_engines(paths, artifact_dir, artifact, profiles, open_model) -> list:
    """Other builds of the same model (``lade-export compare --also``) opened as
    :class:`ExtraEngine` entries, each measured with its own default profile, or with the
    compared ``profiles`` when its default is greedy (none when its graph is not lookahead-exact).

    Args:
        paths: the other builds' directories (:class:`pathlib.Path`).
        artifact_dir, artifact: the compared build's directory and opened
            :class:`lade_export.artifact.Artifact`.
        profiles: the compared lookahead profiles.
        open_model: ``open_model(path)`` → :class:`lade_export.api.Model`.

    Returns:
        ``[ExtraEngine]``, labelled by precision (by folder name where that repeats).

    Raises:
        GenerationError: a build of another model than ``artifact`` (other dims).
    """
    others = []
    for path in paths:
        other = open_model(path)
        dims = other.artifact.dims
        if dims != artifact.dims:
            raise GenerationError(f"--also {path} is a build of another model ({other.artifact.spec.source.model}: "
                                  f"{dims.num_layers} layers, vocab {dims.vocab}) than {artifact_dir} "
                                  f"({artifact.dims.num_layers} layers, vocab {artifact.dims.vocab})")
        label = other.artifact.spec.graph.precision
        if label in [o.label for o in others] or label == artifact.spec.graph.precision:
            label = path.name
        default = other.artifact.default_profile()
        use = [] if not other.decoder.lookahead_exact else [default] if default is not None and default.enabled else \
            [p for p in profiles if p.enabled]  # a greedy default: still measure the compared profiles there
        others.append(ExtraEngine(label, other.decoder, use))
    return others
