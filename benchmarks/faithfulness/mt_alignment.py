r"""ALTI+ on a synthetic translation task with known word alignments (issue 16, item 5).

Usage (from the repository root; a few minutes on 2 CPU cores):
    python benchmarks/faithfulness/mt_alignment.py [--seed 0] [--steps 4000] [--n-test 300] \
        [--out benchmarks/results/mt_alignment.json]

No pretrained MT model is reachable here, so a tiny Marian-style model is trained on an
artificial language pair whose word alignments are known by construction.

Task (:mod:`captum_normattr.evaluation.alignment_task`, where its rules are written out): a
random bilingual dictionary over word-level ids, source sentences ``NP V NP [ADV]``, a target
that reorders them (SOV, noun before adjectives, adverb first), splits some words in two and
adds an object particle linked to the object noun as *possible* only (S ⊂ P). Test sentences
never occur in training.

Model. ``MarianMTModel`` from a ``MarianConfig`` (post-LN, sinusoidal positions, shared
embeddings, d_model 64, 2 + 2 layers, 4 heads, FF 256, eager attention), trained from
scratch with teacher forcing (AdamW, batch 64, warm-up then linear decay), float32. The
checkpoint goes to ``benchmarks/checkpoints/`` (git-ignored) and is reused by a later run
with the same seed and steps. Attribution runs in float64.

Protocol (teacher forcing of the reference target; decoder input ``[start, y_1 .. y_n]``,
row i predicts y_{i+1}). Each method gives a (T, S) score matrix per sentence; hard
alignments are the argmax over source positions, read in the ALTI+ paper's "output"
setting (row t for target word t, the row that predicts it) and, as a second column, the
"input" setting (row t + 1, where the word is the decoder input). The row predicting the
final EOS is not aligned; a target word whose argmax is the source EOS gets no link (the
official code's rule); pads are never chosen. AER is summed over the test set
(``captum_normattr.evaluation.alignment``). Methods:

- ALTI+ source contributions (``ALTIPlusAttribution.decompose(...).source_contributions``);
- cross-attention weights, mean of heads, last decoder layer, and mean over all layers
  (and each layer, in the JSON);
- Captum ``IntegratedGradients`` per target token: attribution of log p(y_{i+1}) to the
  source token embeddings (input of the encoder, embedding scale included; baseline = zero
  embeddings, positions unchanged; 32 Gauss-Legendre steps), *signed* sum over the
  embedding dimension (|sum| in the JSON as ``ig_abs``);
- random scores (uniform, seeded).

The JSON also holds: ALTI+ with the official code's conventions, the ALTI+ rollout after
each decoder layer, the ALTI of each cross-attention block alone and times the encoder
rollout (the official code's ``decoder.encoder_attn`` and ``alti_enc_cross_attn`` modes),
the cross-attention of each layer, and, per target-word category (noun, verb, auxiliary,
particle, ...), the share of words linked to a gold source word, to the EOS, or wrongly.

Also reported: the ALTI+ source share (sum of a row's source contributions) along the
target, by decoder row and by relative position; the model's held-out accuracy
(teacher-forced token accuracy and greedy exact match); and the cost of each method per
sentence (passes and wall time relative to one forward pass of the same batches).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))

from captum.attr import IntegratedGradients  # noqa: E402
from transformers import MarianConfig, MarianMTModel  # noqa: E402

from captum_normattr.evaluation.alignment import alignment_scores, batch_argmax_alignments  # noqa: E402
from captum_normattr.evaluation.alignment_task import (  # noqa: E402
    EOS, N_AUX_VERBS, N_COMPOUND_NOUNS, PAD, Example, build_language_pair, encode, make_datasets)

# --------------------------------------------------------------------------- model
def build_model(vocab_size: int, d_model: int, layers: int, heads: int, ffn: int, seed: int) -> MarianMTModel:
    torch.manual_seed(seed)
    cfg = MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        forced_eos_token_id=EOS,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        activation_function="gelu",
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
    )
    cfg._attn_implementation = "eager"  # cross-attention weights are read from the forward pass
    return MarianMTModel(cfg)


def seq2seq_loss(model: MarianMTModel, enc: Dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(
        input_ids=enc["src"],
        attention_mask=enc["src_mask"],
        decoder_input_ids=enc["dec"],
        decoder_attention_mask=enc["dec_mask"],
    )
    return F.cross_entropy(out.logits.transpose(1, 2), enc["labels"], ignore_index=-100)


def train(model: MarianMTModel, train_batch, steps: int, batch_size: int, lr: float, log_every: int = 500):
    r"""Teacher-forced cross-entropy, AdamW, linear warm-up (5%) then linear decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm)))
    )
    model.train()
    log = []
    t0 = time.perf_counter()
    running = 0.0
    for step in range(1, steps + 1):
        loss = seq2seq_loss(model, encode(train_batch(batch_size)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        if step % log_every == 0 or step == steps:
            n = log_every if step % log_every == 0 else step % log_every
            log.append({"step": step, "loss": round(running / n, 4), "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  step {step}: loss {running / n:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            running = 0.0
    model.eval()
    return log, time.perf_counter() - t0


@torch.no_grad()
def accuracy(model: MarianMTModel, test: Sequence[Example], batch_size: int = 64) -> Dict[str, float]:
    r"""Teacher-forced token accuracy (EOS included) and greedy exact match on the test set."""
    correct = total = exact = 0
    for i in range(0, len(test), batch_size):
        batch = test[i : i + batch_size]
        enc = encode(batch)
        logits = model(
            input_ids=enc["src"], attention_mask=enc["src_mask"],
            decoder_input_ids=enc["dec"], decoder_attention_mask=enc["dec_mask"],
        ).logits
        valid = enc["labels"] != -100
        correct += int(((logits.argmax(-1) == enc["labels"]) & valid).sum())
        total += int(valid.sum())
        # greedy decoding, no cache (tiny model)
        B, T = enc["labels"].shape
        dec = torch.full((B, 1), PAD)
        done = torch.zeros(B, dtype=torch.bool)
        for _ in range(T + 3):
            nxt = model(input_ids=enc["src"], attention_mask=enc["src_mask"], decoder_input_ids=dec).logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
            dec = torch.cat([dec, nxt[:, None]], 1)
            done |= nxt == EOS
            if bool(done.all()):
                break
        for b, e in enumerate(batch):
            hyp = dec[b, 1:].tolist()
            ref = e.tgt + [EOS]
            exact += int(hyp[: len(ref)] == ref)
    return {"token_accuracy": correct / total, "exact_match": exact / len(test), "n_test": len(test)}


# --------------------------------------------------------------------------- score matrices (B, T, S)
@torch.no_grad()
def forward_with_attention(model, enc) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    out = model(
        input_ids=enc["src"], attention_mask=enc["src_mask"],
        decoder_input_ids=enc["dec"], decoder_attention_mask=enc["dec_mask"],
        output_attentions=True,
    )
    cross = [a.mean(1) for a in out.cross_attentions]  # L x (B, T, S), mean of heads
    return out.logits, cross


def integrated_gradients(model, enc, n_steps: int) -> Tuple[torch.Tensor, float]:
    r"""IG of log p(y_{i+1}) w.r.t. the source token embeddings, for every decoder row i.

    Returns the signed scores (B, T, S) (attributions summed over the embedding dimension)
    and the mean absolute convergence delta over the real decoder rows (log-probability units).
    """
    enc_module = model.get_encoder()
    with torch.no_grad():
        emb = enc_module.embed_tokens(enc["src"]) * enc_module.embed_scale
    labels = enc["labels"].clamp(min=0)

    def logprob(inputs_embeds, src_mask, dec, dec_mask, lab):
        logits = model(
            inputs_embeds=inputs_embeds, attention_mask=src_mask,
            decoder_input_ids=dec, decoder_attention_mask=dec_mask,
        ).logits
        return logits.log_softmax(-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)  # (B, T)

    ig = IntegratedGradients(logprob)
    B, T = labels.shape
    out = torch.zeros(B, T, emb.shape[1], dtype=emb.dtype)
    deltas = []
    for i in range(T):
        attr, delta = ig.attribute(
            emb,
            baselines=torch.zeros_like(emb),
            target=i,
            additional_forward_args=(enc["src_mask"], enc["dec"], enc["dec_mask"], labels),
            n_steps=n_steps,
            return_convergence_delta=True,
        )
        out[:, i] = attr.sum(-1).detach()
        valid = enc["dec_mask"][:, i].bool()
        deltas.extend(delta.detach()[valid].abs().tolist())
    return out, sum(deltas) / max(1, len(deltas))


def alti_plus_scores(model, enc, timed: Dict[str, float]):
    r"""ALTI+ matrices (B, T, S): the final source contributions (timed call), the official-quirk
    variant, the rollout after each decoder layer, and the cross-attention block alone (last
    column of C^cross dropped) with and without the encoder rollout (the official code's
    ``decoder.encoder_attn`` and ``alti_enc_cross_attn`` modes). Also the source share (B, T)
    and the largest completeness error.
    """
    from captum_normattr.attr.alti_plus import ALTIPlusAttribution
    from captum_normattr.decompose.methods.alti_plus import alti_plus_rollout

    inputs, masks = (enc["src"], enc["dec"]), (enc["src_mask"], enc["dec_mask"])
    t0 = time.perf_counter()
    res = ALTIPlusAttribution(model).decompose(inputs, additional_forward_args=masks)
    timed["alti_plus"] += time.perf_counter() - t0
    sc = res.source_contributions.detach()
    if sc.shape != (*enc["dec"].shape, enc["src"].shape[1]):
        raise RuntimeError(
            f"ALTI+ source_contributions has shape {tuple(sc.shape)}, expected "
            f"{(*enc['dec'].shape, enc['src'].shape[1])} (rows = decoder input positions)"
        )
    mats = {"alti_plus": sc}
    off = ALTIPlusAttribution(model, conventions="official").decompose(inputs, additional_forward_args=masks)
    mats["alti_plus_official"] = off.source_contributions.detach()
    full = ALTIPlusAttribution(model).decompose(inputs, additional_forward_args=masks, return_layer_maps=True)
    S = enc["src"].shape[1]
    L = full.decoder_cross_maps.shape[1]
    _, _, layers = alti_plus_rollout(
        [full.decoder_self_maps[:, l] for l in range(L)],
        [full.decoder_cross_maps[:, l] for l in range(L)],
        full.encoder_rollout,
        return_layers=True,
    )
    for l in range(L):
        mats[f"alti_plus_layer{l}"] = layers[l][..., :S]
        cross = full.decoder_cross_maps[:, l, :, :S]
        mats[f"alti_cross_layer{l}"] = cross
        mats[f"alti_cross_enc_layer{l}"] = torch.matmul(cross, full.encoder_rollout)
    if (layers[-1][..., :S] - sc).abs().max() > 1e-9:
        raise RuntimeError("the last per-layer ALTI+ rollout differs from source_contributions")
    ce = {
        "default": max(float(torch.as_tensor(r.completeness_error).max()) for r in (res, full)),
        "official": float(torch.as_tensor(off.completeness_error).max()),
    }
    return mats, res.source_share.detach(), ce


# --------------------------------------------------------------------------- evaluation
def aer_table(scores: torch.Tensor, enc, batch: Sequence[Example]) -> Dict[Tuple[str, bool], List[set]]:
    r"""Hard alignments of one batch for every (setting, EOS may win) combination."""
    n_tgt = [len(e.tgt) for e in batch]
    out = {}
    for setting in ("output", "input"):
        for null_eos in (True, False):
            hyp = batch_argmax_alignments(scores, enc["src_mask"], n_tgt, setting=setting, null_eos=null_eos)
            out[(setting, null_eos)] = hyp
    return out


def evaluate(model, test: Sequence[Example], args) -> Dict:
    methods = ["alti_plus", "attn_last", "attn_mean", "ig", "ig_abs", "random"]
    if args.skip_alti_plus:
        methods.remove("alti_plus")
    L = model.config.decoder_layers
    methods += [f"attn_layer{l}" for l in range(L)]
    if not args.skip_alti_plus:
        methods += ["alti_plus_official"] + [
            f"{k}{l}" for k in ("alti_plus_layer", "alti_cross_layer", "alti_cross_enc_layer") for l in range(L)
        ]
    hyps: Dict[str, Dict] = {m: {} for m in methods}
    seconds = {"forward": 0.0, "attention": 0.0, "ig": 0.0, "alti_plus": 0.0}
    share_rows: List[List[float]] = []
    share_by_cat: Dict[str, List[float]] = {}
    completeness = []
    ig_delta = []
    gen = torch.Generator().manual_seed(args.seed + 3)
    warm = encode(test[: args.batch])
    with torch.no_grad():  # warm-up, so that the first timed forward pass is not a cold one
        model(input_ids=warm["src"], attention_mask=warm["src_mask"], decoder_input_ids=warm["dec"])
    for i in range(0, len(test), args.batch):
        batch = test[i : i + args.batch]
        enc = encode(batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=enc["src"], attention_mask=enc["src_mask"],
                  decoder_input_ids=enc["dec"], decoder_attention_mask=enc["dec_mask"])
        seconds["forward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        _, cross = forward_with_attention(model, enc)
        seconds["attention"] += time.perf_counter() - t0
        mats = {"attn_last": cross[-1], "attn_mean": torch.stack(cross).mean(0)}
        for l in range(L):
            mats[f"attn_layer{l}"] = cross[l]
        t0 = time.perf_counter()
        ig, d = integrated_gradients(model, enc, args.ig_steps)
        seconds["ig"] += time.perf_counter() - t0
        ig_delta.append(d)
        mats["ig"], mats["ig_abs"] = ig, ig.abs()
        mats["random"] = torch.rand(enc["dec"].shape + enc["src"].shape[1:], generator=gen, dtype=torch.float64)
        if not args.skip_alti_plus:
            alti_mats, share, ce = alti_plus_scores(model, enc, seconds)
            mats.update(alti_mats)
            completeness.append(ce)
            for b, e in enumerate(batch):
                share_rows.append(share[b, : len(e.tgt) + 1].tolist())  # rows 0..n (n predicts EOS)
                for t, c in enumerate(e.tgt_cat):
                    share_by_cat.setdefault(c, []).append(float(share[b, t]))
        for m in methods:
            for key, h in aer_table(mats[m], enc, batch).items():
                hyps[m].setdefault(key, []).extend(h)

    sure = [e.sure for e in test]
    possible = [e.possible for e in test]
    result = {}
    for m in methods:
        result[m] = {}
        for (setting, null_eos), h in hyps[m].items():
            sc = alignment_scores(h, sure, possible)
            key = f"{setting}" + ("" if null_eos else "_eos_excluded")
            result[m][key] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sc.to_dict().items()}

    # per target-word category (output setting, EOS may win): gold link / EOS (no link) / wrong
    gold = [(e.sure | e.possible) for e in test]
    by_cat: Dict[str, Dict] = {}
    for m in ("alti_plus", "attn_last", "attn_mean", "ig", "random"):
        if m not in hyps:
            continue
        counts: Dict[str, List[int]] = {}
        for e, g, h in zip(test, gold, hyps[m][("output", True)]):
            linked = {t: s for t, s in h}
            for t, c in enumerate(e.tgt_cat):
                k = counts.setdefault(c, [0, 0, 0])
                if t not in linked:
                    k[1] += 1
                elif (t, linked[t]) in g:
                    k[0] += 1
                else:
                    k[2] += 1
        by_cat[m] = {c: {"n": sum(k), "gold": round(k[0] / sum(k), 3), "eos": round(k[1] / sum(k), 3),
                         "wrong": round(k[2] / sum(k), 3)} for c, k in sorted(counts.items())}

    n_rows = sum(len(e.tgt) for e in test)  # aligned rows
    avg_len = n_rows / len(test)
    cost = {
        "forward_seconds_per_sentence": seconds["forward"] / len(test),
        "attention": {"passes": "1 forward", "x_forward": seconds["attention"] / seconds["forward"]},
        "ig": {
            "passes": f"{args.ig_steps} forward+backward per decoder row "
                      f"(~{args.ig_steps * (avg_len + 1):.0f} per sentence)",
            "x_forward": seconds["ig"] / seconds["forward"],
            "mean_abs_convergence_delta": sum(ig_delta) / len(ig_delta),
        },
        "random": {"passes": "0", "x_forward": 0.0},
    }
    if not args.skip_alti_plus:
        cost["alti_plus"] = {"passes": "1 forward + decomposition", "x_forward": seconds["alti_plus"] / seconds["forward"]}
    share = source_share_summary(share_rows) if share_rows else None
    if share is not None:
        share["by_target_category"] = {
            c: {"mean": round(sum(v) / len(v), 4), "n": len(v)} for c, v in sorted(share_by_cat.items())
        }
    return {
        "aer": result,
        "links_by_target_category": by_cat,
        "cost": cost,
        "source_share": share,
        "alti_plus_max_completeness_error": {
            k: max(c[k] for c in completeness) for k in ("default", "official")
        } if completeness else None,
        "mean_target_words": avg_len,
        "mean_source_words": sum(len(e.src) for e in test) / len(test),
    }


def source_share_summary(rows: List[List[float]], n_bins: int = 5) -> Dict:
    r"""Mean source share by decoder row index and by relative position of the predicted word.

    Rows 0..n-1 predict the n words (relative position i / n, in ``n_bins`` bins); row n
    predicts the EOS and is reported apart.
    """
    by_index: Dict[int, List[float]] = {}
    bins: List[List[float]] = [[] for _ in range(n_bins)]
    eos_rows, word_rows = [], []
    for r in rows:
        n = len(r) - 1
        for i, v in enumerate(r):
            by_index.setdefault(i, []).append(v)
            if i == n:
                eos_rows.append(v)
            else:
                word_rows.append(v)
                bins[min(n_bins - 1, int(n_bins * i / n))].append(v)
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    return {
        "by_row": {str(i): {"mean": mean(v), "n": len(v)} for i, v in sorted(by_index.items())},
        "by_relative_position": [
            {"bin": f"{k / n_bins:.1f}-{(k + 1) / n_bins:.1f}", "mean": mean(b), "n": len(b)} for k, b in enumerate(bins)
        ],
        "word_rows_mean": mean(word_rows),
        "row0_mean": mean(by_index.get(0, [])),
        "eos_row_mean": mean(eos_rows),
    }


def markdown(report: Dict) -> str:
    r"""The results table (Markdown): AER per method, precision / recall, cost."""
    ev = report["evaluation"]
    names = {
        "alti_plus": "ALTI+ source contributions",
        "alti_plus_official": "ALTI+, official-code conventions",
        "attn_last": "cross-attention, mean of heads, last layer",
        "attn_mean": "cross-attention, mean of heads and layers",
        "ig": "IntegratedGradients (signed sum over d)",
        "ig_abs": "IntegratedGradients (abs of the sum)",
        "random": "random",
    }
    cost = ev["cost"]
    cost_of = {
        "alti_plus": cost.get("alti_plus"), "alti_plus_official": cost.get("alti_plus"),
        "attn_last": cost["attention"], "attn_mean": cost["attention"],
        "ig": cost["ig"], "ig_abs": cost["ig"], "random": cost["random"],
    }
    lines = [
        "| method | AER (output) | P / R (output) | AER (input) | AER (output, EOS excluded) | passes per sentence | time x forward |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for m, label in names.items():
        if m not in ev["aer"]:
            lines.append(f"| {label} | pending | | | | | |")
            continue
        a = ev["aer"][m]
        c = cost_of[m]
        lines.append(
            f"| {label} | {a['output']['aer']:.3f} | {a['output']['precision']:.2f} / {a['output']['recall']:.2f} "
            f"| {a['input']['aer']:.3f} | {a['output_eos_excluded']['aer']:.3f} | {c['passes']} | {c['x_forward']:.1f} |"
        )
    per_layer = {
        "attn_layer": "cross-attention weights",
        "alti_plus_layer": "ALTI+ rollout up to layer l",
        "alti_cross_layer": "ALTI of the cross-attention block alone",
        "alti_cross_enc_layer": "cross-attention block ALTI x encoder rollout",
    }
    lines.append("")
    lines.append("| per decoder layer l (AER, output / input) | " + " | ".join(
        f"l = {l}" for l in range(report["model"]["layers"])) + " |")
    lines.append("|---|" + "---:|" * report["model"]["layers"])
    for prefix, label in per_layer.items():
        cells = []
        for l in range(report["model"]["layers"]):
            r = ev["aer"].get(f"{prefix}{l}")
            cells.append("pending" if r is None else f"{r['output']['aer']:.3f} / {r['input']['aer']:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=4000, help="training steps (batch --train-batch)")
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--n-test", type=int, default=300)
    p.add_argument("--batch", type=int, default=50, help="evaluation batch size")
    p.add_argument("--ig-steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint-dir", default=str(BENCHMARKS / "checkpoints"))
    p.add_argument("--retrain", action="store_true", help="ignore a saved checkpoint")
    p.add_argument("--skip-alti-plus", action="store_true", help="baselines only (ALTI+ row pending)")
    p.add_argument("--out", default=None, help="JSON results (e.g. benchmarks/results/mt_alignment.json)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    lp = build_language_pair(args.seed)
    test, train_batch = make_datasets(lp, args.seed, args.n_test)
    model = build_model(lp.vocab_size, args.d_model, args.layers, args.heads, args.ffn, args.seed)
    tag = f"mt_alignment_seed{args.seed}_steps{args.steps}_d{args.d_model}_l{args.layers}_h{args.heads}_f{args.ffn}_b{args.train_batch}_lr{args.lr}"
    ckpt = Path(args.checkpoint_dir) / f"{tag}.pt"
    if ckpt.exists() and not args.retrain:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(saved["state_dict"])
        train_log, train_seconds = saved["log"], saved["seconds"]
        print(f"loaded checkpoint {ckpt.name}")
        model.eval()
    else:
        print(f"training {sum(p.numel() for p in model.parameters())} parameters for {args.steps} steps")
        train_log, train_seconds = train(model, train_batch, args.steps, args.train_batch, args.lr)
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "log": train_log, "seconds": train_seconds}, ckpt)
    acc = accuracy(model, test)
    print(f"held-out: token accuracy {acc['token_accuracy']:.4f}, exact match {acc['exact_match']:.4f}")

    model = model.double().eval()
    ev = evaluate(model, test, args)
    n_sure = sum(len(e.sure) for e in test)
    n_poss = sum(len(e.possible) for e in test)
    report = {
        "benchmark": "synthetic MT alignment (ALTI+), issue 16 item 5",
        "command": "python benchmarks/faithfulness/mt_alignment.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("checkpoint_dir", "out")},
        "task": {
            "vocab_size": lp.vocab_size,
            "n_test": len(test),
            "sure_links": n_sure,
            "possible_only_links": n_poss,
            "rules": "SVO->SOV, adjective-noun swap, adverb end->front, object particle (possible link), "
                     f"{N_COMPOUND_NOUNS} nouns and {N_AUX_VERBS} verbs one-to-two",
            "example": {
                "src": " ".join(lp.vocab[w] for w in test[0].src),
                "tgt": " ".join(lp.vocab[w] for w in test[0].tgt),
                "sure_t_s": sorted(test[0].sure),
                "possible_t_s": sorted(test[0].possible),
            },
        },
        "model": {
            "class": "MarianMTModel", "parameters": sum(p.numel() for p in model.parameters()),
            "d_model": args.d_model, "layers": args.layers, "heads": args.heads, "ffn": args.ffn,
        },
        "training": {"log": train_log, "seconds": round(train_seconds, 1)},
        "accuracy": acc,
        "evaluation": ev,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    print(markdown(report))
    if ev["source_share"]:
        s = ev["source_share"]
        print("source share by relative position:", [b["mean"] for b in s["by_relative_position"]],
              "row 0:", s["row0_mean"], "EOS row:", s["eos_row_mean"])
        print("source share by target word category:", {c: v["mean"] for c, v in s["by_target_category"].items()})
    for m, cats in ev["links_by_target_category"].items():
        print(f"{m}: gold / EOS / wrong by category:",
              {c: (v["gold"], v["eos"], v["wrong"]) for c, v in cats.items()})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
