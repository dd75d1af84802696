"""Prompt sets of the lookahead-decoding paper's workloads (MT-Bench, HumanEval, GSM8K).

Read from ``$LADE_DATASETS``, or ``shared/datasets`` found from the working directory or
beside a source checkout (:func:`datasets_root`), or from any JSONL file with a
``prompt``, ``question`` or ``turns`` field.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from pathlib import Path

from ..errors import GenerationError

DATASET_FILES = {
    "mt_bench": "mt_bench/question.jsonl",
    "humaneval": "humaneval/HumanEval.jsonl.gz",
    "gsm8k": "gsm8k/test.jsonl",
}
#: Where each named workload's file comes from (upstream, under its own license; docs/datasets.md).
DATASET_SOURCES = {
    "mt_bench": "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "humaneval": "https://raw.githubusercontent.com/openai/human-eval/master/data/HumanEval.jsonl.gz",
    "gsm8k": "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl",
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One workload prompt: its id, the user text, the dataset it came from, and where:
    ``path`` (the file) and ``record`` (0-based index among the file's non-blank lines)."""

    id: str
    text: str
    dataset: str
    path: str = ""
    record: int = -1


def datasets_root() -> Path:
    """Folder holding the three datasets: ``$LADE_DATASETS`` when set, else the first of
    ``./shared/datasets`` and ``../shared/datasets`` (from the working directory) and, when
    the package runs from a source checkout, ``shared/datasets`` beside the checkout (in the
    folder that holds it) or inside it — the first that has ``mt_bench/`` in it, else
    ``../shared/datasets``."""
    env = os.environ.get("LADE_DATASETS")
    if env:
        return Path(env)
    here = Path.cwd()
    candidates = [here / "shared" / "datasets", here.parent / "shared" / "datasets"]
    checkout = Path(__file__).resolve().parent.parent.parent
    if (checkout / "pyproject.toml").is_file():  # an installed package has no checkout around it
        candidates += [checkout.parent / "shared" / "datasets", checkout / "shared" / "datasets"]
    for folder in candidates:
        if (folder / "mt_bench").is_dir():
            return folder
    return candidates[1]


def _records(path: Path):
    """JSON records of a JSONL file (gzip-compressed when it ends in ``.gz``); a UTF-8
    byte-order mark at the start (as some Windows editors write) is ignored."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except (ValueError, RecursionError) as err:  # JSONDecodeError, huge ints, deep nesting
                        raise GenerationError(f"{path} line {number}: not JSON ({getattr(err, 'msg', err)})") from None
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as err:  # EOFError, zlib.error: a cut or bad .gz
        raise GenerationError(f"cannot read dataset {path}: {err}") from None


def load_prompts(name: str, limit: int | None = None, chat: bool = True, skip: int = 0) -> list[Prompt]:
    """Prompts of a named dataset (``mt_bench``, ``humaneval``, ``gsm8k``) or a JSONL path.

    ``skip`` drops that many leading records (e.g. to tune on prompts a comparison does
    not use). MT-Bench gives the first turn; GSM8K the question; HumanEval the code to complete,
    prefixed for chat models with an instruction to complete the function.

    Raises:
        GenerationError: unknown name, missing file, or a record without a prompt field.
    """
    if name in DATASET_FILES:
        path = datasets_root() / DATASET_FILES[name]
        label = name
        if not path.is_file():
            files = list(DATASET_FILES.values())
            raise GenerationError(f"dataset {name} not found at {path}"
                                  + (" (from LADE_DATASETS)" if os.environ.get("LADE_DATASETS") else "")
                                  + f"; set LADE_DATASETS to a folder holding {', '.join(files[:-1])} and {files[-1]} "
                                  f"({DATASET_FILES[name]}: {DATASET_SOURCES[name]}; docs/datasets.md lists all three), "
                                  "or give the path of a JSONL file of prompts instead of the name")
    else:
        path = Path(name)
        label = path.stem
    if not path.is_file():
        raise GenerationError(f"dataset not found: {path} (give mt_bench, humaneval or gsm8k, found through "
                              "LADE_DATASETS, or the path of a JSONL file with a prompt field per line)")
    prompts = []
    for i, rec in enumerate(_records(path)):
        if limit is not None and len(prompts) >= limit:
            break
        if i < skip:
            continue
        if not isinstance(rec, dict):
            raise GenerationError(f"{path} record {i}: expected a JSON object")
        if "turns" in rec:
            turns = rec["turns"]
            text, pid = (turns[0] if isinstance(turns, list) and turns else None), rec.get("question_id", i)
        elif "task_id" in rec:
            text, pid = (HUMANEVAL_INSTRUCTION + rec["prompt"]) if chat else rec["prompt"], rec["task_id"]
        elif "question" in rec:
            text, pid = rec["question"], rec.get("id", i)
        elif "prompt" in rec:
            text, pid = rec["prompt"], rec.get("id", i)
        else:
            raise GenerationError(f"{path} record {i}: no prompt, question or turns field")
        if not isinstance(text, str) or not text:
            raise GenerationError(f"{path} record {i}: the prompt must be a non-empty string")
        prompts.append(Prompt(str(pid), text, label, str(path), i))
    if not prompts:
        raise GenerationError(f"dataset {path} has no prompts" + (f" after skipping {skip}" if skip else ""))
    return prompts
