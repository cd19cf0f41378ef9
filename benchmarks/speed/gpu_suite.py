r"""The GPU suite: CUDA equals CPU on tiny models, and the cost of every method on an 8B-shaped layer stack.

One script, meant to finish in under 8 minutes on one GPU (``python benchmarks/speed/gpu_suite.py --out
gpu_suite.json``); ``--smoke`` runs the same code at tiny sizes on the CPU in a few seconds
(``tests/health/test_benchmark_scripts.py``), so that it stays runnable on a machine without a GPU.

1. **Equality** (``equality``): tiny random models of every family kind, built on the CPU with a
   fixed seed (biases and norms moved away from 0 and 1), each method's scores on the CPU and on
   the device from a copy of the same model; the error is max |device - CPU| / max |CPU| over the
   scores (and, where the method has one, its completeness delta is reported too). float64 where
   the device computes it (every CUDA GPU does; the tolerance is 1e-10), else float32 (1e-5).

   * encoder: ``BertForSequenceClassification``: GlobEnc (N_ENC), ALTI, GlobEnc+FF, ALTI+FF, DecompX;
   * decoders: ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (GQA 4/2): GlobEnc, ALTI, GlobEnc+FF,
     ALTI-Logit, DecompX (next-token logit of token 7);
   * vision: ``ViTForImageClassification``: GlobEnc, ALTI, GlobEnc+FF, DecompX;
   * encoder-decoder: ``MarianMTModel``: ALTI+ (source and target-prefix scores).

   A padded batch of two examples (the second shorter) in every text family.

2. **Cost** (``stack``): a bare ``LlamaModel`` with the shape of Llama-3-8B (hidden 4096, 32
   heads, 8 key/value heads, FF 14336, SwiGLU, RMSNorm, vocabulary 1000, random weights, seed
   0) in bfloat16 on the device, ``--layers`` layers (2 and 4), at ``--tokens`` (1024, 4096,
   8192), batch 1: the sdpa forward pass and GlobEnc, ALTI, ALTI-Logit and DecompX (these two
   explain token 42 through ``unembedding=embed_tokens.weight``), each after a warm-up call at
   256 tokens (kernels compiled there), timed with the device synchronised, and its peak memory
   over what was allocated before the call (``torch.cuda.max_memory_allocated``). Ratios are to the
   forward pass of the same model and length in this process. The FF decomposition is left out:
   its O(T^2 D F) parts at this width are hours, not seconds.

3. **Projection** (``projection``): from the two layer counts, per_layer = (peak(L2) - peak(L1)) /
   (L2 - L1) and peak(32) = peak(L2) + (32 - L2) per_layer (the rule of
   ``benchmarks/memory/bigmodel_projection.py``, whose 32-layer projection of the float32 CPU figures plus
   its analytic bfloat16 casts, at 4096 tokens, is printed next to the measured one when
   ``benchmarks/results/bigmodel_projection.json`` is there), and the 32-layer time projected the
   same way, as a ratio to the 32-layer forward projected the same way.

Prints one table (``--out``: every record as JSON). Nothing here is asserted on timings; the
equality rows say ``ok`` or ``FAIL`` against their tolerance and the exit status is 1 if any fails.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402

from _bench import llama_model, random_ids  # noqa: E402

STACK = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
             vocab_size=1000, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
             rope_theta=500000.0)
SMOKE_STACK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                   vocab_size=1000, max_position_embeddings=256, hidden_act="silu")
STACK_METHODS = ("forward", "globenc", "alti", "alti_logit", "decompx")
LABELS = {"forward": "forward (sdpa)", "globenc": "GlobEnc", "alti": "ALTI", "ff": "GlobEnc+FF", "ff_alti": "ALTI+FF",
          "alti_logit": "ALTI-Logit", "decompx": "DecompX", "alti_plus": "ALTI+"}
TARGET = 42
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
BIGMODEL_JSON = os.path.join(BENCHMARKS, "results", "bigmodel_projection.json")


# ------------------------------------------------------------------------------ tiny models

def _perturb(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    r"""Biases, norm weights and 2-D weights away from their initialisation (so that bias mistakes show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "position" in name and p.dim() == 2 and "embed_positions" in name:
                continue  # sinusoidal tables
            if name.endswith("bias") and p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "norm" in name or "ln" in name.split(".")[-2]:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif p.dim() == 2:
                p.copy_(0.25 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def tiny_model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    r"""A tiny random model of ``kind`` (bert, gpt2, llama, vit, marian) in ``dtype``, on the CPU, eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "bert":
        m = tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=60, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=32, num_labels=3))
    elif kind == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_positions=32, n_embd=24, n_layer=2, n_head=4, n_inner=40))
    elif kind == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=60, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=40, max_position_embeddings=64, hidden_act="silu"))
    elif kind == "vit":
        m = tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=24, num_labels=3))
    elif kind == "marian":
        m = tf.MarianMTModel(tf.MarianConfig(
            vocab_size=40, decoder_vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24,
            max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return _perturb(m.to(dtype).eval())


def _text_batch(vocab: int, tokens: int = 7) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # the second example is shorter (right padding)
    return ids, mask


def equality_cases(kind: str) -> Dict[str, Callable[[torch.nn.Module, torch.device], Any]]:
    r"""name -> call(model, device) returning the scores (and the delta, where the method has one)."""
    from captum_normattr import (ALTIAttribution, ALTILogitAttribution, ALTIPlusAttribution, DecompXAttribution,
                                 FFIntegratedDecomposition, GlobEncAttribution)

    if kind == "marian":
        g = torch.Generator().manual_seed(2)
        src, tgt = torch.randint(3, 40, (2, 7), generator=g), torch.randint(3, 40, (2, 6), generator=g)
        tgt[:, 0] = 2

        def alti_plus(model, dev):
            s, t = ALTIPlusAttribution(model).attribute((src.to(dev), tgt.to(dev)))
            return torch.cat([s, t], -1)
        return {"alti_plus": alti_plus}
    if kind == "vit":
        x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))

        def vision(cls, **kw):
            def call(model, dev):
                xx = x.to(device=dev, dtype=next(model.parameters()).dtype)
                if cls is DecompXAttribution:
                    return cls(model, **kw).attribute(xx, target=1, return_convergence_delta=True)
                return cls(model, **kw).attribute(xx)
            return call
        return {"globenc": vision(GlobEncAttribution), "alti": vision(ALTIAttribution),
                "ff": vision(FFIntegratedDecomposition), "decompx": vision(DecompXAttribution)}
    vocab = 60
    ids, mask = _text_batch(vocab)

    def text(cls, target=None, delta=False, **kw):
        def call(model, dev):
            a = cls(model, **kw)
            args = dict(additional_forward_args=mask.to(dev))
            if target is not None:
                args["target"] = target
            if delta:
                args["return_convergence_delta"] = True
            return a.attribute(ids.to(dev), **args)
        return call
    cases = {"globenc": text(GlobEncAttribution), "alti": text(ALTIAttribution),
             "ff": text(FFIntegratedDecomposition, delta=True)}
    if kind == "bert":
        cases["ff_alti"] = text(FFIntegratedDecomposition, delta=True, contribution="alti")
        cases["decompx"] = text(DecompXAttribution, target=1, delta=True)
    else:
        cases["alti_logit"] = text(ALTILogitAttribution, target=7, delta=True)
        cases["decompx"] = text(DecompXAttribution, target=7, delta=True)
    return cases


def _flat(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach().double().cpu()]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def float64_works(device: torch.device) -> bool:
    r"""Whether the device computes a float64 matrix product (CUDA does; some backends do not)."""
    try:
        a = torch.ones(4, 4, dtype=torch.float64, device=device)
        return bool((a @ a)[0, 0].item() == 4.0)
    except (RuntimeError, TypeError):
        return False


def run_equality(device: torch.device, kinds: List[str]) -> List[dict]:
    r"""One record per (kind, method): the relative error of the device against the CPU, and the verdict."""
    dtype = torch.float64 if float64_works(device) else torch.float32
    tol = TOL[dtype]
    rows = []
    for kind in kinds:
        cpu_model = tiny_model(kind, dtype)
        dev_model = copy.deepcopy(cpu_model).to(device)
        for name, call in equality_cases(kind).items():
            rec = {"kind": kind, "method": name, "dtype": str(dtype).replace("torch.", ""), "tolerance": tol}
            try:
                with torch.no_grad():
                    ref = _flat(call(cpu_model, torch.device("cpu")))
                    got = _flat(call(dev_model, device))
                err = max(float((g - r).abs().max()) / max(float(r.abs().max()), 1e-30) for g, r in zip(got, ref))
                rec.update(rel_error=err, ok=bool(err <= tol and len(got) == len(ref)))
                if len(ref) > 1:  # the completeness delta of the CPU run, for scale
                    rec["cpu_delta"] = float(ref[-1].abs().max())
            except Exception as e:  # report and go on
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(rec)
    return rows


# ------------------------------------------------------------------------------ the stack

def stack_runner(name: str, model: Any) -> Callable[[torch.Tensor], Any]:
    r"""One call of ``name`` on the bare stack (the decoder runners of ``_bench``)."""
    from _bench import decoder_runner

    return decoder_runner(name, model, TARGET)


class Clock:
    r"""Wall time and peak memory of one call on ``device`` (CUDA: synchronised, allocator peak; CPU: RSS)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable, *args: Any) -> tuple:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(*args)
            torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
            return (torch.cuda.max_memory_allocated(self.device) - base) / 2**30, seconds
        from _bench import measure_peak

        mb, seconds = measure_peak(fn, *args)
        return mb / 1024, seconds


def run_stack(device: torch.device, config: dict, layers: List[int], tokens: List[int], methods: List[str],
              dtype: torch.dtype, warm_tokens: int, budget_s: float) -> List[dict]:
    r"""One record per (layers, tokens, method): GiB peak, seconds, ratio to the forward pass."""
    clock, rows, start = Clock(device), [], time.perf_counter()
    for n in layers:
        with torch.device(device):  # the weights drawn on the device (no 4 GB float32 copy on the host)
            model = llama_model(config, layers=n).to(dtype=dtype)
        runs = {m: stack_runner(m, model) for m in methods}
        if warm_tokens:
            warm = random_ids(1, warm_tokens, low=1, high=config["vocab_size"], cls=None, seed=1).to(device)
            with torch.no_grad():
                for m, fn in runs.items():  # compiles the kernels, outside the figures
                    fn(warm)
        for t in tokens:
            ids = random_ids(1, t, low=1, high=config["vocab_size"], cls=None).to(device)
            fwd_s = None
            for m, fn in runs.items():
                rec = {"layers": n, "tokens": t, "method": m, "dtype": str(dtype).replace("torch.", "")}
                if time.perf_counter() - start > budget_s:
                    rec.update(skipped=True, why=f"past the suite's time budget ({budget_s:.0f} s)")
                    rows.append(rec)
                    continue
                try:
                    gib, s = clock(fn, ids)
                    if m == "forward":
                        gib2, s2 = clock(fn, ids)  # the forward twice: the faster is the reference
                        gib, s = max(gib, gib2), min(s, s2)
                        fwd_s = s
                    rec.update(peak_gib=gib, seconds=s, ratio=None if fwd_s is None else s / fwd_s)
                except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
                    rec.update(failed=True, error=f"out of memory: {str(e)[:200]}")
                except Exception as e:
                    rec.update(failed=True, error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(rec)
                print(f"  stack {n} layers {t:>5} tok {LABELS[m]:<15} " + (
                    f"{rec['peak_gib']:7.2f} GiB {rec['seconds']:8.3f} s" + (
                        f" ({rec['ratio']:.2f}x)" if rec.get("ratio") and m != "forward" else "")
                    if "seconds" in rec else rec.get("error", rec.get("why", ""))), flush=True)
        del model, runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def project(rows: List[dict], layers: List[int], target_layers: int = 32) -> List[dict]:
    r"""Per (method, tokens): the peak and time projected to ``target_layers`` from the two layer counts."""
    if len(layers) < 2:
        return []
    lo, hi = layers[0], layers[-1]
    by = {(r["method"], r["tokens"], r["layers"]): r for r in rows if "seconds" in r}
    ref = {}
    if os.path.exists(BIGMODEL_JSON):
        with open(BIGMODEL_JSON) as f:
            saved = json.load(f)
        for r in saved.get("projection", []):
            if "peak_projected_gib" in r:
                ref[r["method"]] = (saved.get("project_tokens"), r["peak_projected_gib"] + r.get("upcast_gib", 0.0))
    out = []
    for (m, t, n), r_hi in sorted(by.items()):
        if n != hi or (m, t, lo) not in by:
            continue
        r_lo = by[(m, t, lo)]
        per_gib = max(r_hi["peak_gib"] - r_lo["peak_gib"], 0.0) / (hi - lo)
        per_s = max(r_hi["seconds"] - r_lo["seconds"], 0.0) / (hi - lo)
        rec = {"method": m, "tokens": t, "from_layers": [lo, hi], "per_layer_gib": per_gib, "per_layer_s": per_s,
               f"peak_{target_layers}_gib": r_hi["peak_gib"] + (target_layers - hi) * per_gib,
               f"seconds_{target_layers}": r_hi["seconds"] + (target_layers - hi) * per_s}
        if m in ref and ref[m][0] == t:
            rec["bigmodel_projection_gib"] = ref[m][1]  # CPU float32 projection + analytic bf16 casts (no weights)
        out.append(rec)
    fwd = {r["tokens"]: r[f"seconds_{target_layers}"] for r in out if r["method"] == "forward"}
    for r in out:
        if r["method"] != "forward" and fwd.get(r["tokens"]):
            r[f"ratio_{target_layers}"] = r[f"seconds_{target_layers}"] / fwd[r["tokens"]]
    return out


# ------------------------------------------------------------------------------ report

def report(eq: List[dict], stack: List[dict], proj: List[dict], device_name: str) -> str:
    lines = [f"device: {device_name}", "", "| part | model | method | figures | verdict |", "|:---|:---|:---|:---|:---|"]
    for r in eq:
        fig = f"rel. error {r['rel_error']:.1e} ({r['dtype']}, tol {r['tolerance']:g})" if "rel_error" in r else r.get("error", "")
        lines.append(f"| equality | {r['kind']} | {LABELS[r['method']]} | {fig} | {'ok' if r['ok'] else 'FAIL'} |")
    for r in stack:
        if "seconds" in r:
            fig = f"{r['peak_gib']:.2f} GiB, {r['seconds']:.3f} s"
            verdict = f"{r['ratio']:.2f}x forward" if r["method"] != "forward" and r.get("ratio") else "-"
        else:
            fig, verdict = r.get("error", r.get("why", "")), "failed" if r.get("failed") else "not run"
        lines.append(f"| stack {r['tokens']} tok | {r['layers']} layers {r['dtype']} | {LABELS[r['method']]} | {fig} | {verdict} |")
    for r in proj:
        fig = f"{r['peak_32_gib']:.2f} GiB, {r['seconds_32']:.2f} s (per layer {r['per_layer_gib']:.3f} GiB, {r['per_layer_s']:.3f} s)"
        if "bigmodel_projection_gib" in r:
            fig += f"; bigmodel_projection.py: {r['bigmodel_projection_gib']:.2f} GiB"
        verdict = f"{r['ratio_32']:.2f}x forward" if "ratio_32" in r else "-"
        lines.append(f"| 32 layers {r['tokens']} tok (projected) | from {r['from_layers']} | {LABELS[r['method']]} | {fig} | {verdict} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (a few seconds): checks the script")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="stack lengths (default 1024 4096 8192)")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="stack depths (default 2 4)")
    p.add_argument("--methods", nargs="+", default=list(STACK_METHODS[1:]), choices=STACK_METHODS[1:])
    p.add_argument("--kinds", nargs="+", default=["bert", "gpt2", "llama", "vit", "marian"])
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--budget-s", type=float, default=420.0, help="the stack stops starting calls past this many seconds")
    p.add_argument("--out", default=None, help="write every record here as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; run it on a GPU machine, or check the script with --smoke", file=sys.stderr)
        return 2
    config = SMOKE_STACK if args.smoke else STACK
    tokens = args.tokens or ([16, 32] if args.smoke else [1024, 4096, 8192])
    layers = args.layers or [2, 4]
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    t0 = time.perf_counter()
    eq = [] if args.skip_equality else run_equality(device, args.kinds)
    t_eq = time.perf_counter() - t0
    stack = run_stack(device, config, layers, tokens, ["forward", *args.methods], dtype,
                      warm_tokens=0 if args.smoke else 256, budget_s=args.budget_s - t_eq)
    proj = project(stack, layers)
    print(report(eq, stack, proj, name))
    total = time.perf_counter() - t0
    print(f"total {total:.0f} s (equality {t_eq:.0f} s)")
    if args.out:
        import transformers

        with open(args.out, "w") as f:
            json.dump({"meta": {"device": name, "smoke": args.smoke, "torch": torch.__version__,
                                "transformers": transformers.__version__, "stack_config": config, "layers": layers,
                                "tokens": tokens, "dtype": "bfloat16", "total_s": total,
                                "date": datetime.datetime.now().isoformat(timespec="seconds")},
                       "equality": eq, "stack": stack, "projection": proj}, f, indent=1)
    return 0 if all(r["ok"] for r in eq) else 1


if __name__ == "__main__":
    sys.exit(main())
