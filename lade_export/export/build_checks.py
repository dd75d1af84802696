"""The build's checks on real inputs, and the prompts they use: the tokenizer the runtime
reads against transformers' (:func:`save_tokenizer`), the graph against transformers' own
model on both sides of every rope threshold (:func:`transformers_parity`), the verdicts on
ONNX Runtime-vs-PyTorch parity cases (:func:`raise_on_parity`,
:func:`reduced_precision_parity`), and the prompt ids of the parity check and of the
quantization quality report. Run by
:func:`lade_export.export.build.build_artifact` (and :mod:`lade_export.export.check`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckFailedError
from .parity import PARITY_MAX_ABS, check_parity

#: The fixed real prompt of the build's parity check.
PARITY_PROMPT = "Once upon a time, a curious engineer wanted to make a small language model decode faster."
#: Text that extends the parity prompt to the lengths of the transformers parity check (repeated as needed).
REFERENCE_TEXT = (
    " She wrote down every step the model took, one token after another, and counted how often the next word was "
    "easy to guess. The old lighthouse keeper said that a long story is only many short ones in a row, so she "
    "tried reading three words ahead. Some days the guesses were right and the work went twice as fast; on other "
    "days the sea was grey, the numbers were stubborn, and she began again from the first line with a cup of tea."
)


def parity_prompt_ids(tokenizer, chat: bool) -> list[int]:
    """Token ids of the fixed real prompt used for the build's parity check."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PARITY_PROMPT}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(PARITY_PROMPT).input_ids)


def reference_token_ids(tokenizer, prompt_ids: list[int], count: int) -> list[int]:
    """``count`` real token ids for the transformers parity check: the parity prompt, then
    :data:`REFERENCE_TEXT` (tokenized without special tokens) repeated as needed."""
    more = list(tokenizer(REFERENCE_TEXT, add_special_tokens=False).input_ids) or [0]
    ids = list(prompt_ids)
    while len(ids) < count:
        ids += more
    return ids[:count]


#: Texts on which the runtime tokenizer must give transformers' ids (plain and chat).
TOKENIZER_SAMPLES = ("Once upon a time", "Hello, world! Don't  stop.\n\tTabs, ünïcödé, 日本語 and 😀🚀.", "  leading spaces",
                     "<s> looks special </s>")


def save_tokenizer(hf_tokenizer, folder: Path) -> dict:
    """Save the tokenizer for the runtime and check that the runtime reads it right.

    Writes ``folder/tokenizer.json`` (and transformers' own files beside it), then
    encodes :data:`TOKENIZER_SAMPLES` — plain, and as one chat turn when there is a chat
    template — with :class:`lade_export.tokenizer.Tokenizer` and with transformers.

    Returns:
        the manifest's ``tokenizer`` section (without ``files``): ``dir``, ``file``,
        ``chat_template`` (text or None), ``special_tokens``, ``checked_samples``.

    Raises:
        ModelSourceError: the checkpoint has only a slow (Python) tokenizer.
        CheckFailedError: the runtime tokenizer's ids differ from transformers' (naming the sample).
    """
    from ..errors import ModelSourceError
    from ..tokenizer import Tokenizer

    hf_tokenizer.save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ModelSourceError("the checkpoint has no fast tokenizer (tokenizer.json); lade-export's runtime needs one")
    template = getattr(hf_tokenizer, "chat_template", None)
    template = template if isinstance(template, str) and template else None
    special = {k: v for k, v in hf_tokenizer.special_tokens_map.items() if isinstance(v, str)}
    ours = Tokenizer(folder / "tokenizer.json", template, special, hf_tokenizer.bos_token_id)
    for text in TOKENIZER_SAMPLES:
        if ours.encode(text) != list(hf_tokenizer(text).input_ids):
            raise CheckFailedError(f"the runtime tokenizer encodes {text!r} differently from transformers")
        if template is not None:
            ref = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)
            ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
            if ours.encode_prompt(text, chat=True) != ref:
                raise CheckFailedError(f"the runtime's chat template gives other ids than transformers for {text!r}")
    return {"dir": folder.name, "file": f"{folder.name}/tokenizer.json", "chat_template": template,
            "special_tokens": special, "checked_samples": len(TOKENIZER_SAMPLES)}


def transformers_parity(loaded, onnx_path: Path, plan, dims, prompt_ids: list[int], threads=None, engine=None) -> dict:
    """Compare the graph with transformers' model at the lengths of
    :func:`lade_export.export.rope.reference_lengths` (both sides of every rope threshold).

    Returns:
        the manifest's ``parity.transformers`` section.

    Raises:
        CheckFailedError: a length beyond max |Δlogit| 1e-3 or with another argmax (one line
            naming the length, the rope type and the declared context).
    """
    import transformers

    from .parity import check_against_transformers
    from .rope import reference_lengths

    lengths = reference_lengths(plan, len(prompt_ids))
    token_ids = reference_token_ids(loaded.tokenizer, prompt_ids, max(lengths))
    cases = check_against_transformers(loaded.model, onnx_path, dims, token_ids, lengths, threads=threads,
                                       engine=engine)
    bad = [c for c in cases if not c.ok()]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"parity check (ONNX graph vs transformers) failed at {c.label} of {c.tokens} tokens with rope type "
            f"{plan.rope_type!r} (declared context {dims.max_context}): max |Δlogit| {c.max_abs:.3g}, argmax equal "
            f"{c.argmax_equal}")
    return {"reference": f"transformers {transformers.__version__} {type(loaded.model).__name__}",
            "bounds": {"max_abs": PARITY_MAX_ABS, "argmax": "identical"}, "lengths": lengths,
            "cases": [c.as_dict() for c in cases]}


def quality_prompts(tokenizer, chat: bool, count: int = 4) -> tuple[list[list[int]], str]:
    """Prompt ids for the quantization quality report: the first MT-Bench questions when the
    datasets are at hand, else the build's parity prompt.

    Returns:
        ``(ids, label)``: one id list per prompt, and what they are in words (the manifest's
        ``quantization.quality.prompts``; without the datasets it says how to point at them).
    """
    from ..evaluation.datasets import datasets_root, load_prompts
    from ..errors import GenerationError

    try:
        texts = [p.text for p in load_prompts("mt_bench", limit=count, chat=chat)]
        label = f"the first {len(texts)} MT-Bench questions"
    except GenerationError as err:
        texts = [PARITY_PROMPT]
        root = datasets_root()
        why = (f"MT-Bench not found under {root}: set LADE_DATASETS to the datasets folder"
               if not (root / "mt_bench" / "question.jsonl").is_file() else f"MT-Bench unreadable: {err}")
        label = f"the build's parity prompt ({why})"
    out = []
    for text in texts:
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        else:
            out.append(list(tokenizer(text).input_ids))
    return out, label


def raise_on_parity(cases, what: str = "ONNX Runtime vs PyTorch") -> None:
    """Raise on the first of ``cases`` (:class:`lade_export.export.parity.ParityCase`) past
    the float32 bounds.

    Raises:
        CheckFailedError: one line naming the case, its step and past, and its differences.
    """
    bad = [c for c in cases if not c.ok()]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"parity check ({what}) failed at {c.label} (step {c.step}, past {c.past}): max |Δlogit| {c.max_abs:.3g}, "
            f"relative {c.rel:.3g}, argmax equal {c.argmax_equal}, KV max |Δ| {c.kv_max_abs:.3g}"
        )


def reduced_precision_parity(step, graph: Path, prompt_ids, profile, precision: str, max_abs: float,
                              max_rel: float) -> dict:
    """ONNX Runtime on the reduced-precision graph vs the float32 PyTorch step: every case
    within ``max_abs``/``max_rel`` (max |Δlogit| / max |logit|) with equal argmax at every
    row (bfloat16: not run; ONNX Runtime has no bfloat16 CPU kernels).

    Raises:
        CheckFailedError: a case beyond the bounds, or with another argmax.
    """
    if precision == "bf16":
        return {"checked": False, "reason": "ONNX Runtime has no bfloat16 CPU kernels; lade-export check compares the "
                                            "engines with PyTorch on the GPU"}
    cases = check_parity(step, graph, prompt_ids, profile)
    bad = [c for c in cases if not c.ok(max_abs=max_abs, max_rel=max_rel)]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"parity check ({precision} graph vs float32 PyTorch) failed at {c.label} (step {c.step}, past {c.past}): "
            f"max |Δlogit| {c.max_abs:.3g}, relative {c.rel:.3g} (bound {max_rel:g}), argmax equal {c.argmax_equal}")
    return {"checked": True, "max_rel_bound": max_rel,
            "cases": [{"label": c.label, "step": c.step, "past": c.past, "max_abs": c.max_abs, "rel": c.rel,
                       "argmax_equal": c.argmax_equal, "kv_max_abs": c.kv_max_abs} for c in cases]}
