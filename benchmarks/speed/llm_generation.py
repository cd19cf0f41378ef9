r"""Explaining a generation: every generated token from one pass, against Captum's LLM attributions.

Usage:
    nice python benchmarks/speed/llm_generation.py --tokenizer DIR [--prompt-tokens 512] [--new-tokens 32]
        [--model TRAINED_DIR] [--methods alti-logit decompx alti globenc] [--decompx-targets K] [--fa-features 16] [--lig-prompt-tokens 64]
        [--lig-targets 8] [--lig-steps 8] [--threads 2] [--repeats 1] [--out results/llm_generation.json]

Model: the ~100M Llama-family config of the decoder benchmarks (hidden 768, 12 layers, 12 heads,
4 key/value heads, SwiGLU 2048; :data:`_bench.LLAMA_100M`) as a ``LlamaForCausalLM`` with random
weights (seed 0), float32, its vocabulary sized to the tokenizer's. ``--tokenizer``: any local
Hugging Face tokenizer folder (e.g. the packaged SmolLM2's; default: the folder the package
caches it in, ``~/.cache/captum_normattr/smollm2-135m-instruct``, if it exists).

1. Cost of explaining all n generated tokens against one: ``DecompositionLLMAttribution``
   with the n targets (one teacher-forced pass over P + n tokens, on the ``TextTemplateInput``
   below, whose text is the prompt's: the same tokens), beside the single-position call of the
   method's own class on the prompt (``explained_position="last"``: the first generated
   token); the ratio all/one is the target (<= 1.5 for n = 32 after a 512-token prompt).
2. Captum's ``LLMAttribution(FeatureAblation)`` with ``forward_in_tokens=False`` (one
   teacher-forced forward pass per perturbation; the default ``True`` re-decodes the n tokens one
   at a time, n times more) on a ``TextTemplateInput`` of ``--fa-features`` segments of the same
   prompt (the cost of feature ablation is one pass per feature: 512 token features would take
   513 passes), and ``LLMGradientAttribution(LayerIntegratedGradients)`` (``--lig-steps`` steps,
   one backward pass per step and generated token) on a shorter prompt (``--lig-prompt-tokens``)
   and the first ``--lig-targets`` targets. Our methods run on the very same inputs, and the
   agreement is the Spearman correlation of every ``token_attr`` row with Captum's (median
   over rows). Captum explains the log-probability, ours the logit: they differ by the
   logsumexp, which a random-weight model's near-uniform distribution keeps nearly constant.

With ``--model DIR`` a trained causal LM is used instead (e.g. the packaged SmolLM2-135M-Instruct
on a short prompt): on random weights the log-probabilities that Captum's methods explain barely
depend on the prompt, so only a trained model says anything about agreement.

The last line of the output is the JSON of all numbers (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)

from _bench import LLAMA_100M  # noqa: E402

METHODS = ("alti-logit", "decompx", "alti", "globenc")
TEXT = ("The history of the river valley is a story of floods, harvests and the slow work of many generations. "
        "Farmers learned to read the water, merchants built bridges, and the towns grew along the banks. ")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    r"""Spearman correlation of two 1-D tensors (ranks by average, no ties expected)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a.double().cpu().numpy(), b.double().cpu().numpy()).statistic)


def row_agreement(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    rows = [spearman(ours[k], theirs[k]) for k in range(ours.shape[0])]
    rows = [r for r in rows if r == r]
    return float(torch.tensor(rows).median()) if rows else float("nan")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def prompt_text(tok, n_tokens: int) -> str:
    ids = tok.encode(TEXT * (4 + n_tokens // 30), add_special_tokens=False)[: n_tokens]
    return tok.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_tok = Path("~/.cache/captum_normattr/smollm2-135m-instruct").expanduser()
    ap.add_argument("--tokenizer", default=str(default_tok) if default_tok.exists() else None)
    ap.add_argument("--model", default=None,
                    help="a local trained causal LM folder instead of the random ~100M Llama (its tokenizer by default)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--decompx-targets", type=int, default=None,
                    help="DecompX: explain only the first K targets (its cost grows with K: one adjoint walk each)")
    ap.add_argument("--fa-features", type=int, default=16)
    ap.add_argument("--lig-prompt-tokens", type=int, default=64)
    ap.add_argument("--lig-targets", type=int, default=8)
    ap.add_argument("--lig-steps", type=int, default=8)
    ap.add_argument("--skip-captum", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed calls of ours (the minimum is kept)")
    ap.add_argument("--out", default=os.path.join(BENCHMARKS, "results", "llm_generation.json"))
    args = ap.parse_args()
    if args.model is not None and args.tokenizer is None:
        args.tokenizer = args.model
    if args.tokenizer is None:
        ap.error("give --tokenizer DIR (a local Hugging Face tokenizer folder)")
    torch.set_num_threads(args.threads)

    from captum.attr import (FeatureAblation, LayerIntegratedGradients, LLMAttribution, LLMGradientAttribution,
                             TextTemplateInput, TextTokenInput)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from captum_normattr.attr.llm import DecompositionLLMAttribution
    from captum_normattr.attr.methods import get_method

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)
    if args.model is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        config = {"model": Path(args.model).name}
    else:
        cfg = LlamaConfig(**{**LLAMA_100M, "vocab_size": len(tok)})
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).eval()
        config = {**LLAMA_100M, "vocab_size": len(tok)}
    n_params = sum(p.numel() for p in model.parameters())
    text = prompt_text(tok, args.prompt_tokens)
    inp = TextTokenInput(text, tok)
    p = int(inp.inp_tensor.shape[1])
    with torch.no_grad():
        gen, gen_s = timed(lambda: model.generate(inp.inp_tensor, attention_mask=torch.ones_like(inp.inp_tensor),
                                                  max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                                  do_sample=False))
    targets = gen[0, p:]
    n = int(targets.shape[0])
    out = {"config": {**config, "parameters": n_params, "dtype": "float32",
                      "threads": args.threads, "prompt_tokens": p, "new_tokens": n}, "generate_s": gen_s,
           "ours": {}, "captum": {}}
    print(f"model {n_params / 1e6:.1f}M parameters, prompt {p} tokens, {n} generated ({gen_s:.1f} s)", flush=True)

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)

    # the prompt as --fa-features template segments: the same text, so the same tokens, for ours and for FA
    ids = inp.inp_tensor[0].tolist()
    has_bos = tok.bos_token_id is not None and ids[0] == tok.bos_token_id
    body = ids[1:] if has_bos else ids
    size = -(-len(body) // args.fa_features)
    values = [tok.decode(body[i:i + size]) for i in range(0, len(body), size)]
    tinp = TextTemplateInput("{}" * len(values), values=values)
    same = tok.encode(tinp.to_model_input(), return_tensors="pt")[0].tolist() == ids
    out["config"]["template_features"] = len(values)
    out["config"]["template_same_tokens"] = same
    if not same:
        print("warning: the template text encodes to other tokens than the prompt; timing on the token input")
    full = torch.cat([inp.inp_tensor[0], targets]).unsqueeze(0)
    ours_template = {}
    for name in args.methods:
        llm = DecompositionLLMAttribution(get_method(name).build(model), tok)
        single = get_method(name).build(model)  # explained_position "last": the first generated token
        kw = {"target": int(targets[0])} if name in ("alti-logit", "decompx") else {}
        t_all = t_one = float("inf")
        k = n if (name != "decompx" or args.decompx_targets is None) else min(n, args.decompx_targets)
        for _ in range(args.repeats):
            res, s = timed(lambda: llm.attribute(tinp if same else inp, target=targets[:k]))
            t_all = min(t_all, s)
            _, s = timed(lambda: single.attribute(full[:, :p], **kw))
            t_one = min(t_one, s)
        if same and k == n:
            ours_template[name] = res.token_attr
        out["ours"][name] = {"targets": k, "all_s": t_all, "one_s": t_one, "ratio_all_over_one": t_all / t_one}
        print(f"{name:10s} all {k}: {t_all:7.2f} s   one: {t_one:7.2f} s   ratio {t_all / t_one:5.2f}", flush=True)
        save()

    if not args.skip_captum:
        fa = LLMAttribution(FeatureAblation(model), tok)
        with torch.no_grad():
            fa_res, fa_s = timed(lambda: fa.attribute(tinp, target=targets, forward_in_tokens=False))
        entry = {"features": len(values), "s": fa_s, "forward_passes": len(values) + 1, "agreement": {}}
        print(f"FeatureAblation ({len(values)} template features): {fa_s:.2f} s", flush=True)
        for name, rows in ours_template.items():
            rho = row_agreement(rows, fa_res.token_attr)
            entry["agreement"][name] = {"spearman_median": rho}
            print(f"  {name:10s} Spearman with FA (median over rows) {rho:+.3f}", flush=True)
        out["captum"]["feature_ablation"] = entry
        save()

        # Layer integrated gradients on a shorter prompt and the first targets
        short = TextTokenInput(tok.decode(body[: args.lig_prompt_tokens]), tok)
        sp = int(short.inp_tensor.shape[1])
        with torch.no_grad():
            g2 = model.generate(short.inp_tensor, attention_mask=torch.ones_like(short.inp_tensor),
                                max_new_tokens=args.lig_targets, min_new_tokens=args.lig_targets, do_sample=False)
        t2 = g2[0, sp:]
        lig = LLMGradientAttribution(LayerIntegratedGradients(model, model.model.embed_tokens), tok)
        lig_res, lig_s = timed(lambda: lig.attribute(short, target=t2, n_steps=args.lig_steps))
        entry = {"prompt_tokens": sp, "targets": int(t2.shape[0]), "n_steps": args.lig_steps, "s": lig_s,
                 "agreement": {}}
        print(f"LayerIntegratedGradients ({sp} tokens, {t2.shape[0]} targets, {args.lig_steps} steps): {lig_s:.2f} s",
              flush=True)
        for name in args.methods:
            llm = DecompositionLLMAttribution(get_method(name).build(model), tok)
            ours_t, s = timed(lambda: llm.attribute(short, target=t2))
            rho = row_agreement(ours_t.token_attr, lig_res.token_attr)
            entry["agreement"][name] = {"spearman_median": rho, "ours_s": s}
            print(f"  {name:10s} ({s:.2f} s) Spearman with LIG (median over rows) {rho:+.3f}", flush=True)
        out["captum"]["layer_integrated_gradients"] = entry
        save()

    save()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
