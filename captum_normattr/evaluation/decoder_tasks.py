r"""Next-token tasks with known evidence, and plausibility / faithfulness metrics for decoders.

Pure code: templates and tokenizers in, tensors out; no model internals (docs/which_method.md,
"Decoders").

Tasks (each item: a prompt, a target and a foil next token, and the prompt positions of its
evidence):

- ``sva``: subject-verb agreement with an attractor of the other number ("The keys to the old
  cabinet" -> " are" vs " is"); evidence = the subject noun.
- ``ioi``: indirect-object identification ("When Mary and John went to the store, John gave a
  book to" -> " Mary" vs " John"); evidence = the indirect object, the one mention of the answer
  (``alt_evidence``: the two mentions of the repeated subject name).
- ``facts``: factual recall ("The capital of France is" -> " Paris" vs another capital); evidence
  = the subject entity.
- ``induction``: long-range copying ("... river chair lamp ... river chair" -> " lamp" vs another
  listed word); evidence = the first occurrence of the token to copy.

Metric conventions:

- the explained (last) position is never ranked nor removed; with ``exclude_sink=True``
  position 0 (the attention sink) is left out of rankings and removals too, without changing
  any score;
- ranks are 1-based; an item's evidence rank is the best rank of its evidence positions;
- deletion removes the top-k ranked tokens from the prompt (the sequence gets shorter; the
  explained token stays last); insertion keeps only the top-k tokens (and the explained token),
  in their original order. Both are measured on the target-minus-foil logit difference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "TaskItem",
    "TASKS",
    "build_item",
    "make_task",
    "candidate_mask",
    "evidence_ranks",
    "sink_share",
    "removal_sequences",
]


@dataclass
class TaskItem:
    r"""One prompt with a target and a foil next token and its evidence positions."""

    task: str
    text: str
    input_ids: List[int]
    target: int
    foil: int
    evidence: List[int]
    alt_evidence: List[int] = field(default_factory=list)
    meta: Dict[str, str] = field(default_factory=dict)


def _first_token(tokenizer, word: str) -> int:
    return tokenizer(word, add_special_tokens=False)["input_ids"][0]


def _is_single(tokenizer, word: str) -> bool:
    return len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1


def build_item(tokenizer, task: str, segments: Sequence[Tuple[str, Optional[str]]], target: str, foil: str,
               meta: Optional[Dict[str, str]] = None) -> Optional[TaskItem]:
    r"""Tokenize a prompt given as ``(text, tag)`` segments and locate the tagged evidence.

    Tokens overlapping a segment tagged ``"evidence"`` (``"alt"``) are the evidence (alternative
    evidence). Returns None when the target and foil share their first token.

    Args:
        tokenizer: a fast tokenizer (offsets mapping needed).
        task: the task name.
        segments: the prompt in pieces; words carry their leading space.
        target, foil: the two continuations (their first tokens are compared).
        meta: free-form strings kept with the item.
    """
    text = "".join(s for s, _ in segments)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans: Dict[str, List[Tuple[int, int]]] = {"evidence": [], "alt": []}
    pos = 0
    for s, tag in segments:
        if tag in spans:
            start = pos + (len(s) - len(s.lstrip()))
            spans[tag].append((start, pos + len(s)))
        pos += len(s)

    def positions(tag: str) -> List[int]:
        out = []
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            if any(a < e and b > s for s, e in spans[tag]):
                out.append(i)
        return out

    t, f = _first_token(tokenizer, target), _first_token(tokenizer, foil)
    ev = positions("evidence")
    if t == f or not ev or ev[-1] >= len(enc["input_ids"]) - 1:
        return None
    return TaskItem(task, text, list(enc["input_ids"]), t, f, ev, positions("alt"), dict(meta or {}))


# ----------------------------------------------------------------------------- templates
_SVA_NOUNS = [("key", "keys"), ("boy", "boys"), ("girl", "girls"), ("dog", "dogs"), ("teacher", "teachers"),
              ("car", "cars"), ("book", "books"), ("house", "houses"), ("student", "students"),
              ("painting", "paintings"), ("doctor", "doctors"), ("bird", "birds"), ("player", "players"),
              ("friend", "friends"), ("flower", "flowers"), ("picture", "pictures"), ("author", "authors"),
              ("farmer", "farmers"), ("cat", "cats"), ("box", "boxes")]
_SVA_ATTRACTORS = [("table", "tables"), ("tree", "trees"), ("cabinet", "cabinets"), ("door", "doors"),
                   ("river", "rivers"), ("window", "windows"), ("lamp", "lamps"), ("man", "men"),
                   ("building", "buildings"), ("wall", "walls"), ("garden", "gardens"), ("road", "roads")]
_SVA_PREPS = ["near", "behind", "next to", "on", "by", "beside", "under", "to", "of"]
_SVA_ADJS = ["", " old", " big", " wooden", " small", " old wooden", " red"]

_NAMES = ["Mary", "John", "Tom", "Sarah", "James", "Anna", "David", "Emma", "Paul", "Lisa", "Mark", "Kate",
          "Peter", "Laura", "Mike", "Julia", "Sam", "Alice", "Bob", "Rachel", "Daniel", "Susan", "Chris", "Amy"]
_IOI_TEMPLATES = [
    ("When", "A", "and", "B", "went to the store,", "B", "gave a book to"),
    ("After", "A", "and", "B", "had lunch together,", "B", "handed the bill to"),
    ("While", "A", "and", "B", "were working at the office,", "B", "sent an email to"),
    ("Then,", "A", "and", "B", "went to the park.", "B", "gave a ball to"),
    ("Yesterday", "A", "and", "B", "visited the museum, and", "B", "showed a picture to"),
]
_PLACES_FACTS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Russia", "Moscow"), ("China", "Beijing"), ("England", "London"), ("Egypt", "Cairo"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Hungary", "Budapest"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Kenya", "Nairobi"), ("Thailand", "Bangkok"), ("Peru", "Lima"),
    ("Cuba", "Havana"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Argentina", "Buenos Aires"),
    ("India", "New Delhi"), ("South Korea", "Seoul"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"), ("the Czech Republic", "Prague"), ("Vietnam", "Hanoi"), ("the Philippines", "Manila"),
    ("Indonesia", "Jakarta"), ("Chile", "Santiago"), ("Venezuela", "Caracas"), ("Nigeria", "Abuja"),
    ("Morocco", "Rabat"), ("Saudi Arabia", "Riyadh"), ("Iraq", "Baghdad"), ("Syria", "Damascus"),
    ("Lebanon", "Beirut"), ("Afghanistan", "Kabul"), ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"),
    ("Nepal", "Kathmandu"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Scotland", "Edinburgh"), ("Iceland", "Reykjavik"),
    ("Colombia", "Bogota"), ("Ethiopia", "Addis Ababa"), ("Israel", "Jerusalem"), ("Malaysia", "Kuala Lumpur"),
]
_FACT_TEMPLATES = [("The capital of", "is"), ("The capital city of", "is"), ("The capital of", "is the city of"),
                   ("In", ", the capital city is")]
_LANDMARKS = [("Eiffel Tower", "Paris"), ("Colosseum", "Rome"), ("Big Ben", "London"), ("Brandenburg Gate", "Berlin"),
              ("Kremlin", "Moscow"), ("Acropolis", "Athens"), ("Forbidden City", "Beijing"),
              ("Sagrada Familia", "Barcelona"), ("Statue of Liberty", "New York"), ("Golden Gate Bridge", "San Francisco"),
              ("Tower of London", "London"), ("Louvre", "Paris"), ("Vatican", "Rome"), ("Prado Museum", "Madrid")]
_LANDMARK_TEMPLATES = [("The", "is located in the city of"), ("Tourists visit the", "in the city of")]
_INDUCTION_WORDS = ["apple", "river", "chair", "lamp", "garden", "window", "horse", "cloud", "pencil", "bottle",
                    "doctor", "guitar", "mountain", "rabbit", "candle", "basket", "orange", "engine", "forest",
                    "silver", "castle", "bridge", "winter", "paper", "mirror", "tiger", "coffee", "button",
                    "island", "jacket", "ladder", "violin", "pepper", "rocket", "shadow", "pillow", "planet",
                    "carpet", "hammer", "kitten", "dragon", "wallet", "tomato", "anchor", "helmet", "puzzle"]
_FILLERS = ["It was a quiet afternoon and nobody said anything for a while.",
            "The weather outside was cold, so everyone stayed at home.",
            "After a short break, the teacher asked the class to continue.",
            "Nothing else happened that day, and the meeting ended early."]


def _sva(tokenizer, rng: random.Random, n: int) -> List[TaskItem]:
    items = []
    for _ in range(n):
        sing, plur = rng.choice(_SVA_NOUNS)
        a_sing, a_plur = rng.choice(_SVA_ATTRACTORS)
        plural = rng.random() < 0.5
        subj, attr = (plur, a_sing) if plural else (sing, a_plur)
        segs = [("The", None), (" " + subj, "evidence"), (" " + rng.choice(_SVA_PREPS) + " the" + rng.choice(_SVA_ADJS), None),
                (" " + attr, None)]
        target, foil = (" are", " is") if plural else (" is", " are")
        item = build_item(tokenizer, "sva", segs, target, foil, {"number": "plural" if plural else "singular"})
        if item is not None:
            items.append(item)
    return items


def _ioi(tokenizer, rng: random.Random, n: int) -> List[TaskItem]:
    names = [x for x in _NAMES if _is_single(tokenizer, " " + x)]
    items = []
    for _ in range(n):
        a, b = rng.sample(names, 2)
        tpl = rng.choice(_IOI_TEMPLATES)
        segs = []
        for k, part in enumerate(tpl):
            space = "" if k == 0 else " "
            if part == "A":
                segs.append((space + a, "evidence"))
            elif part == "B":
                segs.append((space + b, "alt"))
            else:
                segs.append((space + part, None))
        item = build_item(tokenizer, "ioi", segs, " " + a, " " + b, {"io": a, "s": b})
        if item is not None:
            items.append(item)
    return items


def _facts(tokenizer, rng: random.Random, n: int) -> List[TaskItem]:
    pool = []
    for country, capital in _PLACES_FACTS:
        for pre, post in _FACT_TEMPLATES:
            sep = "" if post.startswith(",") else " "
            pool.append(([(pre, None), (" " + country, "evidence"), (sep + post, None)], capital, country))
    for landmark, city in _LANDMARKS:
        for pre, post in _LANDMARK_TEMPLATES:
            pool.append(([(pre, None), (" " + landmark, "evidence"), (" " + post, None)], city, landmark))
    rng.shuffle(pool)
    cities = sorted({c for _, c in _PLACES_FACTS} | {c for _, c in _LANDMARKS})
    items = []
    for segs, answer, subject in pool[:n]:
        foil = rng.choice([c for c in cities if c != answer])
        item = build_item(tokenizer, "facts", segs, " " + answer, " " + foil, {"subject": subject, "answer": answer})
        if item is not None:
            items.append(item)
    return items


def _induction(tokenizer, rng: random.Random, n: int) -> List[TaskItem]:
    words = [w for w in _INDUCTION_WORDS if _is_single(tokenizer, " " + w)]
    items = []
    for _ in range(n):
        seq = rng.sample(words, 8)
        m = rng.randint(2, 5)  # repeated prefix length; the answer is seq[m]
        segs: List[Tuple[str, Optional[str]]] = [("List:", None)]
        for k, w in enumerate(seq):
            segs.append((" " + w, "evidence" if k == m else None))
        segs.append((". " + rng.choice(_FILLERS) + " List:", None))
        segs.extend((" " + w, None) for w in seq[:m])
        foil = rng.choice([w for k, w in enumerate(seq) if k != m])
        item = build_item(tokenizer, "induction", segs, " " + seq[m], " " + foil, {"answer": seq[m]})
        if item is not None:
            items.append(item)
    return items


TASKS = {"sva": _sva, "ioi": _ioi, "facts": _facts, "induction": _induction}


def make_task(name: str, tokenizer, n: int, seed: int = 0) -> List[TaskItem]:
    r"""Up to ``n`` generated candidate items of a task (deduplicated by prompt and target).

    Args:
        name: ``"sva"``, ``"ioi"``, ``"facts"`` or ``"induction"``.
        tokenizer: a fast tokenizer.
        n: number of candidates drawn (``facts`` has at most 268 distinct ones).
        seed: the templates' random seed.

    Returns:
        a list of :class:`TaskItem` (filter for the ones the model gets right yourself).
    """
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    items = TASKS[name](tokenizer, random.Random(seed), n)
    seen, out = set(), []
    for it in items:
        key = (it.text, it.target, it.foil)
        if key not in seen:
            seen.add(key)
            out.append(it)
    return out


# ----------------------------------------------------------------------------- metrics
def candidate_mask(length: int, exclude_sink: bool = False) -> Tensor:
    r"""(T,) bool: the positions that may be ranked or removed (never the explained last one;
    not position 0 with ``exclude_sink``)."""
    mask = torch.ones(length, dtype=torch.bool)
    mask[-1] = False
    if exclude_sink:
        mask[0] = False
    return mask


def _order(scores: Tensor, exclude_sink: bool) -> Tensor:
    """Candidate positions by decreasing score (ties: earlier first)."""
    cand = candidate_mask(scores.shape[-1], exclude_sink)
    key = scores.detach().double().masked_fill(~cand, float("-inf"))
    order = torch.argsort(key, descending=True, stable=True)
    return order[: int(cand.sum())]


def evidence_ranks(scores: Tensor, evidence: Sequence[int], exclude_sink: bool = False) -> int:
    r"""1-based rank of the best-ranked evidence position among the candidates.

    Args:
        scores: (T,) token scores (higher = more important).
        evidence: evidence positions (those outside the candidates are ignored).
        exclude_sink: leave position 0 out of the ranking.

    Returns:
        the rank (1 = top), or 0 when no evidence position is a candidate.
    """
    order = _order(scores, exclude_sink).tolist()
    ranks = [order.index(e) + 1 for e in evidence if e in order]
    return min(ranks) if ranks else 0


def sink_share(scores: Tensor) -> float:
    r"""Share of position 0 in the absolute score mass of the non-explained positions."""
    a = scores.detach().double().abs()[:-1]
    total = float(a.sum())
    return float(a[0]) / total if total > 0 else float("nan")


def removal_sequences(input_ids: Sequence[int], scores: Tensor, ks: Sequence[int], exclude_sink: bool = False
                      ) -> Tuple[List[List[int]], List[List[int]]]:
    r"""The prompts of the deletion and insertion curves.

    Args:
        input_ids: the prompt's T token ids.
        scores: (T,) token scores.
        ks: numbers of removed / kept tokens (each clipped to the number of candidates).
        exclude_sink: position 0 is never removed (deletion) and always kept (insertion).

    Returns:
        ``(deleted, inserted)``: for each k, the prompt without its top-k candidates, and the
        prompt reduced to its top-k candidates (plus position 0 with ``exclude_sink``, and the
        explained last token), order preserved.
    """
    order = _order(scores, exclude_sink).tolist()
    T = len(input_ids)
    deleted, inserted = [], []
    for k in ks:
        top = set(order[: min(k, len(order))])
        deleted.append([t for i, t in enumerate(input_ids) if i not in top])
        keep = top | {T - 1} | ({0} if exclude_sink else set())
        inserted.append([t for i, t in enumerate(input_ids) if i in keep])
    return deleted, inserted
