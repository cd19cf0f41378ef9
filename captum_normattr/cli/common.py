r"""What the command-line modules share: errors, input files, model loading, devices, limits, one batch.

:mod:`captum_normattr.cli.main` (texts), :mod:`captum_normattr.cli.output` (what a text run writes),
:mod:`captum_normattr.cli.seq2seq` (encoder-decoders), :mod:`captum_normattr.cli.generate` (``generate``),
:mod:`captum_normattr.cli.images` (images) and :mod:`captum_normattr.cli.dataset` (dataset runs) import from
here; this module imports none of them, so the command line has no import cycle. It is the command line's one
door to :mod:`captum_normattr.models` (loading, the kind of model, position limits); the other command-line
modules reach the models through it and through the attribution API.

- :class:`CLIError`: a usage error (``captum-normattr: error: ...``, exit code 2).
- Inputs: :func:`split_lines` (``\n`` / ``\r\n`` only), :func:`read_utf8`,
  :func:`read_stdin_lines`, :func:`read_text_lines`.
- Models: :func:`load_model` (``trust_remote_code`` always explicit; :func:`check_remote_code`),
  :func:`resolve_device`, :func:`is_decoder`, :func:`is_encoder_decoder`, :func:`require_encoder_decoder`.
- Limits: :func:`resolve_max_length` and :func:`check_max_length` (``--max-length``); :func:`model_adapter`
  and :func:`inputs_device`.
- Running: :func:`build_attributions`, :func:`build_alti_plus` and :func:`explain_batch` (one method on one batch).
- Output: :func:`write_output` (``-o`` or stdout), :func:`can_print_blocks`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # the registry imports torch: the parsers (which import this module) stay light
    from captum_normattr.attr.methods import MethodSpec

PROG = "captum-normattr"
#: the registry key of the encoder-decoder method, which has its own input and output (:mod:`captum_normattr.cli.seq2seq`)
ALTI_PLUS = "alti-plus"

__all__ = [
    "ALTI_PLUS", "PROG", "REMOTE_CODE_FILES", "CLIError", "build_alti_plus", "build_attributions", "can_print_blocks",
    "check_max_length", "check_remote_code", "explain_batch", "inputs_device", "is_decoder", "is_encoder_decoder",
    "load_model", "looks_like_path", "model_adapter", "position_limit", "read_stdin_lines", "read_text_lines", "read_utf8", "require_encoder_decoder",
    "resolve_device", "resolve_max_length", "split_lines", "write_output",
]


class CLIError(Exception):
    r"""A user error: printed as ``captum-normattr: error: <message>``, exit code 2."""


def split_lines(text: str) -> List[str]:
    r"""The lines of ``text``, split at ``"\n"`` and ``"\r\n"`` only, a leading UTF-8 byte-order mark dropped.

    Unlike ``str.splitlines()``, U+2028, U+2029, U+0085, form feed, vertical tab and a lone
    ``"\r"`` do not end a line, so line numbers (the ids of dataset runs) are the numbers an
    editor shows.

    Args:
        text: the text.

    Returns:
        Its lines, without line ends (no empty last line for a text that ends with a newline).

    Examples:
        >>> split_lines("\ufeffa\r\nb\u2028c\n")
        ['a', 'b\u2028c']
    """
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_utf8(path: Path) -> str:
    r"""The text of a UTF-8 file, line ends untranslated (``newline=""``), a byte-order mark dropped.

    Raises:
        UnicodeDecodeError, OSError: as ``open`` and ``read`` do.
    """
    with open(path, encoding="utf-8-sig", newline="") as fh:
        return fh.read()


def read_stdin_lines() -> List[str]:
    r"""The lines of standard input (UTF-8), split as :func:`split_lines` does."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a replaced sys.stdin (io.StringIO)
        return split_lines(sys.stdin.read())
    try:
        return split_lines(buffer.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise CLIError("standard input is not UTF-8 text") from None


def read_text_lines(path: Path, file: str) -> List[str]:
    r"""The lines of a UTF-8 text file (split by :func:`split_lines`), or a :class:`CLIError` naming ``file``.

    Args:
        path: the file.
        file: its name as the user gave it (for the message).

    Returns:
        Its lines, without line ends.
    """
    try:
        return split_lines(read_utf8(path))
    except UnicodeDecodeError:
        raise CLIError(f"{file} is not a UTF-8 text file") from None
    except OSError as err:
        raise CLIError(f"cannot read {file}: {err.strerror or err}") from None


def looks_like_path(name: str) -> bool:
    r"""True for strings that cannot be a Hub id (``name`` or ``org/name``)."""
    return (
        name.startswith((".", "~", "/", "\\"))
        or name.endswith(("/", "\\"))
        or name.count("/") > 1
        or "\\" in name
    )


def load_model(name_or_path: Optional[str], device: Any, trust_remote_code: bool = False) -> Tuple[Any, Any, str]:
    r"""Load a model and its tokenizer for explanation (see :func:`_load_model`),
    with transformers' "Loading weights" progress bars turned off meanwhile.

    ``trust_remote_code`` (``--trust-remote-code``) is passed to every ``from_pretrained``;
    without it a model with its own code is refused (:func:`check_remote_code`) and
    transformers never prompts (a ``yes |`` on stdin cannot make it run code).
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return _load_model(name_or_path, device, trust_remote_code)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


#: files of a model folder whose ``auto_map`` names Python code of the folder to import
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json",
                     "processor_config.json", "feature_extractor_config.json", "image_processor_config.json")


def check_remote_code(folder: Path, name: str, trust_remote_code: bool) -> None:
    r"""Refuse a local model folder that asks to run its own Python code, unless ``--trust-remote-code``.

    Raises:
        CLIError: when one of :data:`REMOTE_CODE_FILES` has an ``auto_map`` and
            ``trust_remote_code`` is False.
    """
    if trust_remote_code:
        return
    for fname in REMOTE_CODE_FILES:
        try:
            data = json.loads(read_utf8(folder / fname))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            raise CLIError(f"model folder {name!r} asks to run its own Python code ({fname} has an 'auto_map'); "
                           "it is never run without --trust-remote-code (pass it only for code you have read and trust)")


def _remote_code_error(name: str, err: BaseException) -> Optional[CLIError]:
    r"""The :class:`CLIError` for transformers' refusal of custom code (``trust_remote_code=False``), else None."""
    if "trust_remote_code" not in str(err):
        return None
    return CLIError(f"model {name!r} needs to run its own Python code; it is never run without --trust-remote-code "
                    "(pass it only for code you have read and trust)")


def _tokenizer_problem(folder: Optional[Path], tok: Any) -> Optional[str]:
    r"""Why ``tok`` is no real tokenizer of the model (None if it is).

    transformers builds a default tokenizer holding nothing but its special tokens (BERT: 5)
    for a folder without tokenizer files; every word would be ``[UNK]``.
    """
    if folder is not None:
        names = [p.name.lower() for p in folder.iterdir() if p.is_file()]
        looks = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens_map", "added_tokens")
        if not any(n.startswith(looks) or n.endswith((".model", ".spm", ".tiktoken")) for n in names):
            return "has no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.txt, ...)"
    try:
        size, special = len(tok), len(set(getattr(tok, "all_special_tokens", []) or []))
    except TypeError:
        return None
    if size <= special:
        return f"has a tokenizer of {size} tokens, all of them special tokens"
    return None


def _load_model(name_or_path: Optional[str], device: Any, trust_remote_code: bool = False) -> Tuple[Any, Any, str]:
    r"""Load a model and its tokenizer for explanation.

    Classification checkpoints (``*ForSequenceClassification``) and causal LMs
    (``*ForCausalLM``, ``*LMHeadModel``) are loaded with their heads, so that the
    report can show predictions; anything else as the base model.

    Args:
        name_or_path: Hub name or local folder; None for the packaged MiniLM.
        device: torch device.

    Returns:
        (model in eval mode on ``device``, tokenizer, readable model name).

    Raises:
        CLIError: when the model or tokenizer cannot be loaded.
    """
    if name_or_path is None:
        try:
            from captum_normattr.models.loading import load_default_model
        except ImportError:
            load_default_model = None  # type: ignore[assignment]
        if load_default_model is not None:
            try:
                model, tok = load_default_model()
            except ImportError as err:
                raise CLIError(str(err)) from None
            return model.to(device).eval(), tok, "all-MiniLM-L6-v2 (packaged)"
        from captum_normattr.models.loading import default_model_path

        name_or_path = default_model_path()

    import transformers
    from transformers import AutoConfig, AutoTokenizer

    local = Path(name_or_path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise CLIError(f"model path {name_or_path!r} is a file; give a model folder (with config.json)")
        if not (local / "config.json").exists():
            raise CLIError(f"model folder {name_or_path!r} has no config.json")
        check_remote_code(local, name_or_path, trust_remote_code)
        source = str(local)
    elif looks_like_path(name_or_path):
        raise CLIError(f"model folder not found: {name_or_path}")
    else:
        source = name_or_path
    trust = {"trust_remote_code": bool(trust_remote_code)}  # explicit: transformers never prompts
    try:
        config = AutoConfig.from_pretrained(source, **trust)
    except Exception as err:  # noqa: BLE001 - any failure here is a bad name or no network
        refused = _remote_code_error(name_or_path, err)
        if refused is not None:
            raise refused from None
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CLIError(
            f"cannot load model {name_or_path!r}: {msg}\n"
            "  (a Hub name needs internet access or a local cache; a local model is a folder with config.json)"
        ) from None
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    if arch.endswith("ForSequenceClassification"):
        auto = transformers.AutoModelForSequenceClassification
    elif arch in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values():  # encoder-decoder with its LM head
        auto = transformers.AutoModelForSeq2SeqLM
    elif arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
        auto = transformers.AutoModelForCausalLM
    else:
        auto = transformers.AutoModel
    try:
        model = auto.from_pretrained(source, attn_implementation="eager", **trust)
    except Exception:  # noqa: BLE001 - retry without forcing eager attention
        try:
            model = auto.from_pretrained(source, **trust)
        except Exception as err:  # noqa: BLE001
            raise _remote_code_error(name_or_path, err) or CLIError(
                f"cannot load model weights of {name_or_path!r}: {err}") from None
    try:
        tok = AutoTokenizer.from_pretrained(source, **trust)
    except Exception as err:  # noqa: BLE001
        raise _remote_code_error(name_or_path, err) or CLIError(
            f"cannot load the tokenizer of {name_or_path!r}: {err}") from None
    problem = _tokenizer_problem(local if local.is_dir() else None, tok)
    if problem is not None:
        raise CLIError(f"model {name_or_path!r} {problem}: its texts cannot be tokenized (every word would be "
                       "unknown); save the model's tokenizer into the folder (tokenizer.save_pretrained(DIR))")
    return model.to(device).eval(), tok, name_or_path


def resolve_device(name: str) -> Any:
    r"""The ``torch.device`` of ``--device``, or a :class:`CLIError` when it is unknown or absent here."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"unknown device {name!r} (use e.g. cpu, cuda, cuda:0, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"device {name!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CLIError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise CLIError(f"device {name!r} requested but MPS is not available")
    return dev


def is_encoder_decoder(model: Any) -> bool:
    r"""True for an encoder-decoder with both stacks (not e.g. ``T5EncoderModel``, whose config says encoder-decoder)."""
    from captum_normattr.models.adapters import UnsupportedModelError
    from captum_normattr.models.seq2seq import is_seq2seq, seq2seq_base

    if not is_seq2seq(model):
        return False
    try:
        seq2seq_base(model)
    except UnsupportedModelError:
        return False
    return True


def require_encoder_decoder(model: Any, model_name: str, need: str) -> None:
    r"""Refuse a model that is not an encoder-decoder, saying what it is and which methods explain it.

    Args:
        model: the loaded model.
        model_name: its readable name (for the message).
        need: what asks for an encoder-decoder, e.g. ``"-m alti-plus needs"``.

    Raises:
        CLIError: when ``model`` is not an encoder-decoder with both stacks (:func:`is_encoder_decoder`).
    """
    from captum_normattr.models.seq2seq import supported_seq2seq_families

    if is_encoder_decoder(model):
        return
    cfg = model.config
    kind = "a decoder-only model" if is_decoder(model) or getattr(cfg, "is_decoder", False) else (
        "not an encoder-decoder" if getattr(cfg, "is_encoder_decoder", False) else "an encoder-only model")
    raise CLIError(
        f"{need} an encoder-decoder model (source and target), one of: {supported_seq2seq_families()}; "
        f"{model_name} is {kind} ({type(model).__name__}, model type {getattr(cfg, 'model_type', '?')!r}): "
        "explain its texts as TEXT arguments with -m alti, globenc, decompx, ff"
        + (" or alti-logit" if kind.startswith("a decoder") else "")
    )


def build_alti_plus(model: Any, conventions: str) -> Any:
    r"""The registry's ALTI+ (:data:`ALTI_PLUS`) for an encoder-decoder.

    Args:
        model: the encoder-decoder.
        conventions: ``"default"`` or ``"official"`` (``--conventions``).

    Returns:
        The :class:`~captum_normattr.attr.alti_plus.ALTIPlusAttribution`.

    Raises:
        CLIError: when ALTI+ cannot explain ``model``.
    """
    from captum_normattr.models.adapters import UnsupportedModelError

    from captum_normattr.attr.methods import get_method

    try:
        return get_method(ALTI_PLUS).build(model, conventions=conventions)
    except UnsupportedModelError as err:
        raise CLIError(f"method {ALTI_PLUS!r} cannot explain this model: {err}") from None


def is_decoder(model: Any) -> bool:
    r"""True for a decoder (``config.is_decoder`` or a ``*ForCausalLM`` / ``*LMHeadModel`` architecture)."""
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "is_decoder", False)) or any(
        a.endswith(("ForCausalLM", "LMHeadModel")) for a in (getattr(cfg, "architectures", None) or [])
    )


def explain_batch(spec: MethodSpec, attr: Any, input_ids: Any, mask: Any, target: Optional[int],
                   keep_maps: bool) -> Any:
    r"""Run one method on a batch: an :class:`~captum_normattr.result.AttributionResult`, or (B, T)
    scores from a registered method that has only ``attribute``.

    The registry says what to pass: ``target`` to the methods that use it, and to the map
    methods whether to keep the layer maps and form the full rollout (only for pictures).
    """
    from torch import Tensor

    from captum_normattr.result import AttributionResult

    kwargs: Dict[str, Any] = {"additional_forward_args": (mask,)}
    if spec.uses_target and target is not None:
        kwargs["target"] = target
    if spec.maps:
        kwargs.update(return_layer_maps=keep_maps, return_rollout=keep_maps)
    if spec.cls is not None or hasattr(attr, "decompose"):
        res = attr.decompose(input_ids, **kwargs)
    else:  # a registered factory's object with only attribute(): (B, T) scores
        res = attr.attribute(input_ids, **kwargs)
        if isinstance(res, tuple) and len(res) == 1:
            res = res[0]
    if not isinstance(res, (AttributionResult, Tensor)):
        raise CLIError(f"method {spec.key!r} returned {type(res).__name__}; expected an AttributionResult or (B, T) scores")
    return res


def build_attributions(specs: Sequence[MethodSpec], model: Any, options: argparse.Namespace) -> List[Tuple[MethodSpec, Any]]:
    r"""Every method of ``specs`` built for ``model``; a :class:`CLIError` names one that cannot explain it."""
    attrs = []
    if is_encoder_decoder(model):
        for spec in specs:
            if spec.key != ALTI_PLUS:
                raise CLIError(
                    f"method {spec.key!r} cannot explain this model: {type(model).__name__} "
                    f"({getattr(model.config, 'model_type', '?')}) is an encoder-decoder; the method for "
                    f"encoder-decoders is {ALTI_PLUS!r}: {PROG} --model PATH -m {ALTI_PLUS} --source TEXT "
                    "[--target-text TEXT] (docs/seq2seq.md)"
                )
    for spec in specs:
        try:
            attrs.append((spec, spec.build(model, options)))
        except (ValueError, TypeError, NotImplementedError) as err:
            raise CLIError(f"method {spec.key!r} cannot explain this model: {err}") from None
    return attrs


def model_adapter(model: Any, what: str) -> Any:
    r"""The architecture description of ``model`` (its adapter), or a :class:`CLIError` saying why there is none.

    Args:
        model: the loaded model.
        what: what needs it, at the start of the message (``"--image: the model 'DIR'"``).

    Returns:
        The model's :class:`~captum_normattr.arch.spec.ArchitectureSpec`.

    Raises:
        CLIError: when no registered family describes the model.
    """
    from captum_normattr.models.adapters import get_adapter

    try:
        return get_adapter(model)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise CLIError(f"{what} cannot be explained: {err}") from None


def inputs_device(model: Any) -> Any:
    r"""Where a batch of token ids goes for ``model``: its first parameter's device, or None when accelerate
    dispatched it over several devices (its hooks move the inputs).

    Args:
        model: the loaded model.

    Returns:
        A ``torch.device``, or None.
    """
    from captum_normattr.models.weights import is_dispatched

    return None if is_dispatched(model) else next(model.parameters()).device


def position_limit(model: Any) -> Optional[int]:
    r"""The longest input the model's position embeddings allow (None: unbounded or unknown)."""
    from captum_normattr.models.adapters import get_adapter, max_positions

    try:
        limit = max_positions(model, get_adapter(model))
    except Exception:  # noqa: BLE001 - no adapter (encoder-decoders, registered models): the config's number
        limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_max_length(tokenizer: Any, max_length: int, position_limit: Optional[int]) -> None:
    r"""Refuse a ``--max-length`` that leaves no room for text or exceeds the model's positions.

    Raises:
        CLIError: naming ``--max-length`` and the values it may take.
    """
    try:
        special = int(tokenizer.num_special_tokens_to_add(pair=False))
    except Exception:  # noqa: BLE001 - a tokenizer without the method
        special = 0
    if max_length <= special:
        raise CLIError(f"--max-length {max_length} leaves no room for text: the tokenizer adds {special} special "
                       f"token(s) to every text; give --max-length {special + 1} or more")
    if position_limit is not None and max_length > position_limit:
        raise CLIError(f"--max-length {max_length} exceeds the model's limit of {position_limit} tokens (its "
                       f"position embeddings); give --max-length {position_limit} or less, or leave it out (the "
                       "model's limit is the default)")


def resolve_max_length(model: Any, tokenizer: Any, max_length: Optional[int]) -> Optional[int]:
    r"""``max_length`` if given (checked by :func:`check_max_length`), else the smaller of the tokenizer's
    and the position embeddings' limits (or None)."""
    pos_limit = position_limit(model)
    if max_length is not None:
        check_max_length(tokenizer, max_length, pos_limit)
        return max_length
    limit = getattr(tokenizer, "model_max_length", None)
    out = limit if isinstance(limit, int) and 0 < limit < 100_000 else None
    if pos_limit is not None:
        out = min(out or pos_limit, pos_limit)
    return out


def write_output(text: str, output: Optional[str]) -> None:
    r"""Write ``text`` (with a final newline) to ``output``, or to stdout when it is None.

    On stdout, characters the terminal's encoding cannot show are replaced; a file is written
    as UTF-8, its folders created.

    Raises:
        CLIError: when the file cannot be written.
    """
    if output is None:
        try:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        except UnicodeEncodeError:
            enc = sys.stdout.encoding or "ascii"
            sys.stdout.write(text.encode(enc, "replace").decode(enc) + "\n")
        sys.stdout.flush()
        return
    path = Path(output).expanduser()
    tmp = None
    try:  # a temporary file of the same folder, renamed over the target: never a half-written output
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        raise CLIError(f"cannot write {output}: {err.strerror or err}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def can_print_blocks() -> bool:
    r"""True when stdout's encoding can print the Unicode block characters of the bars."""
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "\u2588\u2591\u258f".encode(enc)
    except (UnicodeEncodeError, LookupError):
        return False
    return True
