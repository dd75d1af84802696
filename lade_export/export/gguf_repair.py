"""Repair GGUF metadata that transformers' GGUF loader rejects.

Some converters write ``0xFFFFFFFF`` (−1 as uint32) for an absent special token, e.g.
``tokenizer.ggml.padding_token_id`` in llama2.c's ``stories260K.gguf``. transformers
passes that id to ``nn.Embedding(padding_idx=…)``, which fails. We copy the file and
rewrite each out-of-range special-token id in place to the EOS id (the usual pad
choice), leaving tensors untouched. GGUF spec: github.com/ggml-org/ggml docs/gguf.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_SPECIAL_KEYS = (
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.separator_token_id",
    "tokenizer.ggml.cls_token_id",
    "tokenizer.ggml.mask_token_id",
)


def _bad_fields(reader):
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else None
    bad = []
    for key in _SPECIAL_KEYS:
        field = reader.fields.get(key)
        if field is None or vocab is None:
            continue
        value = int(field.parts[field.data[0]][0])
        if not 0 <= value < vocab:
            bad.append((key, field, value))
    return bad, vocab


def gguf_needing_repair(path: Path) -> list[str]:
    """Names of special-token fields in ``path`` whose id lies outside the vocabulary."""
    from gguf import GGUFReader

    bad, _ = _bad_fields(GGUFReader(str(path), "r"))
    return [key for key, _, _ in bad]


def repaired_gguf_copy(path: Path, workdir: Path) -> Path:
    """Copy ``path`` into ``workdir`` and set out-of-range special-token ids to the EOS id
    (or 0 if EOS itself is invalid). Returns the copy's path; the original is not touched."""
    from gguf import GGUFReader

    target = Path(workdir) / Path(path).name
    shutil.copyfile(path, target)
    reader = GGUFReader(str(target), "r+")
    bad, vocab = _bad_fields(reader)
    eos_field = reader.fields.get("tokenizer.ggml.eos_token_id")
    eos = int(eos_field.parts[eos_field.data[0]][0]) if eos_field is not None else 0
    replacement = eos if 0 <= eos < vocab else 0
    for _, field, _ in bad:
        field.parts[field.data[0]][0] = replacement
    reader.data.flush()
    del reader
    return target
