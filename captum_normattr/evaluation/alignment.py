r"""Word alignment from source-attribution matrices, and the alignment error rate (AER).

Pure functions (tensors and sets in, numbers and sets out; no model, no hooks), used by the
synthetic translation benchmark (``benchmarks/faithfulness/mt_alignment.py``, docs/benchmarks.md) to score
encoder-decoder attributions (ALTI+ source contributions, cross-attention weights, gradients)
against known word alignments.

Conventions (the ALTI+ paper's, as its official code ``mt-upc/transformer-contributions-nmt``,
``alignment/aer.py``, computes them):

- **Links** are ``(t, s)`` pairs of 0-based word indices: target word ``t`` (``y_{t+1}`` of
  the reference, in order, the final EOS not counted) and source word ``s`` (the source EOS
  not counted). Note the order: target first, as the rows of a ``(T, S)`` score matrix.
  Pharaoh / talp files write ``s-t`` (source first); :func:`parse_links` reads both.
- **Which decoder row explains target word t.** A decoder fed ``[start, y_1, ..., y_n]``
  has rows ``0..n``; row ``i`` is the state that *predicts* ``y_{i+1}``. Two settings
  (:func:`target_rows`):

  * ``"output"`` (official "AWO", the default): target word ``t`` is read from row ``t``,
    the row that predicts it. This is what an attribution of the prediction of ``y_{t+1}``
    explains, and what IntegratedGradients of ``log p(y_{t+1})`` computes.
  * ``"input"`` (official "AWI", Chen et al. 2020's shift): row ``t + 1``, the row where
    ``y_{t+1}`` is the decoder input.

  The row that predicts the final EOS is never aligned.
- **Hard alignment** (:func:`argmax_alignment`): one link per target word, to the source
  column with the largest score (ties: the first such column). Padded source columns are
  never chosen. *Null* columns (by default the source EOS) can win the argmax; the target word
  then gets no link, as in the official code (``if s_a != src_len``). Pass
  ``null_columns=None`` and exclude EOS through ``source_mask`` to force a link instead.
- **AER** (Och and Ney, 2003): with hypothesis links A, sure links S and possible links P,
  ``AER = 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|)``. S ⊆ P is assumed; every sure link is
  counted as possible (P := P ∪ S, as the official reader does). Over a corpus the four
  counts are summed over sentences before the ratio (a micro average, as in the official
  code), not averaged per sentence.

Examples:
    >>> import torch
    >>> from captum_normattr.evaluation.alignment import argmax_alignment, alignment_error_rate
    >>> scores = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1]])  # 2 target words, 2 words + EOS
    >>> sorted(argmax_alignment(scores, null_columns=[2]))
    [(0, 1), (1, 0)]
    >>> alignment_error_rate([{(0, 1), (1, 0)}], sure=[{(0, 1), (1, 1)}])
    0.5
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor

Link = Tuple[int, int]
Links = Set[Link]

__all__ = [
    "Link",
    "Links",
    "AlignmentScores",
    "alignment_counts",
    "alignment_scores",
    "alignment_error_rate",
    "target_rows",
    "argmax_alignment",
    "batch_argmax_alignments",
    "parse_links",
    "format_links",
]

SETTINGS = ("output", "input")


# --------------------------------------------------------------------------- AER
@dataclass(frozen=True)
class AlignmentScores:
    r"""Corpus-level alignment quality (counts summed over sentences).

    Attributes:
        aer: alignment error rate, ``1 - (|A∩S| + |A∩P|) / (|A| + |S|)`` (lower is better).
        precision: ``|A∩P| / |A|`` (1.0 when A is empty).
        recall: ``|A∩S| / |S|`` (1.0 when S is empty).
        n_hypothesis: ``|A|``, summed over sentences.
        n_sure: ``|S|``.
        n_hyp_sure: ``|A∩S|``.
        n_hyp_possible: ``|A∩P|`` (P includes S).
    """

    aer: float
    precision: float
    recall: float
    n_hypothesis: int
    n_sure: int
    n_hyp_sure: int
    n_hyp_possible: int

    def to_dict(self) -> Dict[str, Union[int, float]]:
        r"""Return the fields as a plain dict (JSON-ready)."""
        return asdict(self)


def _as_link_set(links: Iterable[Sequence[int]], what: str) -> Links:
    out: Links = set()
    for link in links:
        if len(link) != 2:
            raise ValueError(f"{what}: every link must be a (target, source) pair, got {link!r}")
        t, s = int(link[0]), int(link[1])
        if t < 0 or s < 0:
            raise ValueError(f"{what}: link indices must be >= 0, got {link!r}")
        out.add((t, s))
    return out


def alignment_counts(
    hypothesis: Iterable[Link], sure: Iterable[Link], possible: Optional[Iterable[Link]] = None
) -> Tuple[int, int, int, int]:
    r"""Counts of one sentence: ``(|A|, |S|, |A∩S|, |A∩P|)`` with P := P ∪ S.

    Args:
        hypothesis: predicted links A, ``(t, s)`` pairs.
        sure: sure gold links S.
        possible: possible gold links P; ``None`` means P = S. Sure links are added to P.

    Returns:
        The four counts, to be summed over a corpus.

    Examples:
        >>> alignment_counts({(0, 0), (1, 2)}, {(0, 0)}, {(1, 2)})
        (2, 1, 1, 2)
    """
    A = _as_link_set(hypothesis, "hypothesis")
    S = _as_link_set(sure, "sure")
    P = S | (_as_link_set(possible, "possible") if possible is not None else set())
    return len(A), len(S), len(A & S), len(A & P)


def alignment_scores(
    hypotheses: Sequence[Iterable[Link]],
    sure: Sequence[Iterable[Link]],
    possible: Optional[Sequence[Optional[Iterable[Link]]]] = None,
) -> AlignmentScores:
    r"""AER, precision and recall of a corpus (counts summed over sentences, then the ratios).

    Args:
        hypotheses: one set of predicted ``(t, s)`` links per sentence.
        sure: one set of sure gold links per sentence (same length).
        possible: one set of possible gold links per sentence, or ``None`` (P = S). Sure links
            always count as possible.

    Returns:
        :class:`AlignmentScores`. With no links at all (``|A| + |S| = 0``) the AER is 0.

    Raises:
        ValueError: if the lists have different lengths or a link is not a pair of
            non-negative integers.

    Examples:
        >>> alignment_scores([{(0, 0), (1, 1)}], [{(0, 0), (1, 2)}]).aer
        0.5
    """
    n = len(hypotheses)
    if len(sure) != n or (possible is not None and len(possible) != n):
        raise ValueError(
            f"one gold alignment per hypothesis is needed: {n} hypotheses, {len(sure)} sure"
            + (f", {len(possible)} possible" if possible is not None else "")
        )
    a = s = a_s = a_p = 0
    for i in range(n):
        p_i = None if possible is None else possible[i]
        c = alignment_counts(hypotheses[i], sure[i], p_i)
        a, s, a_s, a_p = a + c[0], s + c[1], a_s + c[2], a_p + c[3]
    aer = 0.0 if a + s == 0 else 1.0 - (a_s + a_p) / (a + s)
    return AlignmentScores(
        aer=aer,
        precision=1.0 if a == 0 else a_p / a,
        recall=1.0 if s == 0 else a_s / s,
        n_hypothesis=a,
        n_sure=s,
        n_hyp_sure=a_s,
        n_hyp_possible=a_p,
    )


def alignment_error_rate(
    hypotheses: Sequence[Iterable[Link]],
    sure: Sequence[Iterable[Link]],
    possible: Optional[Sequence[Optional[Iterable[Link]]]] = None,
) -> float:
    r"""Corpus AER, ``1 - (Σ|A∩S| + Σ|A∩P|) / (Σ|A| + Σ|S|)`` (see :func:`alignment_scores`).

    Args:
        hypotheses: one set of predicted ``(t, s)`` links per sentence.
        sure: one set of sure gold links per sentence.
        possible: possible gold links per sentence, or ``None`` (P = S).

    Returns:
        The AER in [0, 1] (0 = perfect).

    Examples:
        >>> alignment_error_rate([{(0, 0)}], [{(0, 0)}])
        0.0
    """
    return alignment_scores(hypotheses, sure, possible).aer


# --------------------------------------------------------------------------- extraction
def target_rows(n_target: int, setting: str = "output") -> Tensor:
    r"""Decoder rows that explain target words ``0..n_target-1`` (EOS not counted).

    The decoder is fed ``[start, y_1, ..., y_n]``; row ``i`` predicts ``y_{i+1}``.

    Args:
        n_target: number of target words n (the reference without its EOS).
        setting: ``"output"`` (row ``t`` predicts word ``t``; official AWO) or ``"input"``
            (row ``t + 1`` reads word ``t``; official AWI).

    Returns:
        A long tensor of n row indices.

    Examples:
        >>> target_rows(3).tolist(), target_rows(3, "input").tolist()
        ([0, 1, 2], [1, 2, 3])
    """
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
    if n_target < 0:
        raise ValueError(f"n_target must be >= 0, got {n_target}")
    offset = 0 if setting == "output" else 1
    return torch.arange(n_target) + offset


def argmax_alignment(
    scores: Tensor,
    source_mask: Optional[Tensor] = None,
    null_columns: Optional[Sequence[int]] = None,
) -> Links:
    r"""Hard alignment of one sentence: each target row links to its highest-scoring source word.

    Args:
        scores: ``(n, S)`` scores, row ``t`` = target word ``t`` (already selected with
            :func:`target_rows`), column = source position. Higher = more aligned.
        source_mask: optional ``(S,)`` bool, True where a column may be chosen (False at
            pads). Default: every column.
        null_columns: columns that may win the argmax but then give no link (the source EOS,
            as in the official code). Default: none.

    Returns:
        The set of ``(t, s)`` links (at most one per target word).

    Raises:
        ValueError: on a wrong shape, NaN scores, or a mask that leaves no column.

    Examples:
        >>> sorted(argmax_alignment(torch.tensor([[1.0, 2.0, 3.0], [5.0, 1.0, 0.0]]), null_columns=[2]))
        [(1, 0)]
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (n_target, n_source), got shape {tuple(scores.shape)}")
    n, S = scores.shape
    if n == 0:
        return set()
    if S == 0:
        raise ValueError("scores have no source column")
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN")
    x = scores.detach().to(torch.float64)
    if source_mask is not None:
        source_mask = source_mask.to(torch.bool).reshape(-1)
        if source_mask.numel() != S:
            raise ValueError(f"source_mask has {source_mask.numel()} entries, scores have {S} columns")
        if not source_mask.any():
            raise ValueError("source_mask leaves no column to align to")
        x = x.masked_fill(~source_mask.to(x.device), float("-inf"))
    best = torch.argmax(x, dim=-1).tolist()  # first maximum on ties
    null = set(int(c) % S for c in null_columns) if null_columns is not None else set()
    return {(t, int(s)) for t, s in enumerate(best) if int(s) not in null}


def batch_argmax_alignments(
    scores: Tensor,
    source_mask: Tensor,
    n_target: Sequence[int],
    setting: str = "output",
    null_eos: bool = True,
) -> List[Links]:
    r"""Hard alignments of a padded batch of decoder-row score matrices.

    Args:
        scores: ``(B, T, S)`` scores; row ``i`` = decoder-input position ``i`` (row ``i``
            predicts ``y_{i+1}``), column = source position.
        source_mask: ``(B, S)`` attention mask of the source, 1 at real tokens (words and the
            EOS), 0 at pads. The source is right-padded and its last real token is the EOS.
        n_target: number of target words per sentence (EOS not counted).
        setting: ``"output"`` or ``"input"`` (see :func:`target_rows`).
        null_eos: True (official): the source EOS may win the argmax and then gives no link;
            False: the EOS column is excluded and every target word gets a link.

    Returns:
        One set of ``(t, s)`` links per sentence; source indices count words only (the EOS is
        the last real column and never appears in a link).

    Examples:
        >>> s = torch.tensor([[[0.1, 0.8, 0.1], [0.9, 0.0, 0.1]]])
        >>> batch_argmax_alignments(s, torch.ones(1, 3), [1])
        [{(0, 1)}]
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be (B, T, S), got shape {tuple(scores.shape)}")
    B, T, S = scores.shape
    if source_mask.shape != (B, S):
        raise ValueError(f"source_mask must be {(B, S)}, got {tuple(source_mask.shape)}")
    if len(n_target) != B:
        raise ValueError(f"n_target has {len(n_target)} entries for a batch of {B}")
    out: List[Links] = []
    for b in range(B):
        valid = source_mask[b].to(torch.bool)
        n_src = int(valid.sum())
        if n_src < 1:
            raise ValueError(f"sentence {b} has no source token")
        eos = int(valid.nonzero().max())  # last real token
        rows = target_rows(int(n_target[b]), setting)
        if rows.numel() and int(rows.max()) >= T:
            raise ValueError(
                f"sentence {b}: {int(n_target[b])} target words need row {int(rows.max())} "
                f"but the scores have {T} rows"
            )
        mask = valid.clone()
        if not null_eos:
            mask[eos] = False
        out.append(
            argmax_alignment(scores[b, rows], mask, null_columns=[eos] if null_eos else None)
        )
    return out


# --------------------------------------------------------------------------- text format
def parse_links(line: str, source_first: bool = True) -> Tuple[Links, Links]:
    r"""Read one line of Pharaoh/talp links (``"0-1 2p3"``) into (sure, possible) ``(t, s)`` sets.

    ``i-j`` is a sure link, ``ipj`` a possible one; sure links are also possible.

    Args:
        line: whitespace-separated links, 0-based.
        source_first: True (Pharaoh, talp) when each link is ``source-target``.

    Returns:
        ``(sure, possible)`` as sets of ``(target, source)`` pairs.

    Examples:
        >>> parse_links("0-1 2p3")
        ({(1, 0)}, {(1, 0), (3, 2)})
    """
    sure: Links = set()
    possible: Links = set()
    for item in line.split():
        is_sure = "-" in item
        parts = item.replace("p", "-").split("-")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"not a link: {item!r} (expected 'i-j' or 'ipj')")
        a, b = int(parts[0]), int(parts[1])
        link = (b, a) if source_first else (a, b)
        possible.add(link)
        if is_sure:
            sure.add(link)
    return sure, possible


def format_links(links: Iterable[Link], source_first: bool = True) -> str:
    r"""Write ``(t, s)`` links as one Pharaoh line (``s-t``, sorted), the inverse of :func:`parse_links`.

    Args:
        links: ``(target, source)`` pairs.
        source_first: True to write ``source-target``.

    Returns:
        The line, e.g. ``"0-1 2-3"``.

    Examples:
        >>> format_links({(1, 0), (3, 2)})
        '0-1 2-3'
    """
    pairs = sorted((s, t) if source_first else (t, s) for t, s in _as_link_set(links, "links"))
    return " ".join(f"{a}-{b}" for a, b in pairs)
