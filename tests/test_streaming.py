"""Streamed text equals the full decode: a property over random token ids of both real
tokenizers (byte pieces and special tokens included), and non-ASCII answers of SmolLM2
through the API and the CLI."""

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lade_export.detokenize import IncrementalDetokenizer, TextStream
from lade_export.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent

EMOJI = "Write three emoji (😀🚀🎉) and then one short sentence in Japanese about the sea."
THANKS = "What is the Japanese word for \"thank you\"? Write it in Japanese script."


def _ids(vocab: int, byte_lo: int, byte_hi: int, special: list[int]):
    """Random id lists mixing any token, byte pieces and special tokens."""
    one = st.one_of(st.integers(0, vocab - 1), st.integers(byte_lo, byte_hi), st.sampled_from(special))
    return st.lists(one, max_size=48)


def _pieces(tok, ids, skip=True):
    detok = IncrementalDetokenizer(tok, skip)
    return [detok.push(t) for t in ids] + [detok.flush()]


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    return Tokenizer(stories_dir / "tokenizer.json", bos_token_id=1)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=_ids(512, 3, 258, [0, 1, 2]), skip=st.booleans())
def test_stories_chunks_concatenate_to_the_full_decode(stories_tokenizer, ids, skip):
    assert len(stories_tokenizer.byte_fallback_ids) == 256
    assert "".join(_pieces(stories_tokenizer, ids, skip)) == stories_tokenizer.decode(ids, skip)


def test_complete_characters_are_released_before_an_incomplete_one(stories_tokenizer):
    tok = stories_tokenizer
    ids = tok.encode("The café 😀 sea", add_special_tokens=False)
    pieces = _pieces(tok, ids)
    assert "".join(pieces) == "The café 😀 sea"
    assert "\ufffd" not in "".join(pieces[:-1])  # nothing incomplete was ever shown
    emoji_bytes = [i for i in ids if i in tok.byte_fallback_ids]
    assert len(emoji_bytes) == 4  # 😀 is four byte pieces in this vocabulary
    assert all(p == "" for p in pieces[ids.index(emoji_bytes[0]): ids.index(emoji_bytes[-1]) + 1])


def test_stop_string_hold_back_never_shows_part_of_a_stop(stories_tokenizer):
    tok = stories_tokenizer
    ids = tok.encode("She said: the end. Then more.", add_special_tokens=False)
    stream = TextStream(IncrementalDetokenizer(tok), stop=["the end", "xyz"])
    shown = []
    hit_at = None
    for i, t in enumerate(ids):
        if stream.push(t):
            hit_at = i
            break
        shown.append(stream.take())
    tail, _ = stream.finish()
    assert "".join(shown) + tail == "She said: "
    assert "the end" in tok.decode(ids[: hit_at + 1]) and "the end" not in tok.decode(ids[:hit_at])


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_artifact):
    from lade_export.artifact import Artifact

    return Artifact(smollm2_artifact).tokenizer()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=_ids(49152, 0, 300, [0, 1, 2]), skip=st.booleans())
def test_smollm2_chunks_concatenate_to_the_full_decode(smollm2_tokenizer, ids, skip):
    assert "".join(_pieces(smollm2_tokenizer, ids, skip)) == smollm2_tokenizer.decode(ids, skip)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [EMOJI, THANKS], ids=["emoji", "thank-you"])
def test_non_ascii_answers_stream_the_text_generate_returns(smollm2_artifact, prompt):
    import lade_export

    model = lade_export.load(smollm2_artifact)
    result = model.generate(prompt, max_new_tokens=80)
    assert any(ord(ch) > 0x2FFF for ch in result.text)  # the answer has CJK or emoji characters
    assert result.text == model.tokenizer.decode(result.token_ids)
    for profile in (None, "default"):
        stream = model.stream(prompt, max_new_tokens=80, profile=profile, lookahead=profile is not None)
        chunks = list(stream)
        assert "".join(c.text for c in chunks) == result.text
        assert stream.result.token_ids == result.token_ids
    cli = subprocess.run([sys.executable, str(ROOT / "cli.py"), "generate", str(smollm2_artifact), "--max-new-tokens",
                          "80", "--prompt", prompt], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == result.text + "\n"
