r"""The logit difference d of every evaluated item of a decoder_faithfulness.py JSON, and the deletion AOPC
(no sink) on the items with d >= 1 and d >= 2 (the AOPC is relative to |d|, heavy-tailed where d is small).

The items are regenerated (same generator, seed, candidates, correctness filter) and checked against the JSON.

Usage::

    python benchmarks/faithfulness/decoder_faithfulness_margin.py benchmarks/results/decoder_faithfulness_seed2.json
"""
import json
import os
import sys

import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)
import decoder_faithfulness as df
from captum_normattr import load_default_model
from captum_normattr.evaluation.decoder_tasks import make_task
from captum_normattr.evaluation.statistics import format_mean_se, mean_se
r = json.load(open(sys.argv[1]))
a = r["args"]
model, tok = load_default_model("decoder")
out = {}
for task, v in r["tasks"].items():
    cand = make_task(task, tok, a["candidates"] or 2 * a["max_items"], seed=a["seed"])
    kept = df.keep_correct(model, cand, task, tok)[: v["evaluated"]]
    assert [it.text for it in kept] == [x["text"] for x in v["items"]], task
    assert [tok.decode([it.foil]) for it in kept] == [x["foil"] for x in v["items"]], task
    d = torch.stack([df.last_logit_diff(model, [it.input_ids], it.target, it.foil)[0] for it in kept]).tolist()
    out[task] = d
    s = sorted(d)
    n = len(s)
    print(task, n, "median d %.2f" % s[n // 2], "d<0.5: %d, d<1: %d, d<2: %d" % (sum(x < 0.5 for x in s), sum(x < 1 for x in s), sum(x < 2 for x in s)))
    per = v["per_item"]
    for thr in (1.0, 2.0):
        idx = [i for i, x in enumerate(d) if x >= thr]
        print("   items with d >= %.0f: %d;" % (thr, len(idx)), ", ".join(
            "%s %s" % (m, format_mean_se(mean_se([per[m]["deletion_aopc_no_sink"][i] for i in idx]))) for m in ["ALTI-Logit", "DecompX", "IG-8", "IG-16", "Random"]))

