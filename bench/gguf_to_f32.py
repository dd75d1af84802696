"""Write an F32 GGUF holding the dequantized weights of a quantized GGUF, for the llama.cpp peers.

    python bench/gguf_to_f32.py [SRC.gguf] OUT.gguf      (SRC default: the Q4_1 file shipped for SmolLM2)

Every tensor is dequantized to float32 with the ``gguf`` package (``gguf.quants.dequantize``:
the same values transformers' GGUF loader gives our float32 engine), names and shapes kept;
every metadata key is copied as it is (tokenizer, chat template, hyper-parameters) except
``general.file_type``, which becomes 0 (all F32). llama.cpp then runs exactly the weights our
engine runs, in float32, so its greedy output can be compared with ours like for like and its
lookahead example takes the F32 batched matrix path rather than the 4-bit one.

Writes to a temporary sibling and renames it into place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np


def convert(src: Path, out: Path) -> None:
    """Dequantize ``src`` into ``out`` (see module doc). Raises ValueError for a non-GGUF ``src``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(f".{out.name}.tmp")
    writer = GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        if name == "general.file_type":
            writer.add_uint32(name, 0)  # LLAMA_FTYPE_ALL_F32
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for t in reader.tensors:
        # GGUF lists dimensions fastest first; numpy wants them slowest first
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        from lade_export.export.model_source import builtin_smollm2_path

        src, out = builtin_smollm2_path(), Path(argv[0])
    elif len(argv) == 2:
        src, out = Path(argv[0]), Path(argv[1])
    else:
        print("usage: python bench/gguf_to_f32.py [SRC.gguf] OUT.gguf", file=sys.stderr)
        return 2
    convert(src, out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, F32) from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
