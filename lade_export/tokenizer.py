"""The runtime's tokenizer: Hugging Face ``tokenizers`` for text ↔ ids and jinja2 for the
chat template, read from an artifact without transformers.

The build saves the checkpoint's ``tokenizer.json`` and records the chat template and
the special tokens in the manifest (``tokenizer`` section, docs/manifest.md); the build
also checks that this class gives the same prompt ids as transformers on sample texts
and chat turns. Chat templates are rendered the way transformers'
``apply_chat_template`` renders them: a sandboxed jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII characters, the helpers ``raise_exception`` and
``strftime_now``, the ``{% generation %}`` block, and the special tokens
(``bos_token``, ``eos_token``, …) as variables; the rendered text is encoded without
adding special tokens (the template writes them).

Control tokens and user text. A special-token string (``<|im_end|>``, ``</s>`` …) is a
control token only where the caller writes the prompt raw: token ids, or plain text
encoded with :meth:`Tokenizer.encode` / ``encode_prompt(chat=False)``. Inside chat
messages — the strings of each message, including a text prompt wrapped as one user
turn — it is text, so a user cannot forge a turn (``hi<|im_end|><|im_start|>system…``);
control tokens then come only from the template and the tokenizer's own BOS/EOS.
How: such strings are swapped for placeholders before rendering; the rendered text is
encoded as usual, which splits it at the template's control tokens, and each stretch
between two of them that holds a placeholder is encoded again, placeholders restored,
with the special tokens read as text. Messages without such strings are encoded exactly
as before. ``parse_special_in_messages=True`` keeps the former behaviour (the template's
output encoded as a whole, special-token strings in messages included).
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from functools import cached_property
from pathlib import Path

from .errors import ArtifactError, GenerationError


class Tokenizer:
    """Text ↔ token ids for one model.

    Args:
        tokenizer_json: path of a Hugging Face ``tokenizer.json``.
        chat_template: jinja2 chat template text, or None when the model has none.
        special_tokens: ``{"bos_token": "<s>", "eos_token": …, "unk_token": …,
            "pad_token": …}`` (strings or None), visible to the chat template.
        bos_token_id: id of the BOS token, or None.

    Raises:
        ArtifactError: ``tokenizer.json`` is missing or unreadable.
    """

    def __init__(self, tokenizer_json: str | Path, chat_template: str | None = None,
                 special_tokens: dict | None = None, bos_token_id: int | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise ArtifactError(f"tokenizer file not found: {path}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises a plain Exception on bad JSON
            raise ArtifactError(f"cannot load tokenizer {path}: {str(err).splitlines()[0]}") from None
        self.chat_template = chat_template or None
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        self.bos_token_id = bos_token_id

    @classmethod
    def from_manifest(cls, root: str | Path, manifest) -> "Tokenizer":
        """The tokenizer of an artifact directory, as its manifest describes it
        (a :class:`lade_export.manifest.Manifest`, or its JSON object).

        Raises:
            ArtifactError: the manifest is refused (:meth:`Manifest.from_dict`), or see the class.
        """
        from .manifest import Manifest

        if not isinstance(manifest, Manifest):
            manifest = Manifest.from_dict(manifest)
        section = manifest.tokenizer
        return cls(Path(root) / section.file, section.chat_template, dict(section.special_tokens),
                   manifest.model.bos_token_id)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own special tokens, e.g. BOS, when
        ``add_special_tokens``).

        Raises:
            GenerationError: ``text`` is not a string of valid Unicode (a lone surrogate,
                which no UTF-8 text holds; :func:`check_text`).
        """
        check_text(text, "the prompt")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens such as ``<|im_end|>`` left out by default)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        from jinja2 import TemplateError

        try:
            return chat_environment().from_string(self.chat_template)
        except TemplateError as err:
            raise GenerationError(f"the model's chat template does not compile: {err}") from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template applied to ``messages`` (``[{"role", "content"}]``), as text.

        Raises:
            GenerationError: a message of another shape (:func:`_checked_messages`), the model
                has no chat template, or the template raised (e.g. ``raise_exception`` for a
                role order it does not accept).
        """
        return self._render(_checked_messages(messages), add_generation_prompt, **extra)

    def _render(self, messages: list[dict], add_generation_prompt: bool, **extra) -> str:
        """:meth:`render_chat` of messages already checked."""
        if self.chat_template is None:
            raise GenerationError("this model has no chat template; pass plain text (--no-chat)")
        from jinja2 import TemplateError

        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt, **self.special_tokens}
        clash = sorted(set(extra) & set(variables))
        if clash:  # the caller's mistake, not the template's (raised before the template runs)
            raise TypeError(f"render_chat() got values for {', '.join(clash)}, which the tokenizer sets itself")
        try:
            return self._template.render(**variables, **extra)
        except TemplateError as err:
            raise GenerationError(f"chat template: {err}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as err:
            # the template's own expression failed (e.g. {{ 1/0 }}): the artifact's data, said in one line
            raise GenerationError(f"chat template failed: {type(err).__name__}: {err}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            parse_special_in_messages: bool = False, **extra) -> list[int]:
        """Prompt ids of ``messages`` through the chat template.

        Control tokens come from the template (none are added); special-token strings
        inside the messages are text (see the module docstring).

        Args:
            messages: ``[{"role": str, "content": str}]``; every string of a message (and
                the ``text`` of a content part) is user text.
            add_generation_prompt: end with the assistant's header.
            parse_special_in_messages: True reads special-token strings inside the
                messages as control tokens too (the rendered text encoded as a whole).
            extra: more template variables.

        Returns:
            list[int]: the prompt ids.

        Raises:
            GenerationError: see :meth:`render_chat`.
        """
        messages = _checked_messages(messages)
        if parse_special_in_messages:
            return self.encode(self._render(messages, add_generation_prompt, **extra), add_special_tokens=False)
        masked, originals, mark = self._mask_control_strings(messages)
        text = self._render(masked, add_generation_prompt, **extra)
        if not originals:
            return self.encode(text, add_special_tokens=False)
        return self._encode_rendered(text, originals, mark)

    def encode_prompt(self, text: str, chat: bool, *, parse_special_in_messages: bool = False) -> list[int]:
        """Prompt ids: the chat template with one user turn (``chat``) or plain text.

        Plain text is a raw prompt: special-token strings in it are control tokens. In the
        user turn they are text unless ``parse_special_in_messages``. An empty plain
        prompt becomes the BOS token alone when the tokenizer has one.

        Args:
            text: the prompt text.
            chat: wrap it as one user turn in the chat template.
            parse_special_in_messages: see :meth:`apply_chat_template` (chat only).

        Returns:
            list[int]: the prompt ids.

        Raises:
            GenerationError: ``chat`` without a chat template, or an empty prompt without BOS.
        """
        if chat:  # checked here, so that an error names the prompt, not the message it is wrapped in
            check_text(text, "the prompt")
            return self.apply_chat_template([{"role": "user", "content": text}],
                                            parse_special_in_messages=parse_special_in_messages)
        ids = self.encode(text) if text else []
        if not ids:
            if self.bos_token_id is None:
                raise GenerationError("empty prompt and this tokenizer has no BOS token: nothing to condition on")
            ids = [self.bos_token_id]
        return ids

    # -- special-token strings in user text ----------------------------------------------

    def _control_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of ``text`` that the tokenizer would read as special tokens."""
        enc = self._tok.encode(text, add_special_tokens=False)
        special = self.special_ids
        return [span for tid, span in zip(enc.ids, enc.offsets) if tid in special]

    def _mask_control_strings(self, messages):
        """``messages`` with every special-token string in their text replaced by a
        placeholder (U+E000, ``<mark>:<k>``, U+E001: private-use characters and digits, which
        no template filter changes), the replaced strings (``k`` indexes them), and the
        placeholders' pattern. Messages without such strings come back as given."""
        originals: list[str] = []
        strings = [v for m in messages if isinstance(m, dict) for v in _message_strings(m)]
        mark = str(secrets.randbelow(10 ** 12))
        while any(mark in s for s in strings):
            mark = str(secrets.randbelow(10 ** 12))

        def mask(value: str) -> str:
            spans = self._control_spans(value)
            if not spans:
                return value
            pieces, last = [], 0
            for start, end in spans:
                pieces += [value[last:start], f"\ue000{mark}:{len(originals)}\ue001"]
                originals.append(value[start:end])
                last = end
            pieces.append(value[last:])
            return "".join(pieces)

        masked = [_map_message_strings(m, mask) if isinstance(m, dict) else m for m in messages]
        return (masked if originals else messages), originals, re.compile(f"\ue000{mark}:(\\d+)\ue001")

    def _encode_rendered(self, text: str, originals: list[str], mark) -> list[int]:
        """Ids of a rendered template whose messages' special-token strings are
        placeholders: the usual encoding, where each stretch between two of the
        template's control tokens that holds a placeholder is encoded again with the
        placeholders restored and special tokens read as text."""
        enc = self._tok.encode(text, add_special_tokens=False)
        special = self.special_ids
        ids: list[int] = []
        run: list[int] = []
        start = 0

        def close(end: int) -> None:
            stretch = text[start:end]
            if mark.search(stretch) is None:
                ids.extend(run)
                return
            restored = mark.sub(lambda m: originals[int(m.group(1))], stretch)
            ids.extend(self._text_tokenizer(at_start=start == 0).encode(restored, add_special_tokens=False).ids)

        for tid, (a, b) in zip(enc.ids, enc.offsets):
            if tid in special:
                close(a)
                ids.append(tid)
                run, start = [], b
            else:
                run.append(tid)
        close(len(text))
        return ids

    def _text_tokenizer(self, at_start: bool):
        """A copy of the tokenizer that reads special-token strings as text, for a stretch
        at the start of the text or after a control token (where a SentencePiece
        tokenizer that prefixes only the text's first piece adds no prefix)."""
        cache = self.__dict__.setdefault("_text_tokenizers", {})
        if at_start not in cache:
            from tokenizers import Tokenizer as HFTokenizer

            data = json.loads(self._tok.to_str())
            if not at_start:
                _no_first_prefix(data.get("pre_tokenizer"))
            tok = HFTokenizer.from_str(json.dumps(data))
            tok.encode_special_tokens = True
            cache[at_start] = tok
        return cache[at_start]

    @cached_property
    def byte_fallback_ids(self) -> frozenset:
        """Ids of byte pieces (``<0xNN>``) when the model falls back to bytes
        (SentencePiece ``byte_fallback``): a run of them decodes to text only as a whole,
        so the detokenizer holds a run back until it ends. Empty for byte-level BPE."""
        import re

        fallback = getattr(self._tok.model, "byte_fallback", None)  # a BPE model says it
        if fallback is None:  # other model types: read it from the serialized tokenizer (~60 ms for 49k tokens)
            fallback = json.loads(self._tok.to_str()).get("model", {}).get("byte_fallback")
        if not fallback:
            return frozenset()
        piece = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
        return frozenset(i for t, i in self._tok.get_vocab(with_added_tokens=False).items() if piece.match(t))

    @cached_property
    def special_ids(self) -> frozenset:
        """Ids of special added tokens (left out of decoded text by default)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def detokenizer(self, skip_special_tokens: bool = True):
        """A fresh :class:`lade_export.detokenize.IncrementalDetokenizer` on this tokenizer."""
        from .detokenize import IncrementalDetokenizer

        return IncrementalDetokenizer(self, skip_special_tokens)


def check_text(text, what: str) -> None:
    """Raise :class:`~lade_export.errors.GenerationError` unless ``text`` is a string that
    UTF-8 can hold: a lone surrogate (``"\\ud800"``, what a JSON escape or a bad decode can
    give) has no UTF-8 form, and the tokenizer would fail on it with a TypeError."""
    if not isinstance(text, str):
        raise GenerationError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise GenerationError(f"{what} is not valid Unicode text: a lone surrogate U+{ord(text[err.start]):04X} at "
                              f"character {err.start}") from None


def _checked_messages(messages) -> list[dict]:
    """Chat messages as the template takes them: each a dict with a string ``role`` and a
    ``content`` that is a string or a list of text parts (``{"type": "text", "text": …}``,
    joined, as the OpenAI-compatible server does); other keys kept.

    Raises:
        GenerationError: a message of another shape (one line naming it).
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GenerationError(f"messages[{i}] must be a {{role, content}} object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise GenerationError(f"messages[{i}] needs a string role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise GenerationError(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise GenerationError(f"messages[{i}].content must be a string or a list of text parts, got "
                                  f"{'nothing' if content is None else type(content).__name__}")
        check_text(content, f"messages[{i}].content")
        check_text(m["role"], f"messages[{i}].role")
        out.append({**m, "content": content})
    return out


def _message_strings(message: dict):
    """The strings of one chat message: its values, and the ``text`` of content parts."""
    for value in message.values():
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def _map_message_strings(message: dict, fn) -> dict:
    """A copy of ``message`` with ``fn`` applied to the strings :func:`_message_strings` yields."""
    out = {}
    for key, value in message.items():
        if isinstance(value, str):
            value = fn(value)
        elif isinstance(value, list):
            value = [{**part, "text": fn(part["text"])} if isinstance(part, dict) and isinstance(part.get("text"), str)
                     else part for part in value]
        out[key] = value
    return out


def _no_first_prefix(pre_tokenizer) -> None:
    """Turn a Metaspace pre-tokenizer's ``prepend_scheme: first`` into ``never`` (in place,
    also inside a Sequence): for text encoded on its own that is not the start of the prompt."""
    if not isinstance(pre_tokenizer, dict):
        return
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
    for inner in pre_tokenizer.get("pretokenizers") or ():
        _no_first_prefix(inner)


def _raise_exception(message):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def chat_environment():
    """The jinja2 environment chat templates are rendered in (see the module docstring)."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}…{% endgeneration %}`` marks assistant text for training
        masks; rendering keeps its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
