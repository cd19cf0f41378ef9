r"""From tokens to words, sentences and other spans: aggregating token scores and token maps.

Pure functions over tensors and a fast tokenizer's ``BatchEncoding`` (its ``word_ids``,
``sequence_ids`` and character ``offsets``). The unit is a :class:`Span`: a label and the
token positions it groups (positions in the padded batch, as the scores are indexed).
Spans come from

- the tokenizer's words (:func:`word_spans`),
- character ranges of the text (:func:`char_spans_to_token_spans`), e.g. sentences
  (:func:`sentence_char_spans`) or the messages of a chat template
  (:func:`chat_role_char_spans`),

and are applied to token scores with :func:`aggregate_scores` and to token-to-token maps
with :func:`aggregate_map`. The one-call helpers :func:`aggregate_to_words`,
:func:`aggregate_to_sentences`, :func:`aggregate_to_spans` and :func:`aggregate_map_to_words`
do both steps for a batch.

Convention (see ``docs/aggregation.md``): a score says how much a *source* token
contributes, so the scores of a word's pieces are **summed** (``reduce="sum"``, signs
kept: a signed method's positive and negative pieces cancel as they do in the logit). In a
token-to-token map ``M[i, j]`` (how much source j contributes to target i) the source
columns are summed and the target rows are **averaged**: a word as a target is read as the
mean of its pieces' rows, so a map whose rows sum to 1 (ALTI, a row-normalised rollout)
still has rows summing to 1 after aggregation, as long as the source spans cover every
real column (``keep_special=True``). This is what the ALTI and the norm-analysis reference
code do. Aggregate *after* the rollout: the product of aggregated layer maps is not the
aggregated product.

Tokens outside every span (special tokens such as ``[CLS]``, ``[SEP]``, the markup of a
chat template outside the chosen spans) are dropped, or kept as spans of their own with
``keep_special=True``. Pads are always dropped.

Examples:
    >>> import torch
    >>> from captum_normattr import load_default_model, aggregate_to_words
    >>> model, tok = load_default_model()  # doctest: +SKIP
    >>> enc = tok(["unbelievably good"], return_tensors="pt")  # doctest: +SKIP
    >>> scores = torch.arange(enc["input_ids"].shape[1], dtype=torch.float)[None]  # doctest: +SKIP
    >>> aggregate_to_words(scores, enc, texts=["unbelievably good"])  # doctest: +SKIP
    [(['unbelievably', 'good'], tensor([15., 6.]))]

It is over 700 lines because words, sentences, spans and their maps share the offset and span logic; the four aggregations are kept together so they agree.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "REDUCTIONS",
    "Span",
    "CharSpan",
    "aggregate_map",
    "aggregate_map_to_words",
    "aggregate_scores",
    "aggregate_to_sentences",
    "aggregate_to_spans",
    "aggregate_to_words",
    "char_spans_to_token_spans",
    "check_texts_match",
    "chat_role_char_spans",
    "sentence_char_spans",
    "spans_for",
    "word_spans",
]

#: how the scores of the tokens of one span are combined
REDUCTIONS: Tuple[str, ...] = ("sum", "mean", "max")

#: a character range of the text and its label: (start, end, label), end exclusive
CharSpan = Tuple[int, int, str]


@dataclass(frozen=True)
class Span:
    r"""A group of tokens read as one unit.

    Attributes:
        label: what is shown for it (the word, the sentence, the role of a message).
        tokens: the token positions it groups (indices into the padded sequence).
    """

    label: str
    tokens: Tuple[int, ...]


# --------------------------------------------------------------------------- encodings


def _encoding(encoding: Any, index: int) -> Any:
    r"""The ``tokenizers.Encoding`` of example ``index`` of a fast tokenizer's BatchEncoding."""
    encs = getattr(encoding, "encodings", None)
    if not encs:
        raise TypeError(
            "aggregation needs the BatchEncoding of a *fast* tokenizer (it reads word_ids and character "
            "offsets): load it with AutoTokenizer.from_pretrained(..., use_fast=True) and pass what "
            "tokenizer(texts, ...) returned"
        )
    if not 0 <= index < len(encs):
        raise IndexError(f"example {index} requested, the encoding holds {len(encs)} examples")
    return encs[index]


def _batch_size(encoding: Any) -> int:
    encs = getattr(encoding, "encodings", None)
    if not encs:
        _encoding(encoding, 0)  # raises the TypeError above
    return len(encs)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _join_pieces(tokens: Sequence[str]) -> str:
    r"""A readable word from its token strings when neither the text nor the tokenizer is
    given: WordPiece ``##`` continuations glued, SentencePiece ``▁`` and byte-fallback
    ``<0xNN>`` bytes decoded, byte-level BPE (``Ġ``, ``Ċ``, ``Ã©``) decoded through the byte
    map when the pieces form valid UTF-8 that way. (With the tokenizer at hand,
    :func:`~captum_normattr.tokens.tokens_text` decodes exactly.)"""
    from captum_normattr.tokens import byte_level_decode

    out = []
    for k, t in enumerate(tokens):
        if k and t.startswith("##"):
            t = t[2:]
        out.append(t)
    word = "".join(out)
    if _BYTE_FALLBACK.search(word):
        data = bytearray()
        for part in re.split(r"(<0x[0-9A-Fa-f]{2}>)", word):
            m = _BYTE_FALLBACK.fullmatch(part)
            data.extend(bytes([int(m.group(1), 16)]) if m else part.encode("utf-8"))
        word = data.decode("utf-8", "replace")
    if any(0x100 <= ord(c) <= 0x143 for c in word) or any(0x80 <= ord(c) < 0x100 for c in word):
        try:
            decoded = byte_level_decode(word, errors="strict")
        except UnicodeDecodeError:
            decoded = None  # not byte-level after all (a WordPiece "café")
        if decoded is not None and (decoded != word):
            word = decoded
    shown = word.replace("\u2581", " ")
    return shown.strip() or word


def _normalized(s: str) -> str:
    r"""Letters and digits only, compatibility-decomposed, accents dropped, case-folded: what an
    uncased or normalising tokenizer keeps of a text, for comparing tokens with texts."""
    return "".join(c for c in unicodedata.normalize("NFKD", s).casefold() if c.isalnum())


def _token_forms(token: str) -> List[str]:
    r"""What a token string can stand for in the text, normalised (empty list: not checkable)."""
    from captum_normattr.tokens import byte_level_decode

    if (token.startswith("[") and token.endswith("]")) or (token.startswith("<") and token.endswith(">")):
        return []  # [UNK], <unk>, byte fallback <0xNN>: no letters of the text to compare
    plain = token[2:] if token.startswith("##") else token
    forms = [_normalized(plain.replace("\u2581", " ")), _normalized(byte_level_decode(token, errors="ignore"))]
    return [] if any(not f for f in forms) else forms


def check_texts_match(encoding: Any, index: int, texts: Sequence[Any]) -> None:
    r"""Raise unless ``texts[index]`` is the text (or pair of texts) that example ``index`` was tokenized from.

    Word and sentence labels are cut out of the texts at the tokens' character offsets;
    another text gives labels that belong to no token. Checked: the number of texts, every
    token's offsets lie inside its text, and every token's letters and digits (markers
    ``##``/``Ġ``/``▁`` removed, case and accents ignored, as uncased tokenizers normalise)
    occur in the text at its offsets. Tokens without letters to compare (``[UNK]``,
    punctuation, byte pieces) are skipped.

    Args:
        encoding: the ``BatchEncoding`` of a fast tokenizer.
        index: the example.
        texts: the texts given for the batch (a string, or a pair of strings, per example).

    Raises:
        ValueError: naming the first token that does not match.
    """
    enc = _encoding(encoding, index)
    if isinstance(texts, str):
        raise ValueError("texts must be a list with one text (or pair of texts) per example, not one string")
    n = _batch_size(encoding)
    if len(texts) != n:
        raise ValueError(f"got {len(texts)} texts for the {n} examples of the encoding: give the texts "
                         "that were tokenized, in the same order")
    for pos, (s, m, (a, b), tok) in enumerate(zip(enc.sequence_ids, enc.attention_mask, enc.offsets, enc.tokens)):
        if not m or s is None or b <= a:
            continue
        text = _text_of(texts, index, s)
        if text is None:
            raise ValueError(f"example {index} has a sequence {s} but no text was given for it")
        if b > len(text):
            raise ValueError(
                f"example {index}: token {pos} ({tok!r}) lies at characters {a}:{b}, beyond the end of the given "
                f"text ({len(text)} characters): texts must be the strings that were tokenized, in the same order"
            )
        forms = _token_forms(tok)
        if forms and not any(f in _normalized(text[a:b]) for f in forms):
            raise ValueError(
                f"example {index}: token {pos} ({tok!r}) does not match the given text at its characters {a}:{b} "
                f"({text[a:b]!r}): texts must be the strings that were tokenized, in the same order"
            )


def _special_span(enc: Any, pos: int) -> Span:
    return Span(enc.tokens[pos], (pos,))


def _text_of(texts: Optional[Sequence[Any]], index: int, seq: int) -> Optional[str]:
    if texts is None:
        return None
    t = texts[index]
    if isinstance(t, str):
        return t if seq == 0 else None
    return t[seq] if seq < len(t) else None


def word_spans(
    encoding: Any,
    index: int = 0,
    *,
    keep_special: bool = False,
    texts: Optional[Sequence[Any]] = None,
    tokenizer: Optional[Any] = None,
) -> List[Span]:
    r"""The words of example ``index``, as the fast tokenizer split them (``word_ids``).

    Args:
        encoding: the ``BatchEncoding`` returned by a fast tokenizer.
        index: the example.
        keep_special: keep every special token (``[CLS]``, ``[SEP]``, ``<s>`` ...) as a
            span of its own; by default they are dropped. Pads are always dropped.
        texts: the texts that were tokenized (a string, or a pair of strings, per
            example): labels are then the exact words of the text (checked with
            :func:`check_texts_match`); otherwise they are rebuilt from the tokens
            (lower-cased by an uncased tokenizer).
        tokenizer: without ``texts``, the tokenizer: labels are the word's tokens decoded
            together (:func:`~captum_normattr.tokens.tokens_text`); default: rebuilt
            from the token strings (markers of WordPiece, SentencePiece and byte-level
            BPE removed).

    Returns:
        list of :class:`Span` in the order of the sequence. For a pair of sequences the
        words of both, in order.

    Raises:
        TypeError: when ``encoding`` does not come from a fast tokenizer.
        ValueError: when ``texts`` are not the texts that were tokenized.
    """
    enc = _encoding(encoding, index)
    if texts is not None:
        check_texts_match(encoding, index, texts)
    words = enc.word_ids
    seqs = enc.sequence_ids
    out: List[Span] = []
    groups: dict = {}
    for pos, (w, s, m) in enumerate(zip(words, seqs, enc.attention_mask)):
        if not m:
            continue  # pad
        if w is None:
            if keep_special:
                out.append(_special_span(enc, pos))
            continue
        key = (s, w)
        if key not in groups:
            groups[key] = len(out)
            out.append(Span("", (pos,)))
        else:
            k = groups[key]
            out[k] = Span("", out[k].tokens + (pos,))
    labelled = []
    for sp in out:
        if sp.label or len(sp.tokens) == 1 and words[sp.tokens[0]] is None:
            labelled.append(sp)
            continue
        first = sp.tokens[0]
        text = _text_of(texts, index, seqs[first] or 0)
        if text is not None:
            start = min(enc.offsets[p][0] for p in sp.tokens)
            end = max(enc.offsets[p][1] for p in sp.tokens)
            label = text[start:end]
        elif tokenizer is not None:
            from captum_normattr.tokens import tokens_text

            label = tokens_text(tokenizer, [enc.ids[p] for p in sp.tokens])
        else:
            label = _join_pieces([enc.tokens[p] for p in sp.tokens])
        labelled.append(Span(label.strip() or label, sp.tokens))
    return labelled


def char_spans_to_token_spans(
    encoding: Any,
    index: int,
    char_spans: Sequence[CharSpan],
    *,
    keep_special: bool = False,
    sequence: int = 0,
) -> List[Span]:
    r"""Token spans from character ranges of the text (sentences, messages, any selection).

    A token belongs to the first character range that overlaps it. Tokens that no range
    covers (special tokens, text outside every range) are dropped, or kept as spans of
    their own with ``keep_special=True``; ranges that cover no token are left out.

    Args:
        encoding: the ``BatchEncoding`` returned by a fast tokenizer.
        index: the example.
        char_spans: ``(start, end, label)`` character ranges (end exclusive) of the text
            of sequence ``sequence`` of this example.
        keep_special: keep uncovered tokens as single-token spans (in sequence order).
        sequence: which sequence of a pair the ranges refer to (0 or 1).

    Returns:
        list of :class:`Span`, ordered by their first token.
    """
    enc = _encoding(encoding, index)
    members: List[List[int]] = [[] for _ in char_spans]
    loose: List[int] = []
    for pos, (s, m, (a, b)) in enumerate(zip(enc.sequence_ids, enc.attention_mask, enc.offsets)):
        if not m:
            continue
        hit = None
        if s == sequence and b > a:
            for k, (start, end, _) in enumerate(char_spans):
                if a < end and b > start:
                    hit = k
                    break
        if hit is None:
            loose.append(pos)
        else:
            members[hit].append(pos)
    spans = [Span(str(lab), tuple(toks)) for (_, _, lab), toks in zip(char_spans, members) if toks]
    if keep_special:
        spans += [_special_span(enc, p) for p in loose]
    return sorted(spans, key=lambda sp: sp.tokens[0])


_SENTENCE = re.compile(r"\S.*?(?:[.!?]+(?=[\s\"')\]]*(?:\s|$))[\"')\]]*|$)", re.S)


def sentence_char_spans(text: str) -> List[CharSpan]:
    r"""Sentences of a text as character ranges: a simple rule, ``.``, ``!`` or ``?`` followed by
    white space (or the end) closes a sentence; closing quotes and brackets stay with it.

    For other rules (abbreviations, other scripts) give your own ranges to
    :func:`char_spans_to_token_spans` or :func:`aggregate_to_spans`.

    Examples:
        >>> [t for _, _, t in sentence_char_spans("It works. Does it? Yes!")]
        ['It works.', 'Does it?', 'Yes!']
    """
    return [(m.start(), m.end(), m.group().strip()) for m in _SENTENCE.finditer(text) if m.group().strip()]


def chat_role_char_spans(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = False,
    include_markup: bool = True,
    **template_kwargs: Any,
) -> Tuple[str, List[CharSpan]]:
    r"""The text of a chat template and the character range of every message, labelled by role.

    With ``include_markup=True`` (default) a message's range is everything the template
    adds for it, markup included: the template is rendered for the first k messages and for
    the first k + 1, and message k is the difference (this needs a template whose rendering
    of fewer messages is a prefix of the rendering of more, as the usual ones are); the tokenizer's BOS
    token, when the template writes it first, belongs to no message. The
    generation prompt, when asked for, is a span labelled ``"generation prompt"``. With
    ``include_markup=False`` a range is the message's content only (found in order in the
    rendered text), and the markup counts as special tokens.

    Args:
        tokenizer: a tokenizer with a ``chat_template``.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        add_generation_prompt: append the template's generation prompt.
        include_markup: see above.
        **template_kwargs: passed to ``apply_chat_template``.

    Returns:
        ``(text, spans)``: tokenize ``text`` (with ``add_special_tokens=False`` when the
        template already writes the BOS token) and pass ``spans`` to
        :func:`aggregate_to_spans`. Labels are the roles (``"user"``, ``"assistant"`` ...).

    Raises:
        ValueError: when the template's renderings are not prefixes of each other
            (use ``include_markup=False``), or a message's content is not found.
    """
    def render(msgs: Sequence[dict], gen: bool) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen,
                                             **template_kwargs)

    text = render(messages, add_generation_prompt)
    spans: List[CharSpan] = []
    if include_markup:
        bos = getattr(tokenizer, "bos_token", None)  # a BOS the template writes first belongs to no message
        prev = bos if isinstance(bos, str) and bos and render(messages[:1], False).startswith(bos) else ""
        for k in range(len(messages)):
            cur = render(messages[: k + 1], False)
            if not cur.startswith(prev):
                raise ValueError(
                    f"the chat template's rendering of {k} messages is not a prefix of its rendering of "
                    f"{k + 1}: role spans with markup cannot be cut; use include_markup=False"
                )
            spans.append((len(prev), len(cur), str(messages[k].get("role", f"message {k}"))))
            prev = cur
        if not text.startswith(prev):
            raise ValueError("the chat template's full rendering does not extend the rendering of its messages; "
                             "use include_markup=False")
        if len(text) > len(prev):
            spans.append((len(prev), len(text), "generation prompt"))
    else:
        cursor = 0
        for k, msg in enumerate(messages):
            content = str(msg.get("content", ""))
            at = text.find(content, cursor) if content else -1
            if at < 0:
                raise ValueError(f"message {k}'s content was not found in the rendered chat template")
            spans.append((at, at + len(content), str(msg.get("role", f"message {k}"))))
            cursor = at + len(content)
    return text, spans


# --------------------------------------------------------------------------- reductions


def _assignment(spans: Sequence[Span], t_len: int, dtype: torch.dtype, device: Any) -> Tensor:
    r"""(S, T) 0/1 matrix: row s has ones at the tokens of span s."""
    a = torch.zeros(len(spans), t_len, dtype=dtype, device=device)
    for k, sp in enumerate(spans):
        if not sp.tokens:
            raise ValueError(f"span {k} ({sp.label!r}) has no token")
        if max(sp.tokens) >= t_len or min(sp.tokens) < -t_len:
            raise ValueError(f"span {k} ({sp.label!r}) has token positions {sp.tokens} outside a sequence of {t_len}")
        a[k, list(sp.tokens)] = 1
    return a


def _check_reduce(reduce: str, what: str = "reduce") -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"{what} must be one of {REDUCTIONS}, got {reduce!r}")


def aggregate_scores(scores: Tensor, spans: Sequence[Span], reduce: str = "sum") -> Tensor:
    r"""Token scores of one example to span scores.

    Args:
        scores: (..., T) token scores (the last axis indexed like the spans' tokens).
        spans: the spans.
        reduce: ``"sum"`` (default: a span contributes what its tokens contribute; signs
            are kept), ``"mean"`` or ``"max"``.

    Returns:
        (..., S) one score per span, in the dtype of ``scores``.

    Examples:
        >>> import torch
        >>> aggregate_scores(torch.tensor([0.5, 0.25, -0.5, 1.0]), [Span("ab", (1, 2)), Span("c", (3,))])
        tensor([-0.2500,  1.0000])
    """
    _check_reduce(reduce)
    scores = torch.as_tensor(scores)
    if not spans:
        return scores.new_zeros(scores.shape[:-1] + (0,))
    if reduce == "max":
        return torch.stack([scores[..., list(sp.tokens)].amax(-1) for sp in spans], -1)
    dtype = scores.dtype if scores.is_floating_point() else torch.float64
    a = _assignment(spans, scores.shape[-1], dtype, scores.device)
    out = scores.to(dtype) @ a.T
    if reduce == "mean":
        out = out / a.sum(-1)
    return out


def aggregate_map(
    maps: Tensor,
    row_spans: Sequence[Span],
    col_spans: Optional[Sequence[Span]] = None,
    *,
    rows: str = "mean",
    cols: str = "sum",
) -> Tensor:
    r"""A token-to-token map of one example to a span-to-span map.

    ``maps[..., i, j]`` is how much source token j contributes to target token i. The
    default convention sums the source columns of a span (what the span contributes) and
    averages the target rows (a span as a target is the mean of its tokens): rows that
    sum to 1 still sum to 1 when ``col_spans`` cover every column with a non-zero entry.

    Args:
        maps: (..., T, T) one example's map(s), e.g. a rollout (T, T) or layer maps (L, T, T).
        row_spans: the target spans (rows).
        col_spans: the source spans (columns); default ``row_spans``.
        rows: ``"mean"`` (default), ``"sum"`` or ``"max"`` over a span's target rows.
        cols: ``"sum"`` (default), ``"mean"`` or ``"max"`` over a span's source columns.

    Returns:
        (..., S_rows, S_cols).

    Examples:
        >>> import torch
        >>> m = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
        >>> w = [Span("a", (0,)), Span("bc", (1, 2))]
        >>> aggregate_map(m, w).sum(-1)
        tensor([1., 1.])
    """
    _check_reduce(rows, "rows")
    _check_reduce(cols, "cols")
    maps = torch.as_tensor(maps)
    if maps.dim() < 2 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"expected (..., T, T) maps, got shape {tuple(maps.shape)}")
    col_spans = row_spans if col_spans is None else col_spans
    out = aggregate_scores(maps, col_spans, cols)  # (..., T, S_cols)
    return aggregate_scores(out.transpose(-1, -2), row_spans, rows).transpose(-1, -2)


# --------------------------------------------------------------------------- batch helpers


def _rows(scores: Any, n: int) -> Tensor:
    if not isinstance(scores, Tensor) and isinstance(getattr(scores, "scores", None), Tensor):
        scores = scores.scores  # a result object (AttributionResult); not imported: result imports this module
    s = torch.as_tensor(scores).detach()
    if s.dim() == 1:
        s = s.unsqueeze(0)
    if s.dim() != 2 or s.shape[0] != n:
        raise ValueError(f"expected (B, T) scores for the {n} examples of the encoding, got shape {tuple(s.shape)}")
    return s


def _check_length(s: Tensor, encoding: Any, index: int) -> None:
    t = len(_encoding(encoding, index).ids)
    if s.shape[-1] != t:
        raise ValueError(f"example {index}: {s.shape[-1]} scores but the encoding has {t} tokens "
                         "(aggregate with the encoding the model was given)")


def aggregate_to_words(
    scores: Any,
    encoding: Any,
    reduce: str = "sum",
    *,
    keep_special: bool = False,
    texts: Optional[Sequence[Any]] = None,
    tokenizer: Optional[Any] = None,
) -> List[Tuple[List[str], Tensor]]:
    r"""Token scores of a batch to word scores.

    Args:
        scores: (B, T) token scores (or (T,) for one example, or a result object), indexed
            like ``encoding``: the scores of the inputs the tokenizer returned, padding included.
        encoding: the ``BatchEncoding`` of a fast tokenizer (``tokenizer(texts, ...)``).
        reduce: ``"sum"`` (default; signs of signed methods are kept), ``"mean"`` or ``"max"``.
        keep_special: keep special tokens as words of their own (default: dropped).
        texts: the tokenized texts, for exact word labels (default: rebuilt from the tokens).
        tokenizer: without ``texts``, the tokenizer, to decode every word's tokens.

    Returns:
        per example ``(words, scores)``: the list of words and a (W,) tensor.

    Raises:
        TypeError: for the encoding of a slow tokenizer.
        ValueError: when the scores do not match the encoding, or ``texts`` are not the
            texts that were tokenized.

    Examples:
        >>> from captum_normattr import GlobEncAttribution, load_default_model  # doctest: +SKIP
        >>> model, tok = load_default_model()  # doctest: +SKIP
        >>> enc = tok(["an unbelievably good film"], return_tensors="pt")  # doctest: +SKIP
        >>> res = GlobEncAttribution(model).decompose(enc["input_ids"], additional_forward_args=(enc["attention_mask"],))  # doctest: +SKIP
        >>> [(words, s)] = aggregate_to_words(res.scores, enc)  # doctest: +SKIP
    """
    s = _rows(scores, _batch_size(encoding))
    out = []
    for i in range(s.shape[0]):
        _check_length(s[i], encoding, i)
        spans = word_spans(encoding, i, keep_special=keep_special, texts=texts, tokenizer=tokenizer)
        out.append(([sp.label for sp in spans], aggregate_scores(s[i], spans, reduce)))
    return out


def aggregate_to_spans(
    scores: Any,
    encoding: Any,
    char_spans: Sequence[Sequence[CharSpan]],
    reduce: str = "sum",
    *,
    keep_special: bool = False,
) -> List[Tuple[List[str], Tensor]]:
    r"""Token scores of a batch to the scores of character ranges (one list of ranges per example).

    Args:
        scores: (B, T) token scores (or (T,), or a result object).
        encoding: the ``BatchEncoding`` of a fast tokenizer.
        char_spans: per example, ``(start, end, label)`` character ranges of its text
            (e.g. :func:`sentence_char_spans`, :func:`chat_role_char_spans`).
        reduce: ``"sum"``, ``"mean"`` or ``"max"``.
        keep_special: keep tokens outside every range as spans of their own.

    Returns:
        per example ``(labels, scores)``.
    """
    s = _rows(scores, _batch_size(encoding))
    if len(char_spans) != s.shape[0]:
        raise ValueError(f"got character spans for {len(char_spans)} examples, scores for {s.shape[0]}")
    out = []
    for i in range(s.shape[0]):
        _check_length(s[i], encoding, i)
        spans = char_spans_to_token_spans(encoding, i, char_spans[i], keep_special=keep_special)
        out.append(([sp.label for sp in spans], aggregate_scores(s[i], spans, reduce)))
    return out


def aggregate_to_sentences(
    scores: Any,
    encoding: Any,
    texts: Sequence[str],
    reduce: str = "sum",
    *,
    keep_special: bool = False,
) -> List[Tuple[List[str], Tensor]]:
    r"""Token scores of a batch to sentence scores (:func:`sentence_char_spans` of each text).

    Args:
        scores: (B, T) token scores (or (T,), or a result object).
        encoding: the ``BatchEncoding`` of a fast tokenizer.
        texts: the B tokenized texts.
        reduce: ``"sum"``, ``"mean"`` or ``"max"``.
        keep_special: keep special tokens as spans of their own.

    Returns:
        per example ``(sentences, scores)``.
    """
    for i in range(_batch_size(encoding)):
        check_texts_match(encoding, i, texts)
    return aggregate_to_spans(scores, encoding, [sentence_char_spans(t) for t in texts], reduce,
                              keep_special=keep_special)


def aggregate_map_to_words(
    maps: Tensor,
    encoding: Any,
    *,
    keep_special: bool = False,
    texts: Optional[Sequence[Any]] = None,
    rows: str = "mean",
    cols: str = "sum",
    tokenizer: Optional[Any] = None,
) -> List[Tuple[List[str], Tensor]]:
    r"""Token-to-token maps of a batch to word-to-word maps (:func:`aggregate_map`'s convention).

    Args:
        maps: (B, ..., T, T), e.g. ``res.rollout`` (B, T, T) or ``res.layer_maps`` (B, L, T, T).
        encoding: the ``BatchEncoding`` of a fast tokenizer.
        keep_special: keep special tokens as words of their own (needed for rows to keep
            their sums: the contributions of dropped tokens are dropped with them).
        texts: the tokenized texts, for exact word labels.
        rows, cols: the reductions of target rows (default mean) and source columns
            (default sum).
        tokenizer: without ``texts``, the tokenizer, to decode every word's tokens.

    Returns:
        per example ``(words, (..., W, W) map)``.
    """
    maps = torch.as_tensor(maps)
    n = _batch_size(encoding)
    if maps.dim() < 3 or maps.shape[0] != n:
        raise ValueError(f"expected (B, ..., T, T) maps for the {n} examples of the encoding, got {tuple(maps.shape)}")
    out = []
    for i in range(n):
        _check_length(maps[i][..., 0, :], encoding, i)
        spans = word_spans(encoding, i, keep_special=keep_special, texts=texts, tokenizer=tokenizer)
        out.append(([sp.label for sp in spans], aggregate_map(maps[i], spans, rows=rows, cols=cols)))
    return out


def spans_for(
    level: Union[str, Sequence[Sequence[CharSpan]]],
    encoding: Any,
    index: int,
    *,
    keep_special: bool = False,
    texts: Optional[Sequence[Any]] = None,
    tokenizer: Optional[Any] = None,
) -> List[Span]:
    r"""The spans of example ``index`` for a level: ``"word"``, ``"sentence"`` (needs ``texts``)
    or per-example character ranges.

    Raises:
        ValueError: for an unknown level, ``"sentence"`` without texts, or texts that are
            not the ones tokenized (:func:`check_texts_match`).
    """
    if isinstance(level, str):
        if level == "word":
            return word_spans(encoding, index, keep_special=keep_special, texts=texts, tokenizer=tokenizer)
        if level == "sentence":
            text = _text_of(texts, index, 0) if texts is not None else None
            if text is None:
                raise ValueError("sentence aggregation needs the texts (texts=[...]) to find the sentences")
            check_texts_match(encoding, index, texts)
            return char_spans_to_token_spans(encoding, index, sentence_char_spans(text), keep_special=keep_special)
        raise ValueError(f"level must be 'word', 'sentence' or per-example character spans, got {level!r}")
    return char_spans_to_token_spans(encoding, index, level[index], keep_special=keep_special)

