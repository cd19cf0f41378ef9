r"""Contextualization change of the FF sub-block per layer on SST-2 sentences (Kobayashi et al. 2023).

Usage:
    python benchmarks/faithfulness/ff_contextualization.py [../shared/data/sst2/dev.tsv] [--data DIR] [--limit N] [--batch 16]
        [--gamma 0.01] [--out section.md]

On the packaged MiniLM (all-MiniLM-L6-v2, 6 post-LN layers), for every sentence of the TSV
(column ``sentence``) and every layer, the component-scope norm maps ATB, FF, RES2, LN2 of
``FFIntegratedDecomposition`` (closed-form IG) and the contextualization change
1 - Spearman(flattened maps) of each step (+FF: ATB -> FF, +RES2: FF -> RES2, +LN2: RES2 -> LN2)
and of the whole sub-block (ATB -> LN2); then the same with the low-gamma ablation (the
``--gamma`` share of LayerNorm dimensions with the lowest gamma ignored in the ATB and LN2
norms); then the FF amplification (row-normalised FF map minus row-normalised ATB map) and
its most amplified token pairs. Prints a markdown section (and writes it to --out).
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # measure the checkout this script lives in

STEPS = ("+FF", "+RES2", "+LN2", "ATB->LN2")
DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data next to the checkout


def read_sentences(path: str, limit: int = 0):
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r["sentence"].strip() for r in csv.DictReader(f, delimiter="\t")]
    return rows[:limit] if limit else rows


def _mean_std(x: torch.Tensor):
    x = x[torch.isfinite(x)]
    return float(x.mean()), float(x.std()) if x.numel() > 1 else 0.0


def code(t: str) -> str:
    return f"`` {t} ``" if "`" in t else f"`{t}`"


def pair_kind(tok_i: str, tok_j: str, i: int, j: int) -> str:
    if tok_i in ("[CLS]", "[SEP]") or tok_j in ("[CLS]", "[SEP]"):
        return "with [CLS]/[SEP]"
    if abs(i - j) == 1 and (tok_i.startswith("##") or tok_j.startswith("##")):
        return "subwords of one word"
    if not tok_i.isalnum() and not tok_i.startswith("##") or not tok_j.isalnum() and not tok_j.startswith("##"):
        return "with punctuation"
    if abs(i - j) == 1:
        return "adjacent words"
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tsv", nargs="?", default=None,
                   help="TSV with a 'sentence' column (default: DATA/sst2/dev.tsv)")
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="data folder holding sst2/dev.tsv (default: ../shared/data next to the repository)")
    p.add_argument("--limit", type=int, default=0, help="first N sentences only (0: all)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gamma", type=float, default=0.01, help="share of lowest-gamma LN dimensions ignored")
    p.add_argument("--top", type=int, default=3, help="amplified pairs per sentence and layer in the summary")
    p.add_argument("--out", default=None, help="also write the markdown section to this file")
    args = p.parse_args()
    args.data = args.tsv or str(Path(args.data) / "sst2" / "dev.tsv")

    from captum_normattr import FFIntegratedDecomposition, load_default_model
    from captum_normattr.decompose.methods.ff_analysis import (
        amplification_scores,
        scope_contextualization_changes,
        top_amplified_pairs,
    )

    t0 = time.perf_counter()
    model, tok = load_default_model()
    sentences = read_sentences(args.data, args.limit)
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))  # similar lengths per batch
    ffd = FFIntegratedDecomposition(model, ignore_low_gamma=args.gamma)
    n_layers = model.config.num_hidden_layers
    changes = {s: [] for s in STEPS}
    changes_abl = {s: [] for s in STEPS}
    top1 = [[] for _ in range(n_layers)]
    pair_counts = [Counter() for _ in range(n_layers)]
    kinds = [Counter() for _ in range(n_layers)]
    best = [[] for _ in range(n_layers)]
    max_err = torch.zeros(())
    n_tokens = 0
    for start in range(0, len(order), args.batch):
        idx = order[start : start + args.batch]
        batch = tok([sentences[i] for i in idx], return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        valid = mask.bool()
        with torch.no_grad():
            res = ffd.decompose(ids, additional_forward_args=(mask,))
        max_err = torch.maximum(max_err, res.extras["example_completeness_error"].max())
        n_tokens += int(mask.sum())
        for s, v in scope_contextualization_changes(res.extras, valid).items():
            changes[s].append(v)
        for s, v in scope_contextualization_changes(res.extras, valid, ablated=True).items():
            changes_abl[s].append(v)
        amp = amplification_scores(res.extras["scope_ATB"], res.extras["scope_FF"], valid)  # (B, L, T, T)
        for l in range(n_layers):
            for b, pairs in enumerate(top_amplified_pairs(amp[:, l], valid, k=args.top)):
                toks = tok.convert_ids_to_tokens(ids[b].tolist())
                if pairs:
                    top1[l].append(pairs[0][2])
                    i, j, sc = pairs[0]
                    kinds[l][pair_kind(toks[i], toks[j], i, j)] += 1
                for i, j, sc in pairs:
                    pair_counts[l][(toks[i], toks[j])] += 1
                    words = [t for t in toks[1:] if t not in ("[PAD]", "[SEP]")]
                    best[l].append((sc, toks[i], toks[j], " ".join(words[:12])))
    seconds = time.perf_counter() - t0
    ch = {s: torch.cat(v, 0) for s, v in changes.items()}  # (N, L)
    ch_abl = {s: torch.cat(v, 0) for s, v in changes_abl.items()}

    n = len(sentences)
    lines = [
        "## FF decomposition: contextualization change per layer (MiniLM, SST-2 validation)",
        "",
        f"`benchmarks/faithfulness/ff_contextualization.py`: packaged all-MiniLM-L6-v2 (6 post-LN layers, not fine-tuned; the maps "
        f"are class-agnostic) on {n} SST-2 validation sentences ({n_tokens} tokens with [CLS]/[SEP]"
        f"{', --limit ' + str(args.limit) if args.limit else ''}), `FFIntegratedDecomposition` closed-form IG, norm "
        f"maps of the component scopes; contextualization change = 1 - Spearman rho of the flattened T x T maps "
        f"(mean ± std over sentences). Largest completeness error over all sentences, layers and tokens "
        f"(FF output and layer output, float32): {float(max_err):.1e}. {seconds:.0f} s single-threaded.",
        "",
        "| layer | +FF (ATB→FF) | +RES2 (FF→RES2) | +LN2 (RES2→LN2) | ATB→LN2 (net) |"
        f" +FF, lowest {args.gamma:.0%} γ ignored | +LN2, γ ablation | ATB→LN2, γ ablation |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda x: "{:.3f} ± {:.3f}".format(*_mean_std(x))
    for l in range(n_layers):
        lines.append(f"| {l + 1} | " + " | ".join(fmt(ch[s][:, l]) for s in STEPS) + " | "
                     + " | ".join(fmt(ch_abl[s][:, l]) for s in ("+FF", "+LN2", "ATB->LN2")) + " |")
    lines.append("| mean | " + " | ".join(fmt(ch[s].mean(1)) for s in STEPS) + " | "
                 + " | ".join(fmt(ch_abl[s].mean(1)) for s in ("+FF", "+LN2", "ATB->LN2")) + " |")
    ff_mean = ch["+FF"].nanmean(0)
    top = int(ff_mean.argmax())
    net = ch["ATB->LN2"].nanmean(0)
    lines += [
        "",
        "(+RES2 with the ablation equals +RES2 without it: neither FF nor RES2 is a LayerNorm output.)",
        "",
        f"Compared with Kobayashi et al. 2023 (FF change about 0.2 on BERT-base, largely cancelled by RES2 and "
        f"LN2): here the FF change peaks at {float(ff_mean[top]):.3f} in layer {top + 1} (mean over layers "
        f"{float(ff_mean.mean()):.3f}), and the net change of the sub-block there is {float(net[top]):.3f}; over "
        f"all layers the net ATB→LN2 change is {float(net.mean()):.3f} against {float(ff_mean.mean()):.3f} for +FF "
        f"alone.",
        "",
        "### Most amplified token pairs",
        "",
        "Amplification score of (i, j) = row-normalised FF map minus row-normalised ATB map, entry (i, j) "
        "(share of token i's map that the FF block moves to source token j; diagonal excluded from the ranking). "
        f"Per layer: mean top-1 score, kind of the top-1 pair, and the token pairs (receiver ← source) most often "
        f"among the top {args.top} of a sentence.",
        "",
        "| layer | mean top-1 score | top-1 pair kinds | most frequent top pairs (count) |",
        "|---:|---:|---|---|",
    ]
    for l in range(n_layers):
        tot = sum(kinds[l].values())
        kind_s = ", ".join(f"{k} {100 * c / tot:.0f}%" for k, c in kinds[l].most_common())
        pairs_s = ", ".join(f"{code(a)}←{code(b)} ({c})" for (a, b), c in pair_counts[l].most_common(5))
        lines.append(f"| {l + 1} | {sum(top1[l]) / max(1, len(top1[l])):.3f} | {kind_s} | {pairs_s} |")
    lines += ["", "Highest single scores (layer, score, receiver ← source, sentence start):", ""]
    for l in range(n_layers):
        for sc, a, b, sent in sorted(best[l], reverse=True)[:2]:
            lines.append(f"- layer {l + 1}: {sc:.3f} {code(a)} ← {code(b)} — \"{sent}\"")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
