r"""``captum-normattr generate``: explain every token a causal LM generates, from one forward pass.

Generates (greedy) ``--max-new-tokens`` tokens after the prompt, or takes ``--target-text``
(teacher forcing), and explains every generated token with
:class:`~captum_normattr.attr.llm.DecompositionLLMAttribution`: a table (one row per
generated token with its top input tokens), JSON, or an HTML report (docs/llm.md, docs/cli.md).

Examples (shell)::

    captum-normattr generate --model DIR "The capital of France is" --max-new-tokens 8 -m alti-logit
    captum-normattr generate --model DIR "The capital of France is" --target-text " Paris" -m decompx alti \
        --format json -o out.json
    captum-normattr generate --model DIR "Why is the sky blue?" --chat --format html -o report.html
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from captum_normattr.cli.registry_view import llm_method_names
from captum_normattr.tokens import readable_tokens, terminal_lines, visible_text

PROG = "captum-normattr generate"
QUANTITY_NAMES = {"logit": "logit", "logit-minus-foil": "logit_minus_foil", "logit-minus-mean": "logit_minus_mean"}


class GenerateError(Exception):
    r"""A usage error of ``captum-normattr generate``: printed without a traceback, exit code 2."""


def llm_methods() -> Tuple[str, ...]:
    r"""The methods of ``generate``: the registry's methods that explain positions of a causal LM.

    Returns:
        Their registry keys (:data:`captum_normattr.attr.methods.METHODS`), in registry order.
    """
    return llm_method_names()  # the registry's, or its light view before it is imported (no torch for --help)


def build_parser() -> argparse.ArgumentParser:
    r"""The argument parser of ``captum-normattr generate``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Explain every token a causal LM generates (or a given target text), from one forward pass.",
    )
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    p.add_argument("--model", required=True, help="a local model folder (config.json) or a Hub name of a causal LM")
    p.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate (greedy; default 20)")
    p.add_argument("--target-text", default=None,
                   help="explain this continuation instead of generating (teacher forcing)")
    p.add_argument("-m", "--method", nargs="+", default=["alti-logit"], choices=llm_methods(), metavar="METHOD",
                   help=f"method(s): {', '.join(llm_methods())} (default alti-logit)")
    p.add_argument("--quantity", default="logit", choices=sorted(QUANTITY_NAMES),
                   help="signed methods: the explained quantity (default: the target logit; log-probabilities are "
                        "not additive and are reported alongside)")
    p.add_argument("--foil", default=None, help="the foil token for --quantity logit-minus-foil")
    p.add_argument("--format", default="table", choices=("table", "json", "html"),
                   help="table (default), json (every score) or html (the interactive report)")
    p.add_argument("-o", "--output", default=None, help="write here instead of standard output (an existing file only "
                   "with --overwrite; written through a temporary file and renamed)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing -o file")
    p.add_argument("--top", type=int, default=5, help="input tokens shown per generated token in the table (default 5)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the tokenizer's chat template")
    p.add_argument("--skip-special", action="store_true",
                   help="leave the tokenizer's special tokens out of the features")
    p.add_argument("--exclude-sink", action="store_true",
                   help="leave the attention sink (the first token) out of the table, plots and colour scales")
    p.add_argument("--dtype", default=None, choices=("float32", "float64"), help="cast the model (default: as saved)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--image", default=None, metavar="FILE",
                   help="an image for a vision-language model (its folder's processor is used); the image's heat map "
                        "is written as a PNG next to the output (and shown in the html report)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model folder's own Python code to run (transformers' trust_remote_code; "
                        "off by default)")
    return p


def load_causal_lm(name: str, trust_remote_code: bool = False, dtype: Optional[str] = None, device: str = "cpu"):
    r"""(model in eval mode, tokenizer) of a causal LM, loaded as the main command loads models
    (:func:`~captum_normattr.cli.common.load_model`): ``trust_remote_code`` is passed explicitly
    (a folder with its own code is refused without ``--trust-remote-code``, and transformers
    never prompts), and a folder without a real tokenizer is refused.

    Raises:
        GenerateError: when the folder, model or tokenizer cannot be loaded, or the model has
            no LM head.
    """
    import torch

    from captum_normattr.cli.common import CLIError, load_model

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise GenerateError(f"unknown device {device!r}") from None
    try:
        model, tok, _ = load_model(name, dev, trust_remote_code)
    except CLIError as err:
        raise GenerateError(str(err)) from None
    if getattr(model, "get_output_embeddings", lambda: None)() is None or not hasattr(model, "generate"):
        raise GenerateError(f"{name!r} is not a causal LM with its LM head (a *ForCausalLM checkpoint)")
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    return model.eval(), tok


def _build_input(tok: Any, prompt: str, chat: bool, skip_special: bool):
    from captum.attr import TextTokenInput

    from captum_normattr.attr.llm import chat_token_input

    skip = list(tok.all_special_ids) if skip_special else None
    if chat:
        try:
            return chat_token_input(tok, [{"role": "user", "content": prompt}], skip_tokens=skip)
        except ValueError as err:
            raise GenerateError(str(err)) from None
    return TextTokenInput(prompt, tok, skip_tokens=skip)


def check_generation_length(model: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    r"""Refuse ``--max-new-tokens`` that, with the prompt, exceed the model's positions, before generating.

    Raises:
        GenerateError: naming the prompt's length, the model's limit and the largest valid value.
    """
    from captum_normattr.models.adapters import get_adapter, max_positions

    try:
        limit = max_positions(model, get_adapter(model))
    except Exception:  # noqa: BLE001 - an unsupported model is refused later, with its own message
        limit = None
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        raise GenerateError(
            f"--max-new-tokens {max_new_tokens} plus the prompt's {prompt_tokens} tokens exceed the model's "
            f"{limit} positions; " + (f"give --max-new-tokens {room} or less" if room >= 1 else
                                      "shorten the prompt"))


def explain_generation_cli(args: argparse.Namespace) -> Dict[str, Any]:
    r"""Load, generate (or take the target), explain with every method; a JSON-able dict."""
    import torch

    from captum_normattr.attr.llm import DecompositionLLMAttribution
    from captum_normattr.attr.methods import get_method

    model, tok = load_causal_lm(args.model, args.trust_remote_code, args.dtype, args.device)
    inp = _build_input(tok, args.prompt, args.chat, args.skip_special)
    if args.target_text is not None:
        target: Any = args.target_text
    else:
        if args.max_new_tokens < 1:
            raise GenerateError("--max-new-tokens must be at least 1")
        ids = inp.inp_tensor.to(next(model.parameters()).device)
        check_generation_length(model, int(ids.shape[1]), args.max_new_tokens)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        target = out[0, ids.shape[1]:].cpu()
        if target.numel() == 0:
            raise GenerateError("the model generated no token")
    quantity = QUANTITY_NAMES[args.quantity]
    record: Dict[str, Any] = {"model": args.model, "prompt": args.prompt, "exclude_sink": bool(args.exclude_sink),
                              "methods": {}}
    for key in args.method:
        spec = get_method(key)
        try:
            attr = spec.build(model)
            llm = DecompositionLLMAttribution(attr, tok)
            ex = llm.decompose(inp, target=target, quantity=quantity if spec.signed else "logit",
                               foil=args.foil if spec.signed else None)
        except (ValueError, TypeError) as err:
            raise GenerateError(f"{key}: {err}") from None
        res = ex.to_captum(exclude_sink=args.exclude_sink)
        if "tokens" not in record:
            record.update(tokens=ex.tokens, token_text=feature_text(tok, ex.tokens), prompt_length=ex.prompt_length,
                          generated=list(ex.output_tokens), generated_ids=ex.target_ids.tolist(),
                          sink_index=ex.sink_index)
        d = ex.details
        record["methods"][ex.method] = {
            "key": key, "signed": ex.signed, "quantity": ex.quantity if ex.signed else "rollout",
            "input_features": list(getattr(res, "raw_input_tokens", res.input_tokens)), "input_feature_text": list(res.input_tokens),
            "token_attr": res.token_attr.tolist(),
            "seq_attr": res.seq_attr.tolist(), "rows": ex.scores.tolist(),
            "explained": None if d.explained is None else d.explained.tolist(),
            "no_token": None if d.no_token is None else d.no_token.tolist(),
            "delta": None if d.delta is None else d.delta.tolist(),
            "log_probs": None if d.log_probs is None else d.log_probs.tolist(),
            "sink_share": ex.sink_share.tolist(),
        }
    return record


def feature_text(tokenizer: Any, features: Any) -> List[str]:
    r"""Readable labels of input features: a feature that is one of the tokenizer's tokens
    (``Ġcapital``, ``▁Paris``) becomes its text (:func:`~captum_normattr.tokens.readable_tokens`);
    any other feature (a template value) is kept as it is."""
    out = []
    for f in features:
        f = str(f)
        tid = tokenizer.convert_tokens_to_ids(f)
        known = isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == f
        out.append(readable_tokens(tokenizer, [tid])[0] if known else f)
    return out


def _decimals(values: Sequence[float]) -> int:
    r"""Decimals that show the largest |value| of a block with about three significant digits."""
    m = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    return 1 if m >= 100 else (2 if m >= 1 else (3 if m >= 0.1 else 4))


def ranked_positions(record: Dict[str, Any], name: str, k: int, exclude_sink: bool = False) -> List[Tuple[int, float]]:
    r"""The positions that can contribute to generated token ``k``, ranked by |score|.

    A generated token is predicted from the prompt and every token generated before it: its
    row of the full map (``record["methods"][name]["rows"]``, over all prompt and generated
    tokens) is ranked over those positions, so an earlier generated word can come first.

    Args:
        record: what :func:`explain_generation_cli` returns (or its JSON).
        name: the method's name in ``record["methods"]``.
        k: the generated token (0 = the first).
        exclude_sink: leave the sink (``record["sink_index"]``) out.

    Returns:
        ``[(position, score), ...]``, largest |score| first.
    """
    row = record["methods"][name]["rows"][k]
    n = min(len(row), int(record["prompt_length"]) + k)
    sink = record.get("sink_index")
    pos = [j for j in range(n) if not (exclude_sink and j == sink)]
    return sorted(((j, float(row[j])) for j in pos), key=lambda jv: -abs(jv[1]) if math.isfinite(jv[1]) else 0.0)


def render_table(record: Dict[str, Any], top: int = 5, exclude_sink: Optional[bool] = None) -> str:
    r"""One block per method, one line per generated token with its top contributors, and a legend.

    The contributors are ranked over every position that can contribute (the prompt and the
    tokens generated before; generated ones marked ``*``, :func:`ranked_positions`); the
    numbers of a block share their decimals and are right-aligned.

    Args:
        record: what :func:`explain_generation_cli` returns (or its JSON).
        top: contributors shown per generated token.
        exclude_sink: leave the sink out of the contributors (default: ``record["exclude_sink"]``).

    Returns:
        The table as text (a legend under every block).
    """
    if exclude_sink is None:
        exclude_sink = bool(record.get("exclude_sink", False))
    lines: List[str] = []
    gen = record["generated"]
    labels = list(record.get("token_text") or record["tokens"])
    p_len = int(record["prompt_length"])
    sink = record.get("sink_index")
    for name, m in record["methods"].items():
        rows = m["rows"]
        totals = [float(m["explained"][k]) if m["explained"] is not None else float(sum(rows[k]))
                  for k in range(len(rows))]
        d = _decimals(totals)
        dc = _decimals([v for r in rows for v in r])
        tw = min(14, max([5] + [len(visible_text(g)) for g in gen]))
        sw = max(9, max((len(f"{t:.{d}f}") for t in totals), default=0))
        what = (f"explains the {m['quantity'].replace('_', ' ')}" if m["signed"]
                else "rollout rows (class-agnostic: no logit explained)")
        lines.append(f"{name}: {what}; one row per generated token")
        lines.append(f"{'#':>3}  {'token':<{tw}} {'score':>{sw}} {'p':>6} {'sink':>5}  top contributors")
        for k in range(len(rows)):
            p = "" if m["log_probs"] is None else f"{math.exp(m['log_probs'][k]):.3f}"
            ranked = ranked_positions(record, name, k, exclude_sink)[:max(0, top)]
            tops = "  ".join(f"{visible_text(labels[j]).strip() or visible_text(labels[j])}"
                             f"{f'@{j}*' if j >= p_len else ''} {v:+.{dc}f}" for j, v in ranked)
            lines.append(f"{k:>3}  {visible_text(gen[k])[:tw]:<{tw}} {totals[k]:>{sw}.{d}f} {p:>6} "
                         f"{m['sink_share'][k]:>5.2f}  {tops}")
        sink_tok = visible_text(labels[sink]) if isinstance(sink, int) and 0 <= sink < len(labels) else "?"
        score = ("the explained quantity of the token (the sum of its contributions plus the completeness delta)"
                 if m["signed"] else "the sum of the token's rollout row over the positions (class-agnostic: no logit is explained)")
        lines += [
            "  legend: score = " + score,
            "          p = the model's probability of the token (reported, not explained)",
            f"          sink = the share of the first token ({sink_tok}) in the row: |s_sink| / sum |s| (attention "
            "sinks take large shares)",
            "          top contributors = largest |contribution| over the prompt and the tokens generated before it "
            "(@position* = generated)" + ("; the sink left out (--exclude-sink)" if exclude_sink else ""),
            "",
        ]
    return "\n".join(lines)


def render_html(record: Dict[str, Any], title: str = "", exclude_sink: Optional[bool] = None) -> str:
    r"""The interactive report (:mod:`captum_normattr.present.interactive`): the heat table of every
    generated token over the prompt and the generated tokens, coloured as every page of the package.

    Args:
        record: what :func:`explain_generation_cli` returns (or its JSON).
        title: the page title (default: the prompt).
        exclude_sink: the sink checkbox's initial state (default: ``record["exclude_sink"]``).

    Returns:
        The HTML text.
    """
    from captum_normattr.present.interactive import interactive_report_html
    from captum_normattr.present.labels import model_display_name

    if exclude_sink is None:
        exclude_sink = bool(record.get("exclude_sink", False))
    tokens = list(record.get("token_text") or record["tokens"])
    methods = {name: m["rows"] for name, m in record["methods"].items()}
    return interactive_report_html(
        tokens, methods, title=title or str(record.get("prompt", ""))[:80], sink_index=record.get("sink_index"),
        exclude_sink=exclude_sink, model_name=model_display_name(name_or_path=record.get("model")),
        first_generated=int(record["prompt_length"]))


def simple_html_table(record: Dict[str, Any], title: str = "") -> str:
    r"""A self-contained HTML page without script: per method, generated tokens x input features,
    cells coloured by score on the package's scale (:mod:`captum_normattr.present.colours`)."""
    from captum_normattr.present.colours import colour_bar_html, score_rgb, text_colour

    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title or 'generation')}</title>",
             "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin-bottom:2em}"
             "td,th{border:1px solid #ddd;padding:2px 4px;font-size:12px}td{text-align:right}</style></head><body>",
             f"<h1>{esc(title or 'Explained generation')}</h1>"]
    for name, m in record["methods"].items():
        rows = m["token_attr"]
        scale = max((abs(v) for r in rows for v in r), default=1.0) or 1.0
        signed = any(v < 0 for r in rows for v in r)
        parts.append(f"<h2>{esc(name)}</h2>" + colour_bar_html(scale, signed) + "<table><tr><th>generated</th>")
        parts += [f"<th>{esc(str(f))}</th>" for f in (m.get("input_feature_text") or m["input_features"])]
        parts.append("</tr>")
        d = _decimals([v for r in rows for v in r])
        for k, r in enumerate(rows):
            parts.append(f"<tr><th>{esc(str(record['generated'][k]))}</th>")
            for v in r:
                rgb = score_rgb(v / scale)
                parts.append(f"<td style='background:rgb{rgb};color:{text_colour(rgb)}' title='{v:.6g}'>{v:.{d}f}</td>")
            parts.append("</tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


def generate_main(argv: Optional[Sequence[str]] = None) -> int:
    r"""Entry point of ``captum-normattr generate``.

    Args:
        argv: the arguments after ``generate`` (default: ``sys.argv[2:]``).

    Returns:
        0 on success, 2 on a usage error (message on stderr), 130 on Ctrl-C.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[2:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from captum_normattr.cli.common import CLIError, write_output
    from captum_normattr.cli.output import check_output_path

    try:
        if args.output:
            try:
                check_output_path(args.output, [], args.model, refuse_existing=not args.overwrite)
            except CLIError as err:
                raise GenerateError(str(err)) from None
        pngs: Dict[str, str] = {}
        if args.image:  # a vision-language model: captum_normattr.cli.generate_image
            from captum_normattr.cli.generate_image import explain_image_generation, heatmap_paths, write_heatmap_png

            from captum_normattr.cli import generate_image

            try:
                record, found = explain_image_generation(args)
            except generate_image.GenerateError as err:
                raise GenerateError(str(err)) from None
            pngs = heatmap_paths(args, found)
            for key, ex in found:
                write_heatmap_png(ex, pngs[key], f"{key}: {''.join(ex.output_tokens)[:40]}")
            record["image"]["heatmaps"] = {k: os.path.basename(v) for k, v in pngs.items()}
        else:
            record = explain_generation_cli(args)
        if args.format == "json":
            text = json.dumps(record)
        elif args.format == "html":
            text = render_html(record, title=args.prompt[:80])
            if pngs:
                from captum_normattr.cli.generate_image import html_with_images, interactive_image_panel

                text = interactive_image_panel(text, found, caption=f"{os.path.basename(args.image)}: the image tokens' "
                                               "scores on the patch grid, per generated token")
                text = html_with_images(text, [(k, open(v, "rb").read()) for k, v in pngs.items()])
        else:
            text = render_table(record, args.top)
        for png in pngs.values():
            print(f"{PROG}: wrote the image heat map {png}", file=sys.stderr)
        if args.output:
            write_output(text, args.output)
            print(f"{PROG}: wrote {args.format} for {len(record['methods'])} method(s) to {args.output}", file=sys.stderr)
        else:
            print(text)
        return 0
    except (GenerateError, CLIError) as err:
        print(f"{PROG}: error: {terminal_lines(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


__all__ = ["GenerateError", "build_parser", "check_generation_length", "explain_generation_cli", "feature_text", "generate_main", "llm_methods",
           "load_causal_lm", "ranked_positions", "render_html", "render_table", "simple_html_table"]
