r"""DecompX with n explained targets of a causal LM: the stacked adjoint walk against one
vector-Jacobian product per cotangent, and against the single-position call.

Usage:
    nice python benchmarks/speed/decompx_multi.py --tokenizer DIR [--layers 4] [--prompt-tokens 256]
        [--targets 32] [--threads 2] [--repeats 3] [--out results/decompx_multi.json]

Model: :data:`_bench.LLAMA_100M` with ``--layers`` layers, random weights (seed 0), float32.
``DecompositionLLMAttribution("decompx")`` explains ``--targets`` random target tokens after the
prompt in one teacher-forced pass; "stacked": the walk as shipped (all cotangents through each
layer in one call), "per cotangent": the same walk with
:data:`~captum_normattr.decompose.methods.decompx.adjoint.STACK_BYTES` set to 1 byte (chunks of one output: one
call per cotangent and layer, the former walk); "one": ``DecompXAttribution`` explaining the
first target on the prompt. The three are interleaved in one process, the minimum of
``--repeats`` calls is kept, and the rows of the two walks are compared. The last line of the
output is the JSON of all numbers (also written to ``--out``).
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
from llm_generation import prompt_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_tok = Path("~/.cache/captum_normattr/smollm2-135m-instruct").expanduser()
    ap.add_argument("--tokenizer", default=str(default_tok) if default_tok.exists() else None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--targets", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(BENCHMARKS, "results", "decompx_multi.json"))
    args = ap.parse_args()
    if args.tokenizer is None:
        ap.error("give --tokenizer DIR (a local Hugging Face tokenizer folder)")
    torch.set_num_threads(args.threads)

    from captum.attr import TextTokenInput
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from captum_normattr.attr.llm import DecompositionLLMAttribution
    from captum_normattr.decompose.methods.decompx import adjoint as dd
    from captum_normattr.attr.methods import get_method

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)
    config = {**LLAMA_100M, "num_hidden_layers": args.layers, "vocab_size": len(tok)}
    cfg = LlamaConfig(**config)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    inp = TextTokenInput(prompt_text(tok, args.prompt_tokens), tok)
    p = int(inp.inp_tensor.shape[1])
    targets = torch.randint(3, len(tok), (args.targets,), generator=torch.Generator().manual_seed(1))
    llm = DecompositionLLMAttribution(get_method("decompx").build(model), tok)
    single = get_method("decompx").build(model)
    stack_bytes = dd.STACK_BYTES

    def walk(stacked: bool):
        dd.STACK_BYTES = stack_bytes if stacked else 1
        try:
            return llm.attribute(inp, target=targets).token_attr
        finally:
            dd.STACK_BYTES = stack_bytes

    runs = {"stacked": lambda: walk(True), "per_cotangent": lambda: walk(False),
            "one": lambda: single.attribute(inp.inp_tensor, target=int(targets[0]))}
    times = {k: float("inf") for k in runs}
    rows = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            res = fn()
            times[name] = min(times[name], time.perf_counter() - t0)
            rows.setdefault(name, res)
    a, b = rows["stacked"], rows["per_cotangent"]
    out = {"config": {**config, "dtype": "float32", "threads": args.threads, "prompt_tokens": p,
                      "targets": args.targets, "repeats": args.repeats},
           "seconds": times, "stacked_over_one": times["stacked"] / times["one"],
           "per_cotangent_over_one": times["per_cotangent"] / times["one"],
           "stacked_over_per_cotangent": times["stacked"] / times["per_cotangent"],
           "rows_max_rel_diff": float((a - b).abs().max() / a.abs().max())}
    print(f"stacked {times['stacked']:.2f} s  per cotangent {times['per_cotangent']:.2f} s  one {times['one']:.2f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
