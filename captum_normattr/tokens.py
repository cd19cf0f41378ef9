r"""Readable token labels, and text that is safe to print.

Tokenizers write their tokens with markers: byte-level BPE (GPT-2, Llama 3, SmolLM2) maps
every byte to a printable character (``Ġ`` a space, ``Ċ`` a newline, ``Ã©`` the two bytes
of ``é``), SentencePiece writes ``▁`` for a space and ``<0x0A>`` for a byte, WordPiece
writes ``##`` before a piece that continues a word. :func:`readable_tokens` turns the
tokens of one sequence into the text each of them stands for, derived from the tokenizer
itself (its byte map, or its own ``convert_tokens_to_string``), so tables, HTML reports,
plots and word labels show ``keys`` rather than ``Ġkeys``.

Convention (the same for every family): a token's label is the text it adds to the
decoded sequence **without the space that separates it from the previous word**:
``keys`` for ``Ġkeys`` (byte-level), ``▁keys`` (SentencePiece) and ``keys`` (WordPiece),
``ing`` for the continuation ``##ing``. Only a token that is nothing but white space
keeps it (``Ġ`` -> ``" "``; ``Ċ`` -> ``"\n"``, which printing shows as ``\n``). The
tokenizer's own strings stay available (:attr:`ReadableTokens.raw`, the ``"tokens"`` of
JSON records) for whoever needs the word boundaries. Special tokens (``[CLS]``, ``<s>``, ``<|endoftext|>``) keep their own spelling. A token
that holds only part of a UTF-8 character (byte-level BPE and byte fallback split rare
characters and emoji into bytes) shows the bytes it holds as ``\xNN``, so every label
belongs to its own token; :func:`tokens_text` decodes a group of tokens together
(word labels), which joins such bytes into their character.

:func:`visible_text` is the one place where text is made safe to print: control
characters (C0, DEL, C1: escape sequences, carriage returns, newlines) and the Unicode
format characters that can reorder or hide what a terminal or a browser shows
(right-to-left overrides and isolates, zero-width characters, line and paragraph
separators) are written visibly, as ``\x1b``, ``\n``, ``\u202e``. Every string the
package prints in a terminal table or shows in its HTML passes through it.

Examples:
    >>> visible_text("ok\x1b[31m red \u202eevil")
    'ok\\x1b[31m red \\u202eevil'
"""
from __future__ import annotations

import json
import re
import unicodedata
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["ReadableTokens", "byte_level_decode", "display_token", "json_for_terminal", "readable_tokens",
           "terminal_lines", "tokens_text", "visible_text"]

_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _needs_escape(ch: str) -> bool:
    cat = unicodedata.category(ch)
    # Cc: C0, DEL, C1 controls; Cf: format characters (bidi embeddings, overrides and isolates
    # U+202A-U+202E / U+2066-U+2069, LRM/RLM, zero-width space/joiners, BOM, soft hyphen, ...);
    # Zl/Zp: line and paragraph separators; Cs: lone surrogates.
    return cat in ("Cc", "Cf", "Zl", "Zp", "Cs")


def visible_text(text: Any) -> str:
    r"""``text`` with every control and format character written visibly.

    Control characters (``\x00``-``\x1f``, ``\x7f``-``\x9f``: escape sequences, bell,
    carriage return, newline, tab), Unicode format characters (category Cf: the
    bidirectional embeddings, overrides and isolates U+202A-U+202E and U+2066-U+2069,
    LRM/RLM, zero-width spaces and joiners, the byte-order mark ...), line and paragraph
    separators and lone surrogates become the escapes Python would write (``\x1b``,
    ``\n``, ``\u202e``, ``\U000e0001``). Everything else is kept, so an ordinary text
    reads as it is.

    Args:
        text: any value; it is converted with ``str`` first.

    Returns:
        A string without control or format characters.

    Examples:
        >>> visible_text("a\tb\nc")
        'a\\tb\\nc'
        >>> visible_text("x\u2066y")
        'x\\u2066y'
    """
    s = str(text)
    if s.isprintable():  # fast path: no Cc/Cf/Zl/Zp/Cs (nor any separator but the space)
        return s
    out = []
    for ch in s:
        if not _needs_escape(ch):
            out.append(ch)
            continue
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        else:
            cp = ord(ch)
            out.append(f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}")
    return "".join(out)


def terminal_lines(text: Any) -> str:
    r"""``text`` for a terminal, line by line: :func:`visible_text` of every line, the line breaks kept.

    For messages that are several lines on purpose (an error and its advice) but hold
    names, paths or texts a user or a model gave: escape sequences and bidirectional
    overrides inside them are shown, never sent to the terminal.

    Examples:
        >>> terminal_lines("bad file a\x1b[31m.txt\n  (give another)")
        'bad file a\\x1b[31m.txt\n  (give another)'
    """
    return "\n".join(visible_text(line) for line in str(text).split("\n"))


def json_for_terminal(text: str) -> str:
    r"""Serialised JSON with every control and format character written as a ``\uXXXX`` escape.

    ``json.dumps(..., ensure_ascii=False)`` keeps characters such as U+202E (right-to-left
    override) or C1 controls raw; printed on a terminal they reorder or recolour what
    follows. Such characters can only stand inside JSON strings, so escaping them leaves
    the same JSON value (``json.loads`` gives back the same data); line breaks and tabs
    between JSON tokens are kept.

    Examples:
        >>> json_for_terminal('{"t": "a\u202eb"}')
        '{"t": "a\\u202eb"}'
    """
    if text.isprintable():
        return text
    return "".join(json.dumps(ch)[1:-1] if ch not in "\n\r\t" and _needs_escape(ch) else ch for ch in text)


def display_token(label: Any, ascii_only: bool = False) -> str:
    r"""A token label as tables, HTML and plots show it: :func:`visible_text`, and a label of
    spaces only (a byte-level ``Ġ``, a SentencePiece ``▁``) as that many ``␣`` (``' '`` in
    ASCII), so that a token never shows as nothing.

    Examples:
        >>> display_token(" "), display_token("\n"), display_token(" ", ascii_only=True)
        ('␣', '\\n', "' '")
    """
    s = visible_text(label)
    if s and not s.strip(" "):
        return f"'{s}'" if ascii_only else "\u2423" * len(s)
    return s


# --------------------------------------------------------------------------- byte level


def _bytes_to_unicode() -> Dict[int, str]:
    r"""The byte -> character map of byte-level BPE (GPT-2): printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100 onwards, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_OF_CHAR: Dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def byte_level_decode(token: str, errors: str = "backslashreplace") -> str:
    r"""The text of one byte-level BPE token (``Ġkeys`` -> ``" keys"``, ``Ã©`` -> ``"é"``).

    Args:
        token: the token as the tokenizer spells it.
        errors: how bytes that are no complete UTF-8 character are shown:
            ``"backslashreplace"`` (default, ``\xNN``), ``"replace"`` or ``"ignore"``.

    Returns:
        The decoded text. Characters outside the byte alphabet (an added token's text)
        stand for their own UTF-8 bytes.

    Examples:
        >>> byte_level_decode("\u0120keys"), byte_level_decode("\u010a")
        (' keys', '\n')
        >>> byte_level_decode("\u00c3")
        '\\xc3'
    """
    data = bytearray()
    for ch in token:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            data.extend(ch.encode("utf-8"))
        else:
            data.append(b)
    return bytes(data).decode("utf-8", errors)


# --------------------------------------------------------------------------- tokenizers


class ReadableTokens(list):
    r"""The readable labels of one sequence's tokens (a ``list`` of ``str``), with the
    tokenizer's own token strings in :attr:`raw` (same length, same order).

    Code that shows tokens uses the list; code that writes records can keep both
    (:class:`~captum_normattr.present.report.TextExplanation` writes ``raw`` under ``"tokens"``
    and the labels under ``"token_text"``).
    """

    def __init__(self, labels: Sequence[str] = (), raw: Optional[Sequence[str]] = None) -> None:
        super().__init__(labels)
        self.raw: List[str] = list(raw) if raw is not None else list(labels)
        if len(self.raw) != len(self):
            raise ValueError(f"{len(self.raw)} raw tokens for {len(self)} labels")


def _decoder_types(tokenizer: Any) -> List[str]:
    r"""The ``type``\ s of a fast tokenizer's decoder (a Sequence lists its parts); [] for others."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return []
    try:  # the decoder's own state: small, unlike the whole tokenizer's JSON (its vocabulary)
        dec = json.loads(decoder.__getstate__()) or {}
    except Exception:  # pragma: no cover - an unusual backend
        return [type(decoder).__name__]
    out, todo = [], [dec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            out.append(str(d.get("type", "")))
            todo.extend(d.get("decoders") or [])
    return out


def _ids_list(ids: Any) -> List[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        raise ValueError("readable_tokens takes the ids of one sequence (1-D); call it once per row")
    return [int(i) for i in ids]


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _Reader:
    r"""Per tokenizer: token string -> readable label (cached within one call)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types or (not types and hasattr(tokenizer, "byte_decoder"))
        self.special = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): (str(getattr(t, "content", t)), bool(getattr(t, "special", False)))
                      for i, t in added.items()}
        self._sentinel: Optional[List[str]] = None
        self._prefix = ""
        self.cache: Dict[int, str] = {}

    def sentinel(self) -> List[str]:
        r"""The tokens of a plain word (``"a"``): decoding them before a token shows whether
        the token begins a new word (a space is written between them)."""
        if self._sentinel is None:
            try:
                ids = self.tok("a", add_special_tokens=False)["input_ids"]
                self._sentinel = [str(t) for t in self.tok.convert_ids_to_tokens(ids)] or ["a"]
            except Exception:  # pragma: no cover - a tokenizer that cannot encode a plain word
                self._sentinel = ["a"]
            self._prefix = str(self.tok.convert_tokens_to_string(self._sentinel))
        return self._sentinel

    def label(self, i: int, token: str) -> str:
        if i in self.cache:
            return self.cache[i]
        if i in self.special or self.added.get(i, ("", False))[1]:
            out = token  # special tokens keep their own spelling
        elif i in self.added:
            out = self.added[i][0]
        elif self.byte_level:
            out = self.strip_word_space(byte_level_decode(token))
        else:
            out = self.strip_word_space(self._decoded(token))
        self.cache[i] = out
        return out

    def _decoded(self, token: str) -> str:
        m = _BYTE_FALLBACK.fullmatch(token)
        if m is not None:
            b = int(m.group(1), 16)
            return chr(b) if b < 0x80 else f"\\x{b:02x}"  # one byte of a longer UTF-8 character
        sentinel = self.sentinel()
        try:
            both = str(self.tok.convert_tokens_to_string(sentinel + [token]))
        except Exception:  # pragma: no cover - a tokenizer that cannot decode the pair
            both = ""
        if both.startswith(self._prefix) and len(both) > len(self._prefix):
            out = both[len(self._prefix):]
        else:
            out = str(self.tok.convert_tokens_to_string([token]))
        if "\ufffd" in out and "\ufffd" not in token:
            return token  # not decodable alone: show the tokenizer's spelling
        return out if out else token

    @staticmethod
    def strip_word_space(label: str) -> str:
        r"""The convention: no leading word-separating space, unless the token is only white space."""
        return label[1:] if len(label) > 1 and label[0] == " " and label[1:].strip() else label


def readable_tokens(tokenizer: Any, ids: Any) -> ReadableTokens:
    r"""The readable label of every token of one sequence, from the tokenizer itself.

    Byte-level BPE tokens are decoded through the byte map (``Ġkeys`` -> ``"keys"``,
    ``Ċ`` -> ``"\n"``; a token holding part of a UTF-8 character shows its bytes as
    ``\xNN``); other tokens through the tokenizer's own ``convert_tokens_to_string``, after
    a plain word, so that WordPiece continuations lose their ``##`` (``"ing"``) and
    SentencePiece ``▁`` is read as the tokenizer reads it (``▁keys`` -> ``"keys"``; a
    byte-fallback ``<0xE2>`` that is part of a longer character shows ``\xe2``). In every
    family the space that separates a token from the previous word is not shown (see the
    module's convention); special tokens keep their spelling.
    The labels may hold control characters (``"\n"``): whoever prints them passes them
    through :func:`visible_text`.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        ids: the token ids of one sequence (a 1-D list, tuple, tensor or array).

    Returns:
        :class:`ReadableTokens`: a list of ``len(ids)`` labels, with the tokenizer's own
        token strings in ``.raw``.

    Raises:
        ValueError: for a batch (2-D) of ids.

    Examples:
        >>> readable_tokens(gpt2_tokenizer, gpt2_tokenizer("The keys")["input_ids"])  # doctest: +SKIP
        ['The', 'keys']
        >>> readable_tokens(bert_tokenizer, bert_tokenizer("unbelievable")["input_ids"])  # doctest: +SKIP
        ['[CLS]', 'un', 'bel', 'ie', 'va', 'ble', '[SEP]']
    """
    id_list = _ids_list(ids)
    raw = [str(t) for t in tokenizer.convert_ids_to_tokens(id_list)]
    reader = _Reader(tokenizer)
    return ReadableTokens([reader.label(i, t) for i, t in zip(id_list, raw)], raw)


def tokens_text(tokenizer: Any, ids: Any) -> str:
    r"""The text of a group of tokens decoded together (a word's label): bytes split over
    several tokens join into their character; special tokens are kept.

    Args:
        tokenizer: a Hugging Face tokenizer.
        ids: the token ids of the group (1-D).

    Returns:
        The decoded text, without surrounding white space (the group's own text when that
        is only white space).
    """
    text = str(tokenizer.decode(_ids_list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return text.strip() or text
