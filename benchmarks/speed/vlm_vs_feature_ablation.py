r"""Image segments of a vision-language model: one decomposition pass against Captum's FeatureAblation.

Usage:
    OMP_NUM_THREADS=1 python benchmarks/speed/vlm_vs_feature_ablation.py [--width 256] [--layers 4] [--new-tokens 8]
        [--out benchmarks/results/vlm_vs_feature_ablation.json]

Model: a LLaVA-1.5-shaped ``LlavaForConditionalGeneration`` with random weights (seed 0), float32: a
336 x 336 CLIP tower with 14-pixel patches (576 image tokens, ``"default"`` strategy; the tower
itself reduced to 1 layer of width 32), a Llama decoder of ``--width`` / ``--layers`` (4 heads,
2 key/value heads), prompt = BOS + 576 image tokens + 63 text tokens (640), ``--new-tokens`` targets.
The processor is LLaVA 1.5's CLIP image processor (shortest edge 336, centre crop) and the ids are
built by hand (no tokenizer download). The image: 336 x 336 random 42-pixel blocks.

1. Cost of explaining all n targets (``DecompositionLLMAttribution(...).attribute(ImageMaskInput)``:
   processor + one decomposition pass + segments by pixel overlap) with ALTI-Logit and DecompX,
   relative to one forward pass of the model over prompt + targets; beside Captum's
   ``LLMAttribution(FeatureAblation)`` (``forward_in_tokens=False``: one teacher-forced pass per
   segment, plus the processor) over 16 (4 x 4) and 64 (8 x 8) square segments.
2. Agreement: Spearman correlation of our ``seq_attr`` (segments) with FeatureAblation's.
3. Deletion curves over the segments: the segments painted white (Captum's baseline) in the
   order of each method's scores, largest first, the sum of the n target logits after each step
   (relative to the unperturbed sum); the area under the curve (lower: the order finds what
   matters first) and that of a random order. On random weights these curves say little about
   faithfulness; they show that the machinery runs end to end.

The last line of the output is the JSON of all numbers (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, List

import numpy as np
import torch

SIDE, PATCH, IMAGE_TOKEN = 336, 14, 255


def build(width: int, layers: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=SIDE, patch_size=PATCH, projection_dim=32)
    tc = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN, vision_feature_layer=-1,
                      vision_feature_select_strategy="default", image_seq_length=(SIDE // PATCH) ** 2)
    cfg._attn_implementation = "sdpa"
    return LlavaForConditionalGeneration(cfg).eval()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(251)] + ["<image>"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


def main() -> None:
    from captum.attr import FeatureAblation, LLMAttribution
    from captum.attr._utils.interpretable_input import ImageMaskInput
    from PIL import Image
    from transformers import CLIPImageProcessor

    from captum_normattr import ALTILogitAttribution, DecompXAttribution
    from captum_normattr.attr.llm import DecompositionLLMAttribution

    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results",
                                                   "vlm_vs_feature_ablation.json"))
    args = ap.parse_args()
    model, tok = build(args.width, args.layers), tokenizer()
    ip = CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    g = torch.Generator().manual_seed(1)
    text = torch.randint(4, 250, (63,), generator=g).tolist()
    ids = torch.tensor([[1] + [IMAGE_TOKEN] * (SIDE // PATCH) ** 2 + text])
    target = torch.randint(4, 250, (args.new_tokens,), generator=g)

    def process(image: Any) -> Dict[str, Any]:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": ip(images=image, return_tensors="pt")["pixel_values"]}

    blocks = np.random.RandomState(0).rand(8, 8, 3)
    image = Image.fromarray((np.kron(blocks, np.ones((42, 42, 1))) * 255).astype("uint8"))

    def squares(k: int) -> torch.Tensor:
        r = torch.arange(SIDE) * k // SIDE
        return (r[:, None] * k + r[None]).int()

    def target_logits(inputs: Dict[str, Any]) -> float:
        full = torch.cat([inputs["input_ids"], target[None]], 1)
        with torch.no_grad():
            logits = model(input_ids=full, attention_mask=torch.ones_like(full),
                           pixel_values=inputs["pixel_values"]).logits[0]
        p = ids.shape[1]
        return float(logits[torch.arange(p - 1, p - 1 + len(target)), target].sum())

    def timed(fn, repeats: int = 1):
        best, out = float("inf"), None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
        return best, out

    record: Dict[str, Any] = {"setup": {"prompt_tokens": int(ids.shape[1]), "image_tokens": (SIDE // PATCH) ** 2,
                                        "new_tokens": args.new_tokens, "width": args.width, "layers": args.layers,
                                        "threads": torch.get_num_threads(), "dtype": "float32"}}
    base = process(image)
    t_forward, _ = timed(lambda: target_logits(base), 3)
    record["forward_s"] = t_forward
    methods = {"ALTI-Logit": ALTILogitAttribution(model), "DecompX": DecompXAttribution(model)}
    rng = np.random.RandomState(0)
    for k in (4, 8):
        s = k * k
        inp = ImageMaskInput(image, mask=squares(k), processor_fn=process)
        res: Dict[str, Any] = {}
        t_fa, fa = timed(lambda: LLMAttribution(FeatureAblation(model), tok).attribute(
            inp, target=target, forward_in_tokens=False))
        res["FeatureAblation"] = {"seconds": t_fa, "relative_to_forward": t_fa / t_forward, "passes": s + 1}
        scores = {"FeatureAblation": fa.seq_attr.detach().double()}
        for name, attr in methods.items():
            llm = DecompositionLLMAttribution(attr, tok)
            t, ours = timed(lambda: llm.attribute(inp, target=target), 2 if k == 4 else 1)
            scores[name] = ours.seq_attr.detach().double()
            res[name] = {"seconds": t, "relative_to_forward": t / t_forward,
                         "spearman_vs_feature_ablation": spearman(scores[name], scores["FeatureAblation"]),
                         "max_abs_delta": float(ours.explanation.details.delta.abs().max())}
        clean = target_logits(base)
        orders = {n: torch.argsort(v, descending=True).tolist() for n, v in scores.items()}
        orders["random"] = rng.permutation(s).tolist()
        steps = list(range(0, s + 1, max(1, s // 16)))
        for name, order in orders.items():
            curve = []
            for step in steps:
                kept = torch.ones(1, s)
                kept[0, order[:step]] = 0
                curve.append(target_logits(inp.to_model_input(kept)) - clean)
            res.setdefault(name, {})["deletion"] = {"steps": steps, "logit_sum_change": curve,
                                                    "mean_change": float(np.mean(curve))}
        record[f"{s}_segments"] = res
        print(json.dumps({f"{s}_segments": {n: {kk: v for kk, v in r.items() if kk != "deletion"}
                                             for n, r in res.items()}}), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))


__all__: List[str] = ["build", "main", "spearman", "tokenizer"]

if __name__ == "__main__":
    main()
