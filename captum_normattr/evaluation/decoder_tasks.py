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
- a user's items: :func:`load_jsonl_task` / :func:`items_from_records` (``{"prompt", "target",
  "foil", "evidence"}`` per line, docs/evaluation.md); the foil may be None (d = logit(target)).

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

import json
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "TaskItem",
    "TASKS",
    "build_item",
    "make_task",
    "items_from_records",
    "load_jsonl_task",
    "fact_answer_tokens",
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
    foil: Optional[int]
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
_MORE_CAPITALS = [
    ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Qatar", "Doha"), ("Jordan", "Amman"), ("Tunisia", "Tunis"),
    ("Algeria", "Algiers"), ("Ghana", "Accra"), ("Senegal", "Dakar"), ("Uganda", "Kampala"), ("Zimbabwe", "Harare"),
    ("Jamaica", "Kingston"), ("Ecuador", "Quito"), ("Uruguay", "Montevideo"), ("Paraguay", "Asuncion"),
    ("New Zealand", "Wellington"), ("Mongolia", "Ulaanbaatar"), ("Sri Lanka", "Colombo"), ("Taiwan", "Taipei"),
    ("North Korea", "Pyongyang"), ("Georgia", "Tbilisi"), ("Armenia", "Yerevan"), ("Azerbaijan", "Baku"),
    ("Uzbekistan", "Tashkent"), ("Belarus", "Minsk"), ("Lithuania", "Vilnius"), ("Latvia", "Riga"),
    ("Estonia", "Tallinn"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Albania", "Tirana"),
    ("Cyprus", "Nicosia"), ("Malta", "Valletta"), ("Libya", "Tripoli"), ("Sudan", "Khartoum"), ("Wales", "Cardiff"),
    ("Oman", "Muscat"), ("Cambodia", "Phnom Penh"), ("Laos", "Vientiane"), ("Zambia", "Lusaka"),
    ("Somalia", "Mogadishu"), ("Rwanda", "Kigali"), ("Angola", "Luanda"), ("Mozambique", "Maputo"),
    ("Madagascar", "Antananarivo"), ("Haiti", "Port-au-Prince"), ("Costa Rica", "San Jose"), ("Nicaragua", "Managua"),
    ("Honduras", "Tegucigalpa"), ("the United States", "Washington"), ("Bolivia", "La Paz"), ("Yemen", "Sanaa"),
    ("Kazakhstan", "Astana"), ("Tanzania", "Dodoma"), ("South Africa", "Pretoria"), ("Myanmar", "Naypyidaw"),
]
_FACT_TEMPLATES = [("The capital of", "is"), ("The capital city of", "is"), ("The capital of", "is the city of"),
                   ("In", ", the capital city is")]
_LANDMARKS = [("Eiffel Tower", "Paris"), ("Colosseum", "Rome"), ("Big Ben", "London"), ("Brandenburg Gate", "Berlin"),
              ("Kremlin", "Moscow"), ("Acropolis", "Athens"), ("Forbidden City", "Beijing"),
              ("Sagrada Familia", "Barcelona"), ("Statue of Liberty", "New York"), ("Golden Gate Bridge", "San Francisco"),
              ("Tower of London", "London"), ("Louvre", "Paris"), ("Vatican", "Rome"), ("Prado Museum", "Madrid")]
_LANDMARK_TEMPLATES = [("The", "is located in the city of"), ("Tourists visit the", "in the city of")]
_LANGUAGES = [
    ("France", "French"), ("Germany", "German"), ("Italy", "Italian"), ("Spain", "Spanish"), ("Portugal", "Portuguese"),
    ("Brazil", "Portuguese"), ("Mexico", "Spanish"), ("Argentina", "Spanish"), ("Japan", "Japanese"),
    ("China", "Chinese"), ("Russia", "Russian"), ("Greece", "Greek"), ("Turkey", "Turkish"), ("Poland", "Polish"),
    ("Sweden", "Swedish"), ("Norway", "Norwegian"), ("Denmark", "Danish"), ("Finland", "Finnish"),
    ("the Netherlands", "Dutch"), ("Hungary", "Hungarian"), ("Egypt", "Arabic"), ("Saudi Arabia", "Arabic"),
    ("Iran", "Persian"), ("South Korea", "Korean"), ("Vietnam", "Vietnamese"), ("Thailand", "Thai"),
    ("Indonesia", "Indonesian"), ("Israel", "Hebrew"), ("Ukraine", "Ukrainian"), ("Romania", "Romanian"),
    ("the Czech Republic", "Czech"), ("Bulgaria", "Bulgarian"), ("Serbia", "Serbian"), ("Croatia", "Croatian"),
    ("Iceland", "Icelandic"), ("Chile", "Spanish"), ("Colombia", "Spanish"), ("Peru", "Spanish"), ("Cuba", "Spanish"),
    ("Austria", "German"), ("England", "English"), ("Australia", "English"), ("the United States", "English"),
    ("Pakistan", "Urdu"), ("Bangladesh", "Bengali"), ("Mongolia", "Mongolian"), ("Lithuania", "Lithuanian"),
    ("Latvia", "Latvian"), ("Estonia", "Estonian"), ("Slovakia", "Slovak"), ("Albania", "Albanian"),
    ("Georgia", "Georgian"), ("Armenia", "Armenian"), ("Malaysia", "Malay"), ("Morocco", "Arabic"),
    ("Venezuela", "Spanish"), ("Iraq", "Arabic"), ("Syria", "Arabic"), ("Canada", "English"), ("Ethiopia", "Amharic"),
]
_LANGUAGE_TEMPLATES = [("The official language of", "is"), ("In", ", most people speak"),
                       ("The language spoken in", "is")]
_CITY_COUNTRIES = [
    ("Toronto", "Canada"), ("Vancouver", "Canada"), ("Montreal", "Canada"), ("Sydney", "Australia"),
    ("Melbourne", "Australia"), ("Mumbai", "India"), ("Bangalore", "India"), ("Kolkata", "India"), ("Osaka", "Japan"),
    ("Kyoto", "Japan"), ("Munich", "Germany"), ("Hamburg", "Germany"), ("Frankfurt", "Germany"),
    ("Barcelona", "Spain"), ("Seville", "Spain"), ("Valencia", "Spain"), ("Milan", "Italy"), ("Naples", "Italy"),
    ("Venice", "Italy"), ("Florence", "Italy"), ("Lyon", "France"), ("Marseille", "France"), ("Nice", "France"),
    ("Shanghai", "China"), ("Hong Kong", "China"), ("Istanbul", "Turkey"), ("Saint Petersburg", "Russia"),
    ("Rio de Janeiro", "Brazil"), ("Sao Paulo", "Brazil"), ("Manchester", "England"), ("Liverpool", "England"),
    ("Glasgow", "Scotland"), ("Krakow", "Poland"), ("Porto", "Portugal"), ("Alexandria", "Egypt"),
    ("Casablanca", "Morocco"), ("Marrakech", "Morocco"), ("Johannesburg", "South Africa"),
    ("Cape Town", "South Africa"), ("Lagos", "Nigeria"), ("Karachi", "Pakistan"), ("Lahore", "Pakistan"),
    ("Geneva", "Switzerland"), ("Zurich", "Switzerland"), ("Antwerp", "Belgium"), ("Gothenburg", "Sweden"),
    ("Bergen", "Norway"), ("Guadalajara", "Mexico"), ("Cancun", "Mexico"), ("Medellin", "Colombia"),
    ("Busan", "South Korea"), ("Ho Chi Minh City", "Vietnam"), ("Chiang Mai", "Thailand"), ("Bali", "Indonesia"),
    ("Auckland", "New Zealand"), ("Tel Aviv", "Israel"), ("Mecca", "Saudi Arabia"), ("Edinburgh", "Scotland"),
    ("Salzburg", "Austria"),
    ("Thessaloniki", "Greece"), ("Odessa", "Ukraine"), ("Havana", "Cuba"),
]
_CITY_TEMPLATES = [("The city of", "is located in"), ("The city of", "is in the country of"),
                   ("I flew to", ", a city in the country of")]
_RELATION_GROUP = {"capital": "city", "landmark": "city", "language": "language", "city_country": "country"}
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


def _fact_pool() -> List[Tuple[List[Tuple[str, Optional[str]]], str, str, str]]:
    r"""Every factual prompt: (segments, answer, subject, relation), in a fixed order."""
    pool = []

    def add(relation, templates, pairs):
        for subject, answer in pairs:
            for pre, post in templates:
                sep = "" if post.startswith(",") else " "
                pool.append(([(pre, None), (" " + subject, "evidence"), (sep + post, None)], answer, subject, relation))

    add("capital", _FACT_TEMPLATES, _PLACES_FACTS + _MORE_CAPITALS)
    add("landmark", _LANDMARK_TEMPLATES, _LANDMARKS)
    add("language", _LANGUAGE_TEMPLATES, _LANGUAGES)
    add("city_country", _CITY_TEMPLATES, _CITY_COUNTRIES)
    return pool


def fact_answer_tokens(tokenizer) -> Dict[str, List[int]]:
    r"""The first tokens of every factual answer, by kind (``"city"``, ``"language"``, ``"country"``):
    the foils to choose a fact item's strongest wrong answer from (``meta["group"]``)."""
    out: Dict[str, set] = {}
    for _, answer, _, relation in _fact_pool():
        out.setdefault(_RELATION_GROUP[relation], set()).add(_first_token(tokenizer, " " + answer))
    return {g: sorted(v) for g, v in out.items()}


def _facts(tokenizer, rng: random.Random, n: int) -> List[TaskItem]:
    pool = _fact_pool()
    rng.shuffle(pool)
    answers: Dict[str, set] = {}
    for _, answer, _, relation in pool:
        answers.setdefault(_RELATION_GROUP[relation], set()).add(answer)
    items = []
    for segs, answer, subject, relation in pool[:n]:
        group = _RELATION_GROUP[relation]
        foil = rng.choice(sorted(a for a in answers[group] if a != answer))
        item = build_item(tokenizer, "facts", segs, " " + answer, " " + foil,
                          {"subject": subject, "answer": answer, "relation": relation, "group": group})
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
        n: number of candidates drawn (``facts`` has at most 854 distinct ones:
            capitals, landmarks' cities, official languages and cities' countries).
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


# ----------------------------------------------------------------------------- a user's items
def _token_id(tokenizer, value: Union[int, str], what: str, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"item {line}: {what} must be a string or a token id, got {value!r}")
    if isinstance(value, int):
        return value
    ids = tokenizer(value, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"item {line}: {what} {value!r} has no tokens")
    return ids[0]


def items_from_records(records: Iterable[Mapping[str, Any]], tokenizer, task: str = "jsonl",
                       add_special_tokens: bool = False) -> List[TaskItem]:
    r"""Task items from dicts ``{"prompt", "target", "foil", "evidence"}`` (the JSONL format of docs/evaluation.md).

    Args:
        records: one dict per item: ``prompt`` (str), ``target`` (the continuation: a string,
            whose first token is explained, e.g. ``" are"`` with its leading space, or a token
            id), ``foil`` (optional, the same forms; absent or null: d = logit(target)),
            ``evidence`` (optional list: token positions (ints; negative ones count from the
            end) and / or substrings of the prompt, each meaning every token overlapping its
            first occurrence), ``alt_evidence`` (optional, the same forms) and ``meta``
            (optional dict of strings).
        tokenizer: a fast tokenizer (offsets needed for substring evidence).
        task: the items' task name.
        add_special_tokens: tokenize the prompt with the tokenizer's special tokens (BOS);
            False (default) as the generated tasks.

    Returns:
        The items, in order.

    Raises:
        ValueError: naming the item (1-based) for a missing prompt or target, a target equal to
            the foil, an evidence substring not in the prompt, an evidence position out of range
            or on the explained last token.
    """
    items = []
    for n, rec in enumerate(records, 1):
        if not isinstance(rec, Mapping) or not isinstance(rec.get("prompt"), str) or rec.get("target") is None:
            raise ValueError(f"item {n}: expected an object with a string 'prompt' and a 'target', got {rec!r}")
        text = rec["prompt"]
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        target = _token_id(tokenizer, rec["target"], "target", n)
        foil = None if rec.get("foil") is None else _token_id(tokenizer, rec["foil"], "foil", n)
        if foil == target:
            raise ValueError(f"item {n}: the target and the foil are the same token ({target}); give another foil")

        def positions(key: str) -> List[int]:
            out: List[int] = []
            for e in rec.get(key) or []:
                if isinstance(e, bool) or not isinstance(e, (int, str)):
                    raise ValueError(f"item {n}: {key} entries are token positions or substrings, got {e!r}")
                if isinstance(e, int):
                    p = e + len(ids) if e < 0 else e
                    if not 0 <= p < len(ids) - 1:
                        raise ValueError(f"item {n}: {key} position {e} is outside the prompt's first {len(ids) - 1} "
                                         "tokens (the last one is the explained position)")
                    out.append(p)
                    continue
                start = text.find(e)
                if start < 0 or not e:
                    raise ValueError(f"item {n}: {key} substring {e!r} is not in the prompt {text!r}")
                end = start + len(e)
                hit = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
                if not hit or hit[0] >= len(ids) - 1:
                    raise ValueError(f"item {n}: {key} substring {e!r} covers no token before the last one")
                out.extend(i for i in hit if i < len(ids) - 1)
            return sorted(set(out))

        items.append(TaskItem(task, text, ids, target, foil, positions("evidence"), positions("alt_evidence"),
                              {str(k): str(v) for k, v in (rec.get("meta") or {}).items()}))
    return items


def load_jsonl_task(path: str, tokenizer, task: str = "jsonl", add_special_tokens: bool = False) -> List[TaskItem]:
    r"""Task items from a JSONL file, one object per line (:func:`items_from_records`; blank lines skipped).

    Args:
        path: the file, e.g. lines like
            ``{"prompt": "The keys to the cabinet", "target": " are", "foil": " is", "evidence": ["keys"]}``.
        tokenizer: a fast tokenizer.
        task: the items' task name.
        add_special_tokens: tokenize with the tokenizer's special tokens.

    Returns:
        The items.
    """
    records = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {n}: not JSON ({err.msg})") from err
    return items_from_records(records, tokenizer, task, add_special_tokens)


# ----------------------------------------------------------------------------- metrics
def candidate_mask(length: int, exclude_sink: bool = False) -> Tensor:
    r"""(T,) bool: the positions that may be ranked or removed (never the explained last one;
    not position 0 with ``exclude_sink``)."""
    mask = torch.ones(length, dtype=torch.bool)
    mask[-1] = False
    if exclude_sink:
        mask[0] = False
    return mask


def _order(scores: Tensor, exclude_sink: bool, least_first: bool = False) -> Tensor:
    """Candidate positions by decreasing score (increasing with ``least_first``; ties: earlier first)."""
    cand = candidate_mask(scores.shape[-1], exclude_sink)
    key = scores.detach().double().masked_fill(~cand, float("inf") if least_first else float("-inf"))
    order = torch.argsort(key, descending=not least_first, stable=True)
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


def removal_sequences(input_ids: Sequence[int], scores: Tensor, ks: Sequence[int], exclude_sink: bool = False,
                      least_relevant_first: bool = False) -> Tuple[List[List[int]], List[List[int]]]:
    r"""The prompts of the deletion and insertion curves.

    Args:
        input_ids: the prompt's T token ids.
        scores: (T,) token scores.
        ks: numbers of removed / kept tokens (each clipped to the number of candidates).
        exclude_sink: position 0 is never removed (deletion) and always kept (insertion).
        least_relevant_first: rank by increasing score (the least relevant tokens first: the
            LeRF curve of ABPC; the most negative scores of a signed method come first).

    Returns:
        ``(deleted, inserted)``: for each k, the prompt without its top-k candidates, and the
        prompt reduced to its top-k candidates (plus position 0 with ``exclude_sink``, and the
        explained last token), order preserved.
    """
    order = _order(scores, exclude_sink, least_relevant_first).tolist()
    T = len(input_ids)
    deleted, inserted = [], []
    for k in ks:
        top = set(order[: min(k, len(order))])
        deleted.append([t for i, t in enumerate(input_ids) if i not in top])
        keep = top | {T - 1} | ({0} if exclude_sink else set())
        inserted.append([t for i, t in enumerate(input_ids) if i in keep])
    return deleted, inserted
