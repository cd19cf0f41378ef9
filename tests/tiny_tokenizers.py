r"""Small fast tokenizers of three families, built offline with the ``tokenizers`` library.

- :func:`byte_level_bpe`: GPT-2 style byte-level BPE (``Ġ`` spaces, ``Ċ`` newlines, bytes of
  rare characters as single tokens);
- :func:`sentencepiece_bpe`: Llama style SentencePiece BPE (``▁`` spaces, byte fallback
  ``<0xNN>``, a decoder that strips the first space);
- the WordPiece tokenizer of the packaged MiniLM is loaded by the tests themselves.
"""
from __future__ import annotations

from functools import lru_cache

CORPUS = [
    "The keys to the old wooden cabinet are on the table.",
    "The boys behind the tree are playing.",
    "An unbelievably good film, full of life.",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
] * 4


@lru_cache(maxsize=None)
def byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")


@lru_cache(maxsize=None)
def sentencepiece_bpe():
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def build(model):
        t = Tokenizer(model)
        t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
        return t

    t = build(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    t.train_from_iterator([c for c in CORPUS if "\u00e9" not in c], trainer)  # é is left to byte fallback
    state = json.loads(t.to_str())["model"]
    vocab = dict(state["vocab"])
    for b in range(256):  # the byte tokens are ordinary vocabulary entries, as in Llama's
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    t = build(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.add_special_tokens(["<unk>", "<s>", "</s>"])
    bos = t.token_to_id("<s>")
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
