r"""A synthetic translation task with known word alignments (the ALTI+ alignment benchmark's data).

Task. A random bilingual dictionary over word-level ids (no tokenizer): 2 determiners,
12 adjectives, 24 nouns, 12 verbs, 4 adverbs, each mapped to a target word (one-to-one),
except that 6 nouns become two-token compounds and 4 verbs become "stem + auxiliary" (one
source word to two target words, both sure links). Source sentences come from the grammar
``NP V NP [ADV]`` with ``NP = [DET] ADJ{0,2} N``. The target applies three reordering rules:
SVO to SOV (the verb goes to the end), adjective-noun swap inside each NP (``DET N ADJ...``),
and the adverb moves from the end to the front. It also inserts an object particle after
the object NP that has no source word: its link to the object noun is *possible* only
(S ⊂ P). Test sentences never occur in training.

Sentences are word ids (no tokenizer); :func:`encode` pads a batch the way a Marian model
reads it (``PAD`` is also the decoder start token). ``benchmarks/faithfulness/mt_alignment.py``
trains a tiny Marian model on it and scores ALTI+ alignments with
:mod:`captum_normattr.evaluation.alignment`.

Examples:
    >>> import random
    >>> lp = build_language_pair(0)
    >>> ex = generate_example(random.Random(0), lp)
    >>> sorted(t for t, _ in ex.sure | ex.possible) == list(range(len(ex.tgt)))  # every target word linked once
    True
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import torch

__all__ = [
    "EOS", "N_ADJ", "N_ADV", "N_AUX_VERBS", "N_COMPOUND_NOUNS", "N_DET", "N_NOUN", "N_VERB", "PAD",
    "Example", "LanguagePair", "build_language_pair", "encode", "generate_example", "make_datasets",
]

PAD, EOS = 0, 1  # Marian: decoder_start_token_id = pad_token_id
N_DET, N_ADJ, N_NOUN, N_VERB, N_ADV = 2, 12, 24, 12, 4
N_COMPOUND_NOUNS, N_AUX_VERBS = 6, 4


# --------------------------------------------------------------------------- the language pair
@dataclass
class LanguagePair:
    r"""A random dictionary: source word id -> list of target word ids, by category."""

    vocab: List[str]
    src: Dict[str, List[int]]  # category -> source ids
    translation: Dict[int, List[int]]  # source id -> target ids (1 or 2)
    particle: int

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


def build_language_pair(seed: int) -> LanguagePair:
    r"""Word-level vocabulary and a random one-to-one (some one-to-two) dictionary.

    Args:
        seed: the seed of the dictionary.

    Returns:
        The :class:`LanguagePair`.
    """
    rng = random.Random(seed)
    vocab = ["<pad>", "</s>"]

    def new(name: str) -> int:
        vocab.append(name)
        return len(vocab) - 1

    sizes = {"det": N_DET, "adj": N_ADJ, "noun": N_NOUN, "verb": N_VERB, "adv": N_ADV}
    src = {c: [new(f"{c}{i}") for i in range(n)] for c, n in sizes.items()}
    # target words: one per source word, in a shuffled order (so ids carry no hint), plus
    # compound second parts, the auxiliary and the object particle
    n_tgt = sum(sizes.values())
    tgt_names = [f"T{i}" for i in range(n_tgt)]
    rng.shuffle(tgt_names)
    tgt_ids = [new(n) for n in tgt_names]
    rng.shuffle(tgt_ids)
    it = iter(tgt_ids)
    translation = {s: [next(it)] for c in sizes for s in src[c]}
    for s in rng.sample(src["noun"], N_COMPOUND_NOUNS):
        translation[s].append(new(f"T_part{len(vocab)}"))
    aux = new("T_aux")
    for s in rng.sample(src["verb"], N_AUX_VERBS):
        translation[s].append(aux)
    particle = new("T_obj")
    return LanguagePair(vocab=vocab, src=src, translation=translation, particle=particle)


@dataclass
class Example:
    r"""One sentence pair: word ids, gold links ``(target position, source position)`` and target categories."""

    src: List[int]  # source word ids (no EOS)
    tgt: List[int]  # target word ids (no EOS)
    sure: set = field(default_factory=set)  # (t, s) word links
    possible: set = field(default_factory=set)  # possible-only links
    tgt_cat: List[str] = field(default_factory=list)  # category of every target word


def _noun_phrase(rng: random.Random, lp: LanguagePair) -> List[Tuple[str, int]]:
    words: List[Tuple[str, int]] = []
    if rng.random() < 0.7:
        words.append(("det", rng.choice(lp.src["det"])))
    for a in rng.sample(lp.src["adj"], rng.choice([0, 0, 1, 1, 2])):
        words.append(("adj", a))
    words.append(("noun", rng.choice(lp.src["noun"])))
    return words


def generate_example(rng: random.Random, lp: LanguagePair) -> Example:
    r"""One sentence pair and its gold alignment (sure and possible links).

    Args:
        rng: the random source.
        lp: the language pair.

    Returns:
        The :class:`Example`.
    """
    subj, obj = _noun_phrase(rng, lp), _noun_phrase(rng, lp)
    verb = ("verb", rng.choice(lp.src["verb"]))
    adv = [("adv", rng.choice(lp.src["adv"]))] if rng.random() < 0.3 else []
    src_words = subj + [verb] + obj + adv
    # positions of every source word
    pos = 0
    subj_pos = list(range(pos, pos + len(subj)))
    pos += len(subj)
    verb_pos = pos
    pos += 1
    obj_pos = list(range(pos, pos + len(obj)))
    pos += len(obj)
    adv_pos = [pos] if adv else []

    def np_order(np_pos: List[int]) -> List[int]:  # DET N ADJ...: the noun before the adjectives
        dets = [p for p in np_pos if src_words[p][0] == "det"]
        adjs = [p for p in np_pos if src_words[p][0] == "adj"]
        nouns = [p for p in np_pos if src_words[p][0] == "noun"]
        return dets + nouns + adjs

    order = adv_pos + np_order(subj_pos) + np_order(obj_pos) + ["PARTICLE"] + [verb_pos]
    ex = Example(src=[w for _, w in src_words], tgt=[])
    obj_noun = [p for p in obj_pos if src_words[p][0] == "noun"][0]
    for p in order:
        if p == "PARTICLE":
            ex.possible.add((len(ex.tgt), obj_noun))
            ex.tgt.append(lp.particle)
            ex.tgt_cat.append("particle")
            continue
        cat = src_words[p][0]
        for k, w in enumerate(lp.translation[src_words[p][1]]):
            ex.sure.add((len(ex.tgt), p))
            ex.tgt.append(w)
            ex.tgt_cat.append(cat if k == 0 else {"noun": "compound part 2", "verb": "auxiliary"}[cat])
    return ex


def make_datasets(lp: LanguagePair, seed: int, n_test: int) -> Tuple[List[Example], Callable[[int], List[Example]]]:
    r"""A held-out test set (distinct sentences) and an endless seeded training generator.

    Args:
        lp: the language pair.
        seed: the seed (the test set draws from ``seed + 1``, training from ``seed + 2``).
        n_test: test sentences.

    Returns:
        The test examples, and ``train_batch(n)``: ``n`` new training examples whose source
        sentence is not in the test set.
    """
    rng = random.Random(seed + 1)
    test, seen = [], set()
    while len(test) < n_test:
        ex = generate_example(rng, lp)
        if tuple(ex.src) not in seen:
            seen.add(tuple(ex.src))
            test.append(ex)
    train_rng = random.Random(seed + 2)

    def train_batch(n: int) -> List[Example]:
        out = []
        while len(out) < n:
            ex = generate_example(train_rng, lp)
            if tuple(ex.src) not in seen:
                out.append(ex)
        return out

    return test, train_batch


def encode(batch: Sequence[Example]) -> Dict[str, torch.Tensor]:
    r"""Right-padded tensors: source + EOS; decoder input [start] + y; labels y + EOS.

    Args:
        batch: the examples.

    Returns:
        ``src``, ``src_mask`` (B, S); ``dec``, ``dec_mask``, ``labels`` (B, T; labels -100 on pads).
    """
    B = len(batch)
    S = max(len(e.src) for e in batch) + 1
    T = max(len(e.tgt) for e in batch) + 1
    src = torch.full((B, S), PAD)
    src_mask = torch.zeros(B, S, dtype=torch.long)
    dec = torch.full((B, T), PAD)
    dec_mask = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100)
    for b, e in enumerate(batch):
        s = e.src + [EOS]
        src[b, : len(s)] = torch.tensor(s)
        src_mask[b, : len(s)] = 1
        d = [PAD] + e.tgt
        dec[b, : len(d)] = torch.tensor(d)
        dec_mask[b, : len(d)] = 1
        labels[b, : len(d)] = torch.tensor(e.tgt + [EOS])
    return {"src": src, "src_mask": src_mask, "dec": dec, "dec_mask": dec_mask, "labels": labels}
