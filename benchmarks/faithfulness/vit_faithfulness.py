r"""Faithfulness of the decompositions on a small Vision Transformer, fully offline.

Usage (scikit-learn is a benchmark-only dependency, not in setup.cfg):
    pip install scikit-learn
    python benchmarks/faithfulness/vit_faithfulness.py [--patch 8] [--epochs 40] [--test 300] [--min-accuracy 0.9]
                                          [--out benchmarks/results/vit_faithfulness.json]

Data: scikit-learn's 8x8 handwritten digits (1797 images, shipped inside the package, no
download), upscaled 4x (nearest) to 32x32, one channel, pixel values scaled to [-1, 1].
Model: ``ViTForImageClassification`` trained here (patch 8 by default, so each patch is
2 x 2 original pixels: 16 patches + [CLS]; 4 layers, 4 heads, width 64, FF 128; float32;
AdamW, one-cycle schedule, batch 32; about a minute of one CPU core), seed 0, first 1497
images train, last 300 test. If the test accuracy is below ``--min-accuracy`` the training
runs another schedule (at most ``--max-rounds`` in all); the JSON records the accuracy and
the rounds. (Patch 4, one original pixel per patch, reached only 0.70 after 40 epochs: a
token holding a single pixel value learns slowly.)

Methods (patch scores; [CLS] excluded): GlobEnc (pre-LN default map N_RESLN), ALTI,
ALTI+FF (``FFIntegratedDecomposition(contribution="alti")``: ALTI's L1 contribution of the
whole-layer parts against the real layer output, RES2), GlobEnc+FF (whole layer, RES2),
DecompX (signed, predicted class), attention rollout (Abnar and Zuidema: 0.5 mean-head
attention + 0.5 I, rolled out; GlobEnc's ``W_FIXEDRES`` map), Captum's Saliency (|gradient|
summed over the patch's pixels), InputXGradient and IntegratedGradients (Captum's default 50
steps, baseline the all-background image -1; signed, summed over the patch's pixels), and a
random ranking.

Protocol: patches ranked by score (most relevant first, MoRF, and least relevant first,
LeRF; ties by position). Deletion: patches replaced by the background value -1, k = 0, 1,
..., 16 patches (patch 8; every 4th k for patch 4); insertion: from the all-background image, patches put back in the same
order. The curve is the probability of the class predicted on the clean image. Reported:
the area under each curve (mean over the 17 points; ± its standard error over images) and AOPC = mean over k of
(p(clean) - p(k deleted)). Better: deletion MoRF low, AOPC MoRF high, insertion MoRF high;
deletion LeRF high, insertion LeRF low. Cost: wall time of one call on the test set
divided by one forward pass of the classifier on the same batch (median of 3).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))

from captum.attr import InputXGradient, IntegratedGradients, Saliency  # noqa: E402
from transformers import ViTConfig, ViTForImageClassification  # noqa: E402

from captum_normattr import ALTIAttribution, DecompXAttribution, FFIntegratedDecomposition, GlobEncAttribution  # noqa: E402

PATCH, SIDE, BACKGROUND = 4, 32, -1.0


def load_digits_tensors():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16.0  # (N, 8, 8) in [0, 1]
    x = x.repeat_interleave(4, 1).repeat_interleave(4, 2).unsqueeze(1) * 2 - 1  # (N, 1, 32, 32) in [-1, 1]
    return x, torch.tensor(d.target, dtype=torch.long)


def build_model() -> ViTForImageClassification:
    cfg = ViTConfig(
        image_size=SIDE, patch_size=PATCH, num_channels=1, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return ViTForImageClassification(cfg)


def train(model, x, y, epochs: int, seed: int = 0, lr: float = 3e-3, batch: int = 32, shift: int = 1) -> float:
    r"""AdamW with a one-cycle schedule; augmentation: random translations by up to ``shift``
    original pixels (whole patches, so a patch stays one original pixel). Returns the last loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * ((len(x) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = perm[i : i + batch]
            xb = x[idx]
            if shift:
                offsets = (torch.randint(-shift, shift + 1, (2,), generator=g) * (SIDE // 8)).tolist()
                xb = torch.roll(xb, shifts=offsets, dims=(2, 3))
            loss = torch.nn.functional.cross_entropy(model(pixel_values=xb).logits, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return loss.item()


def patch_sum(attr: torch.Tensor) -> torch.Tensor:
    r"""(B, C, H, W) pixel attributions -> (B, N) patch sums (row-major)."""
    b = attr.shape[0]
    a = attr.sum(1).reshape(b, SIDE // PATCH, PATCH, SIDE // PATCH, PATCH).sum((2, 4))
    return a.reshape(b, -1)


def methods(model):
    fwd = lambda px: model(pixel_values=px).logits
    sal, ixg, ig = Saliency(fwd), InputXGradient(fwd), IntegratedGradients(fwd)
    ge, al = GlobEncAttribution(model), ALTIAttribution(model)
    ff, dx = FFIntegratedDecomposition(model), DecompXAttribution(model)
    alti_ff = FFIntegratedDecomposition(model, contribution="alti")
    roll = GlobEncAttribution(model, map_name="W_FIXEDRES")

    def tokens(a):
        return lambda x, t: a.decompose(x, return_layer_maps=False, return_rollout=False).scores[:, 1:]

    gen = torch.Generator().manual_seed(123)
    return {
        "GlobEnc": tokens(ge),
        "ALTI": tokens(al),
        "ALTI+FF": tokens(alti_ff),
        "GlobEnc+FF": tokens(ff),
        "DecompX": lambda x, t: dx.decompose(x, target=t).scores[:, 1:],
        "Attention rollout": tokens(roll),
        "Saliency": lambda x, t: patch_sum(sal.attribute(x, target=t, abs=True)),
        "InputXGradient": lambda x, t: patch_sum(ixg.attribute(x, target=t)),
        "IntegratedGradients": lambda x, t: patch_sum(
            ig.attribute(x, baselines=BACKGROUND, target=t, internal_batch_size=len(x) * 10)  # Captum's 50 steps
        ),
        "Random": lambda x, t: torch.rand(x.shape[0], (SIDE // PATCH) ** 2, generator=gen),
    }


def patch_mask(order: torch.Tensor, k: int) -> torch.Tensor:
    r"""(B, 1, H, W) True on the first k patches of each ``order`` (B, N)."""
    b, n = order.shape
    m = torch.zeros(b, n, dtype=torch.bool)
    if k:
        m.scatter_(1, order[:, :k], True)
    g = SIDE // PATCH
    return m.view(b, g, g).repeat_interleave(PATCH, 1).repeat_interleave(PATCH, 2).unsqueeze(1)


@torch.no_grad()
def curves(model, x, target, scores, ks):
    ar = torch.arange(len(x))
    prob = lambda px: torch.softmax(model(pixel_values=px).logits, -1)[ar, target]
    out = {}
    n = scores.shape[1]
    pos = torch.arange(n, dtype=scores.dtype) * 1e-9  # ties broken by position
    for order_name, sign in (("MoRF", 1.0), ("LeRF", -1.0)):
        order = torch.argsort(-(sign * scores.double()) + pos.double(), dim=1)
        dele, ins = [], []
        for k in ks:
            m = patch_mask(order, k)
            dele.append(prob(torch.where(m, torch.full_like(x, BACKGROUND), x)))
            ins.append(prob(torch.where(m, x, torch.full_like(x, BACKGROUND))))
        dele_t, ins_t = torch.stack(dele, 1), torch.stack(ins, 1)  # (B, K) per image
        per_image_del = dele_t.mean(1)
        per_image_aopc = (dele_t[:, :1] - dele_t[:, 1:]).mean(1)
        se = lambda v: (v.std() / len(v) ** 0.5).item()
        out[order_name] = {
            "deletion_curve": dele_t.mean(0).tolist(), "insertion_curve": ins_t.mean(0).tolist(),
            "deletion_auc": per_image_del.mean().item(), "insertion_auc": ins_t.mean().item(),
            "aopc": per_image_aopc.mean().item(),
            "deletion_auc_se": se(per_image_del), "insertion_auc_se": se(ins_t.mean(1)), "aopc_se": se(per_image_aopc),
        }
    return out


def completeness(name, model, x, target) -> float:
    r"""Largest completeness error of a decomposition on the first 50 test images (float32 model)."""
    x = x[:50]
    if name == "DecompX":
        return DecompXAttribution(model).decompose(x, target=target[:50]).delta.max().item()
    attr = FFIntegratedDecomposition(model, contribution="alti" if name == "ALTI+FF" else "norm")
    return attr.decompose(x, return_layer_maps=False, return_rollout=False).extras["layer_completeness_error"].max().item()


def timed(f, repeats=3):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--patch", type=int, default=8, choices=(4, 8), help="patch size on the 32 x 32 image")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    ap.add_argument("--max-rounds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shift", type=int, default=0, help="random translations by up to this many original pixels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)  # 1 thread is fastest on a contended machine
    ap.add_argument("--out", default=str(BENCHMARKS / "results" / "vit_faithfulness.json"))
    ap.add_argument("--render-only", metavar="JSON", help="print the table of a results file and exit")
    args = ap.parse_args(argv)
    if args.render_only:
        print(table(json.loads(Path(args.render_only).read_text())))
        return
    torch.set_num_threads(args.threads)
    global PATCH
    PATCH = args.patch
    torch.manual_seed(args.seed)
    x, y = load_digits_tensors()
    xtr, ytr, xte, yte = x[: -args.test], y[: -args.test], x[-args.test :], y[-args.test :]
    model = build_model()
    t0 = time.perf_counter()
    for rounds in range(1, args.max_rounds + 1):
        loss = train(model, xtr, ytr, args.epochs, args.seed + rounds - 1, args.lr, args.batch, args.shift)
        with torch.no_grad():
            pred = model(pixel_values=xte).logits.argmax(-1)
        acc = float((pred == yte).float().mean())
        print(f"round {rounds}: {time.perf_counter() - t0:.0f} s, last loss {loss:.3f}, test accuracy {acc:.3f}", flush=True)
        if acc >= args.min_accuracy:
            break
    train_s = time.perf_counter() - t0
    n_patches = (SIDE // PATCH) ** 2
    ks = list(range(0, n_patches + 1, max(1, n_patches // 16)))
    if acc < 0.9:
        print(f"warning: test accuracy {acc:.3f} < 0.9: the curves of an untrained model say little", flush=True)
    results = {
        "accuracy": acc, "chance": 0.1, "train_seconds": train_s, "final_train_loss": loss, "test_images": len(xte), "ks": ks,
        "training": {"patch": PATCH, "rounds": rounds, "epochs_per_round": args.epochs, "lr": args.lr, "batch": args.batch, "shift": args.shift, "seed": args.seed},
        "threads": torch.get_num_threads(), "methods": {},
    }
    forward_s = timed(lambda: model(pixel_values=xte))
    for name, f in methods(model).items():
        scores = f(xte, pred).detach()
        cost = timed(lambda: f(xte, pred), repeats=1 if name == "IntegratedGradients" else 3) / forward_s
        res = curves(model, xte, pred, scores, ks)
        res["cost_forward_passes"] = cost
        if name in ("ALTI+FF", "GlobEnc+FF", "DecompX"):
            res["max_completeness_error"] = completeness(name, model, xte, pred)
        results["methods"][name] = res
        print(
            f"{name:20s} del-MoRF {res['MoRF']['deletion_auc']:.3f} AOPC-MoRF {res['MoRF']['aopc']:.3f} "
            f"ins-MoRF {res['MoRF']['insertion_auc']:.3f} del-LeRF {res['LeRF']['deletion_auc']:.3f} "
            f"ins-LeRF {res['LeRF']['insertion_auc']:.3f} cost {cost:.1f}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))


def table(results) -> str:
    r"""Markdown table. Insertion LeRF equals deletion MoRF and deletion LeRF equals insertion MoRF
    (k runs over every patch count, so the two curves see the same images in reverse order):
    those columns are left out."""
    rows = [
        "| method | deletion MoRF AUC ↓ (± s.e.) | AOPC MoRF ↑ | insertion MoRF AUC ↑ (± s.e.) | AOPC LeRF ↓ | cost (forward passes) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["methods"].items():
        m, l = r["MoRF"], r["LeRF"]
        rows.append(
            f"| {name} | {m['deletion_auc']:.3f} ± {m['deletion_auc_se']:.3f} | {m['aopc']:.3f} | "
            f"{m['insertion_auc']:.3f} ± {m['insertion_auc_se']:.3f} | {l['aopc']:.3f} | {r['cost_forward_passes']:.1f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
