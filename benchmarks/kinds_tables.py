r"""Markdown tables of the layer-kind figures: memory (``memory_engine.py --sections kinds``) and speed ratios
(``speed_decoder.py --families``), families side by side.

Usage (from the repository root, after the runs written in benchmarks/RESULTS.md)::

    python benchmarks/kinds_tables.py --memory benchmarks/results/memory_engine_kinds.json \
        benchmarks/results/memory_engine_kinds_4096.json \
        --speed benchmarks/results/speed_decoder_kinds_1024.json benchmarks/results/speed_decoder_kinds_4096.json

Memory cells: peak extra resident memory of one call over the loaded model and inputs (fresh process per cell)
and, in brackets, that call's wall time (a cold call: it includes any one-off compilation). Speed cells: the
minimum wall time of the timed calls (see each file's ``meta`` for repeats and warm-ups), all methods and the
forward pass of the same family timed in one process, as a ratio to that forward pass. With several speed files,
a later file's figure of a (family, length, method) replaces an earlier one.
"""
from __future__ import annotations

import argparse
import json

LABELS = {"forward": "forward", "globenc": "GlobEnc", "alti": "ALTI", "alti_logit": "ALTI-Logit",
          "decompx": "DecompX", "ff": "GlobEnc+FF"}
NAMES = {"llama": "Llama", "gpt_neox": "GPT-NeoX (parallel)", "gemma2": "Gemma 2 (sandwich)",
         "mixtral": "Mixtral (experts)", "qwen2_moe": "Qwen2-MoE (experts)",
         "gpt_oss": "GPT-OSS (sinks, clamped experts)", "deepseek_v3": "DeepSeek-V3 (latent attention)",
         "llama4_text": "Llama 4 text (chunked, input-scaled experts)", "granitemoe": "Granite-MoE",
         "qwen3_5_text": "Qwen3.5 (Gated DeltaNet)", "granitemoehybrid": "Granite 4 (Mamba-2 + attention)",
         "kimi_linear": "Kimi Linear (delta attention + latent attention)", "lfm2": "LFM2 (short conv + attention)"}


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ok(r) -> bool:
    return r is not None and not any(r.get(k) for k in ("failed", "exceeded", "timed_out", "not_run"))


def memory_tables(paths) -> str:
    r"""One table per length (and per depth, where the files hold several: ``--kinds-layers 2 4``)."""
    recs = {}
    for p in paths:
        with open(p) as f:
            for r in json.load(f).get("kinds", []):
                recs[(r.get("family"), r["method"], r["tokens"], r.get("layers"))] = r
    families = list(dict.fromkeys(k[0] for k in recs))
    depths = sorted({k[3] for k in recs}, key=lambda n: (n is None, n))
    out = []
    for t in sorted({k[2] for k in recs}):
        for n in depths:
            rows = []
            for m in LABELS:
                cells = []
                for f in families:
                    r = recs.get((f, m, t, n))
                    if r is None:
                        cells.append("not run")
                    elif r.get("timed_out"):
                        cells.append(f"timeout (> {r['timeout_s']:g} s)")
                    elif not _ok(r):
                        cells.append("failed" if r.get("failed") else "over the limit")
                    else:
                        cells.append(f"{r['extra_peak_mb']:.0f} MB ({r['seconds']:.1f} s)")
                if any(c != "not run" for c in cells):
                    rows.append([LABELS[m], *cells])
            if rows:
                depth = f", {n} layers" if len(depths) > 1 else ""
                out.append(f"Peak extra memory (cold-call seconds), {t} tokens{depth}:\n\n"
                           + _table(["method", *[NAMES.get(f, f) for f in families]], rows))
    return "\n\n".join(out)


def speed_tables(paths) -> str:
    recs = {}
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["ratios"]:  # a later file's figure of a method replaces an earlier one
                old = recs.setdefault((r["family"], r["tokens"]), {"seconds": {}, "ratio_to_forward": {}})
                old["seconds"].update(r["seconds"])
                old["ratio_to_forward"].update(r["ratio_to_forward"])
    families = list(dict.fromkeys(k[0] for k in recs))
    lengths = sorted({k[1] for k in recs})
    rows = []
    for m in LABELS:
        for t in lengths:
            cells = []
            for f in families:
                r = recs.get((f, t))
                if r is None or m not in r["seconds"]:
                    cells.append("not run")
                elif m == "forward":
                    cells.append(f"{r['seconds'][m]:.2f} s")
                else:
                    cells.append(f"{r['ratio_to_forward'][m]:.1f}x ({r['seconds'][m]:.2f} s)")
            if any(c != "not run" for c in cells):
                rows.append([f"{LABELS[m]}, {t} tokens", *cells])
    return ("Time per call as a multiple of the same family's forward pass (minimum; seconds):\n\n"
            + _table(["method", *[NAMES.get(f, f) for f in families]], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", nargs="*", default=[])
    p.add_argument("--speed", nargs="*", default=[])
    a = p.parse_args()
    if a.memory:
        print(memory_tables(a.memory) + "\n")
    if a.speed:
        print(speed_tables(a.speed))


if __name__ == "__main__":
    main()
