r"""A tiny word-level fast tokenizer (with BOS and offsets) for the tiny decoders of ``decoder_models.py``."""
from transformers import PreTrainedTokenizerFast

from decoder_models import VOCAB

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "he", "she", "feels", "happy", "sad", "right", "now", "is",
         "was", "and", "of", "in", "to", "it", "very", "big", "small", "red", "blue", "ran", "home", "today", "why",
         "what", "said", "house", "tree", "sun", "moon", "day", "night", "good", "bad", "we", "they", "you", "i",
         "hello", "world"]
assert len(SPECIALS) + len(WORDS) == VOCAB
CHAT_TEMPLATE = ("<s>{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}you {% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    r"""Whitespace word-level tokenizer of the 50-token vocabulary; encodes with a leading ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok
