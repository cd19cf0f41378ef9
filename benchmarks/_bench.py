r"""Shared machinery of the benchmarks (``benchmarks/speed/``, ``benchmarks/memory/``, ``benchmarks/faithfulness/``).

Helpers: the resident-set size of this process, the peak extra memory and wall time of one
call (polled in a thread), interleaved timing with a warm-up and the median of repeats, and
running a child process of a benchmark script (a fresh process per memory figure, so that one
measurement's allocator state cannot leak into the next) whose answer is the last JSON line of
its standard output. Also the models the decoder benchmarks share: the ~100M Llama-family
config (:data:`LLAMA_100M`), a seeded bare ``LlamaModel`` of any config
(:func:`llama_model`) and one call of each decoder method on it (:func:`decoder_runner`).

The scripts import it as ``import _bench`` after putting ``benchmarks/`` (the folder above their
group's) on ``sys.path``; a script imports the other scripts of its own group by name (Python
puts the script's folder on ``sys.path`` for ``python benchmarks/<group>/X.py``, from any
working directory). ``python benchmarks/self_check.py`` checks these helpers
(``tests/health/test_benchmark_scripts.py`` runs it).
"""
from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["rss_mb", "measure_peak", "time_interleaved", "run_child", "print_json", "random_ids", "LLAMA_100M",
           "llama_model", "decoder_runner", "DECODER_TARGET", "DECODER_FAMILIES", "family_model"]

# The ~100M Llama-family decoder of benchmarks/speed/speed_decoder.py and memory_engine.py (97.6M parameters).
LLAMA_100M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=16384, hidden_act="silu")
DECODER_TARGET = 42  # the explained next token of ALTI-Logit / DecompX on the decoders


def rss_mb() -> float:
    r"""Resident-set size of this process in MiB (``VmRSS`` of ``/proc/self/status``).

    Returns:
        float: the current resident-set size in MiB, or ``nan`` where ``/proc`` has no
        ``VmRSS`` line (not Linux).

    Examples::

        >>> rss_mb() > 0
        True
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def measure_peak(
    fn: Callable[..., Any],
    *args: Any,
    poll_s: float = 0.002,
    limit_mb: Optional[float] = None,
    on_exceed: Optional[Callable[[float], None]] = None,
) -> Tuple[float, float]:
    r"""Peak extra memory and wall time of one call ``fn(*args)`` under ``torch.no_grad()``.

    The extra memory is the resident-set growth over the state before the call (after a
    ``gc.collect()``): a thread polls :func:`rss_mb` every ``poll_s`` seconds while ``fn``
    runs and keeps the maximum. Run it in a fresh process with the model and inputs already
    loaded, so that the baseline is "model loaded" and nothing freed earlier is reused.

    Args:
        fn (Callable): the call to measure; its result is dropped.
        *args: positional arguments of ``fn``.
        poll_s (float, optional): polling interval in seconds. Default: 0.002.
        limit_mb (float, optional): if given, ``on_exceed(extra_mb)`` is called from the
            polling thread as soon as the extra memory passes ``limit_mb`` (e.g. to print a
            verdict and ``os._exit`` before the machine runs out of memory). Default: None.
        on_exceed (Callable[[float], None], optional): see ``limit_mb``; required with it.

    Returns:
        tuple[float, float]: ``(extra_peak_mb, seconds)``, the peak resident-set growth in
        MiB during the call and the call's wall time in seconds.

    Examples::

        >>> extra_mb, seconds = measure_peak(lambda n: torch.ones(n), 10)
    """
    if limit_mb is not None and on_exceed is None:
        raise ValueError("measure_peak: limit_mb needs on_exceed (what to do when the limit is passed)")
    gc.collect()
    base = rss_mb()
    peak = [base]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            if limit_mb is not None and peak[0] - base > limit_mb:
                on_exceed(peak[0] - base)  # type: ignore[misc]
                return
            done.wait(poll_s)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(*args)
    seconds = time.perf_counter() - t0
    done.set()
    th.join()
    peak[0] = max(peak[0], rss_mb())  # a call shorter than one poll interval
    return peak[0] - base, seconds


def time_interleaved(
    runs: Mapping[str, Callable[..., Any]],
    args: Sequence[Any],
    repeats: int,
    *,
    max_repeats: Optional[Mapping[str, int]] = None,
    no_warm_up: Collection[str] = (),
    stat: str = "median",
) -> dict:
    r"""Median (or minimum) wall time of every run, with the repeats interleaved so that noise hits all alike.

    Under ``torch.no_grad()``: one warm-up call of every run (except those in
    ``no_warm_up``), then ``repeats`` rounds that each call every run once, in order.

    Args:
        runs (Mapping[str, Callable]): name -> callable, each called as ``fn(*args)``.
        args (Sequence): the positional arguments of every call.
        repeats (int): number of interleaved rounds.
        max_repeats (Mapping[str, int], optional): name -> at most this many timed calls
            (the first rounds), for runs too slow to repeat. Default: None.
        no_warm_up (Collection[str], optional): names whose warm-up call is skipped (runs
            long enough not to need one). Default: ().
        stat (str, optional): ``"median"`` or ``"min"`` of the timed calls. Default: "median".

    Returns:
        dict: name -> median (or minimum) seconds over its timed calls.

    Examples::

        >>> med = time_interleaved({"a": lambda x: x + 1, "b": lambda x: x * 2}, (torch.ones(3),), 3)
        >>> sorted(med)
        ['a', 'b']
    """
    max_repeats = dict(max_repeats or {})
    unknown = (set(max_repeats) | set(no_warm_up)) - set(runs)
    if unknown:
        raise ValueError(f"time_interleaved: unknown run names {sorted(unknown)}; the runs are {list(runs)}")
    times: dict = {n: [] for n in runs}
    with torch.no_grad():
        for n, fn in runs.items():
            if n not in no_warm_up:
                fn(*args)
        for r in range(repeats):
            for n, fn in runs.items():
                if r >= max_repeats.get(n, repeats):
                    continue
                t0 = time.perf_counter()
                fn(*args)
                times[n].append(time.perf_counter() - t0)
    pick = min if stat == "min" else statistics.median
    return {n: pick(v) for n, v in times.items()}


def run_child(
    script: str,
    argv: Sequence[str],
    *,
    ok_returncodes: Collection[int] = (0,),
    what: Optional[str] = None,
) -> dict:
    r"""Run ``python script *argv`` in a fresh process and parse the last JSON line of its stdout.

    Args:
        script (str): path of the script (usually the caller's ``__file__``).
        argv (Sequence[str]): its command-line arguments.
        ok_returncodes (Collection[int], optional): exit statuses that count as success
            (a child that aborts on purpose may exit non-zero after printing its answer).
            Default: (0,).
        what (str, optional): a description of the child for the error message.
            Default: the command line.

    Returns:
        dict: the last line of stdout that starts with ``{``, parsed as JSON.

    Raises:
        RuntimeError: if the child exits with another status or prints no JSON line; the
            message names the command and quotes the tail of the child's stderr.

    Examples::

        >>> run_child(__file__, ["--_memory_child", "forward"])  # doctest: +SKIP
        {'method': 'forward', 'extra_peak_mb': 12.0, 'seconds': 0.01}
    """
    cmd = [sys.executable, str(script), *map(str, argv)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode not in ok_returncodes or not lines:
        why = f"exit status {out.returncode}" if out.returncode not in ok_returncodes else "no JSON line on stdout"
        raise RuntimeError(f"benchmark child {what or ' '.join(cmd)} failed ({why}); its stderr ends with:\n"
                           f"{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def print_json(record: Mapping[str, Any]) -> None:
    r"""Print ``record`` as one JSON line and flush: the answer of a child for :func:`run_child`.

    Args:
        record (Mapping[str, Any]): JSON-serialisable values.

    Examples::

        >>> print_json({"method": "forward", "extra_peak_mb": 1.0})
        {"method": "forward", "extra_peak_mb": 1.0}
    """
    print(json.dumps(dict(record)), flush=True)


def random_ids(
    batch: int,
    tokens: int,
    *,
    low: int = 1000,
    high: int = 20000,
    cls: Optional[int] = 101,
    sep: Optional[int] = None,
    seed: int = 0,
) -> torch.Tensor:
    r"""Reproducible random token ids for timing: uniform in ``[low, high)``, optional first/last token.

    Args:
        batch (int): number of examples.
        tokens (int): sequence length.
        low (int, optional): smallest id drawn. Default: 1000 (past BERT's special tokens).
        high (int, optional): one past the largest id drawn. Default: 20000.
        cls (int, optional): id put at position 0 (BERT's ``[CLS]`` is 101); None: none.
            Default: 101.
        sep (int, optional): id put at the last position (BERT's ``[SEP]`` is 102); None: none.
            Default: None.
        seed (int, optional): seed of the private generator (the global RNG is untouched).
            Default: 0.

    Returns:
        Tensor: int64 ids of shape ``(batch, tokens)``.

    Examples::

        >>> random_ids(2, 8, sep=102)[:, [0, -1]].tolist()
        [[101, 102], [101, 102]]
    """
    ids = torch.randint(low, high, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    if cls is not None:
        ids[:, 0] = cls
    if sep is not None:
        ids[:, -1] = sep
    return ids


def llama_model(config: Mapping[str, Any], layers: Optional[int] = None, seed: int = 0):
    r"""A bare ``LlamaModel`` of ``config`` with random weights (seeded), sdpa attention, in eval mode.

    Args:
        config (Mapping[str, Any]): ``LlamaConfig`` keyword arguments (e.g. :data:`LLAMA_100M`).
        layers (int, optional): ``num_hidden_layers`` instead of the config's. Default: None.
        seed (int, optional): ``torch.manual_seed`` before the weights are drawn. Default: 0.

    Returns:
        LlamaModel: float32, on the CPU.

    Examples::

        >>> model = llama_model(dict(hidden_size=32, num_attention_heads=4, intermediate_size=64,
        ...                          vocab_size=100), layers=2)
        >>> len(model.layers)
        2
    """
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**config, **({} if layers is None else {"num_hidden_layers": layers})})
    cfg._attn_implementation = "sdpa"
    return LlamaModel(cfg).eval()


#: the decoder families :func:`family_model` builds beside Llama (one of each new topology's figures)
DECODER_FAMILIES = ("llama", "mixtral", "qwen2_moe", "gpt_neox", "gemma2")


def family_model(family: str, config: Mapping[str, Any], layers: Optional[int] = None, seed: int = 0):
    r"""A bare decoder of ``family`` shaped like the Llama ``config``, random weights (seeded), sdpa, eval mode.

    ``llama``: :func:`llama_model`. ``mixtral``: the same attention and norms, the FF a sparse block of
    4 experts, top-2, each of half the Llama FF width (the FF width a token uses is the Llama one), the
    default ``grouped_mm`` experts kernel; ``qwen2_moe``: the same plus a shared expert of half the
    width (sigmoid-gated) and qkv biases. ``gpt_neox`` (parallel attention + FF): LayerNorms, one fused
    per-head QKV, full multi-head attention (as many key/value heads as heads), rotary on a quarter of
    each head (Pythia's ``rotary_pct``), a GELU FF of the Llama FF width (2 matrices, not 3), untied
    embeddings; ``gemma2`` (sandwich norms): the Llama heads and key/value heads (``head_dim`` = hidden /
    heads, ``query_pre_attn_scalar`` = head_dim), GeGLU of the Llama FF width, ``1 + w`` RMSNorms, attention
    soft-capping 50 and the default sliding window (4096, every other layer), with the eager attention (sdpa
    has no soft-capping).

    Args:
        family (str): one of :data:`DECODER_FAMILIES`.
        config (Mapping[str, Any]): ``LlamaConfig`` keyword arguments (e.g. :data:`LLAMA_100M`).
        layers (int, optional): ``num_hidden_layers`` instead of the config's. Default: None.
        seed (int, optional): ``torch.manual_seed`` before the weights are drawn. Default: 0.

    Returns:
        The bare model, float32, on the CPU.
    """
    if family == "llama":
        return llama_model(config, layers, seed)
    import transformers as tf

    cfg = {**config, **({} if layers is None else {"num_hidden_layers": layers})}
    half = int(cfg.pop("intermediate_size")) // 2
    if family == "mixtral":
        config_obj = tf.MixtralConfig(**cfg, num_local_experts=4, num_experts_per_tok=2, intermediate_size=half)
        cls = tf.MixtralModel
    elif family == "qwen2_moe":
        config_obj = tf.Qwen2MoeConfig(**cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=half,
                                       shared_expert_intermediate_size=half, intermediate_size=2 * half,
                                       use_sliding_window=False)
        cls = tf.Qwen2MoeModel
    elif family == "gpt_neox":
        config_obj = tf.GPTNeoXConfig(
            hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"], intermediate_size=2 * half, vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"], hidden_act="gelu", rotary_pct=0.25,
            use_parallel_residual=True, tie_word_embeddings=False)
        cls = tf.GPTNeoXModel
    elif family == "gemma2":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg.pop("hidden_act", None)
        config_obj = tf.Gemma2Config(**cfg, intermediate_size=2 * half, head_dim=head_dim,
                                     query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh")
        cls = tf.Gemma2Model
    else:
        raise ValueError(f"unknown decoder family {family!r}; choose from {DECODER_FAMILIES}")
    torch.manual_seed(seed)
    config_obj._attn_implementation = "eager" if family == "gemma2" else "sdpa"  # sdpa has no soft-capping
    model = cls(config_obj).eval()
    with torch.no_grad():  # routers drawn at std 1 (Qwen's start at zero: every token would tie)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return model


def decoder_runner(name: str, model: Any, target: int = DECODER_TARGET) -> Callable[[torch.Tensor], Any]:
    r"""One call of a decoder method on a bare ``LlamaModel``, as a function of the token ids.

    ``forward`` (the plain forward pass), ``globenc`` (the pre-LN default map), ``alti``,
    ``alti_logit`` and ``decompx`` (both with the input embedding matrix as ``unembedding`` and
    the next token ``target``; DecompX's call is :meth:`DecompXAttribution.decompose`, the
    computation of ``attribute`` on a decoder, whose result also says which algorithm ran), ``ff``
    (:class:`FFIntegratedDecomposition` with its defaults).

    Args:
        name (str): one of ``forward``, ``globenc``, ``alti``, ``alti_logit``, ``decompx``, ``ff``.
        model: a bare decoder (``LlamaModel``).
        target (int, optional): the explained next token. Default: :data:`DECODER_TARGET`.

    Returns:
        Callable: ``ids -> result`` (the attribution object is built once, outside the call).

    Raises:
        ValueError: for an unknown name.

    Examples::

        >>> run = decoder_runner("alti", llama_model(LLAMA_100M, layers=1))  # doctest: +SKIP
        >>> run(random_ids(1, 16, low=100, high=30000, cls=None)).shape  # doctest: +SKIP
    """
    from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution

    if name == "forward":
        return lambda ids: model(input_ids=ids, use_cache=False)
    if name == "globenc":
        a = GlobEncAttribution(model)  # the pre-LN default map
        return lambda ids: a.attribute(ids)
    if name == "alti":
        a = ALTIAttribution(model)
        return lambda ids: a.attribute(ids)
    emb = model.get_input_embeddings().weight  # embed_tokens (Llama, Gemma, MoE), embed_in (GPT-NeoX)
    if name == "alti_logit":
        a = ALTILogitAttribution(model, unembedding=emb)
        return lambda ids: a.attribute(ids, target=target)
    if name == "decompx":  # a bare model with an unembedding: no LM head needed
        d = DecompXAttribution(model, unembedding=emb)
        return lambda ids: d.decompose(ids, target=target)
    if name == "ff":  # the FF decomposition (GlobEnc+FF: RES2 scope, gated FF by Gauss-Legendre)
        from captum_normattr import FFIntegratedDecomposition

        f = FFIntegratedDecomposition(model)
        return lambda ids: f.attribute(ids)
    raise ValueError(f"unknown decoder method {name!r}; choose forward, globenc, alti, alti_logit, decompx or ff")
