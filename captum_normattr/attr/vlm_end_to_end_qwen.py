r"""DecompX end to end through Qwen2-VL's and Qwen2.5-VL's vision tower and patch merger, to the image patches.

Qwen2-VL (``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) take
their images as flattened patches (``pixel_values`` (N, C t_p p p), ``image_grid_thw`` (n_images, 3)); the
tower embeds every patch by a bias-free Conv3d, runs pre-LN blocks over all images' patches packed into one
sequence (attention within each image, or within each window of an image: ``cu_seqlens``; 2-D rotary
positions on the queries and keys), and its ``PatchMerger`` normalizes every patch, concatenates each
m x m block of patches (``spatial_merge_size`` m) and maps it through Linear -> GELU -> Linear to one image
token. This module carries DecompX through all of it (``docs/vlm_end_to_end.md``):

1. each patch's embedding ``W_conv * pixels`` is its own source (a conv bias, were there one, a bias part);
2. every block is a pre-LN layer decomposed by DecompX's forward step (the package's ``pre_ln`` kind) with
   the attention probabilities, norm scales and feed-forward slopes (Qwen2.5-VL's SwiGLU: DecompX's gate
   integrals) at their real values; the probabilities are recomputed from the block's real input by the
   block's own projections and rotary function, per attention segment (the image, or its windows), so that
   they carry the packing and the rotary; the rebuilt attention output is checked against the block's own;
3. Qwen2.5-VL runs the tower over its patches in window order (``window_index``): the sources stay in the
   image's order and each tower position knows its patch, so that the order is undone exactly; the
   merger's outputs are put back in the image's order as the model does;
4. the merger: its norm frozen at the real per-patch scale (its shift a merger bias), the m x m patches'
   parts concatenated, the MLP's GELU frozen at DecompX's slope rule
   (:func:`~captum_normattr.attr.vlm_end_to_end.frozen_mlp_parts`);
5. the language model: each image token's DecompX cotangent
   (:meth:`~captum_normattr.DecompXAttribution.input_cotangents`) dotted with its per-patch parts.

Patch scores + text-token scores + the no-token terms equal the model's logit (up to the Gauss-Legendre
quadrature of a gated feed-forward block, in the decoder and in Qwen2.5-VL's tower). Every call checks the
rebuilt attention outputs and block outputs, the merger's outputs and the image-token embeddings against
the model's own, and raises where they differ.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.decompx import DecompXAttribution
from captum_normattr.attr.vlm_end_to_end import frozen_mlp_parts
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.methods.decompx.parts import ff_coefficients
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts
from captum_normattr.decompose.records import FFParams, LayerTensors, NormParams
from captum_normattr.models.adapters import unwrap_model, vision_language
from captum_normattr.models.capture.record import norm_params
from captum_normattr.models.engine import compute_dtype

__all__ = ["FAMILIES", "MergedPatchContributions", "merged_patch_contributions", "patch_cells"]

#: The vision-language families carried end to end here (their ``VisionLanguage.family``).
FAMILIES: Tuple[str, ...] = ("Qwen2-VL", "Qwen2.5-VL")

#: Relative tolerance of the checks of the rebuilt tensors against the model's own, by the model's dtype (a
#: half-precision tower is rebuilt in float32 from its own rounded tensors: its rounding stays in the checks and in
#: ``delta``; a structural mistake is off by far more).
_CHECK = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass
class MergedPatchContributions:
    r"""A Qwen2-VL / Qwen2.5-VL model's explained logit shared out over image patches, text tokens and no-token terms.

    ``sum(p.sum() for p in patch_scores) + text_scores.sum() + sum(no_token.values())`` equals ``logit`` (per
    example: each image's patches count for :attr:`image_example`; :attr:`delta`).

    Attributes:
        patch_scores: per image, (t, h, w) every patch's score on the image's patch grid (``image_grid_thw``:
            t temporal patches, h x w patches; row r, column c covers pixels [r p, (r + 1) p) x [c p, (c + 1) p)
            of the resized image).
        image_example: (n_images,) the example each image belongs to.
        text_scores: (B, T) the scores of the other tokens (image tokens and pads: 0).
        image_token_scores: (B, T) DecompX's scores of the image tokens at the language model's input
            (g_k . e_k; other tokens 0): each is the sum of its row of :attr:`token_sources`.
        token_sources: per image, (G, P + 2) each of its G image tokens' scores from each of its P patches (in the
            order of ``pixel_values``: :func:`patch_cells` places them), the tower's biases and the merger's biases.
        no_token: (B,) per no-token term: ``"tower_biases"`` (the blocks' biases and norm shifts),
            ``"merger_biases"`` (the merger's norm shift, its biases and g(0)), ``"language_model_biases"``
            (DecompX's bias score).
        logit: (B,) the explained logit (the model's own).
        delta: (B,) |sum of all scores and no-token terms - logit|.
        target: (B,) the explained token ids; explained_position: (B,) their positions.
        checks: the largest relative differences of the rebuilt tensors from the model's own: ``"attention"``
            and ``"blocks"`` (every tower block), ``"merger"`` (the merged tokens), ``"embeddings"`` (the
            image tokens' embeddings at the language model's input), ``"patch_order"`` (Qwen2.5-VL's
            windowed order undone).
        quadrature_error: the largest |b (a I1 + I2) - b g(a)| of the tower's gated feed-forward blocks
            (Qwen2.5-VL; 0 for Qwen2-VL's elementwise ones).
    """

    patch_scores: Tuple[Tensor, ...]
    image_example: Tensor
    text_scores: Tensor
    image_token_scores: Tensor
    token_sources: Tuple[Tensor, ...]
    no_token: Dict[str, Tensor]
    logit: Tensor
    delta: Tensor
    target: Tensor
    explained_position: Tensor
    checks: Dict[str, float] = field(default_factory=dict)
    quadrature_error: float = 0.0


def patch_cells(grid_thw: Tensor, merge: int) -> List[Tuple[Tensor, Tensor, Tensor]]:
    r"""Where each patch of ``pixel_values`` lies: per image, (frame, row, column) of its patches, in order.

    Qwen2-VL's processor lays the patches of a (t, h, w) grid out block-major: frame by frame, the
    (h / m) x (w / m) blocks of m x m patches row by row, and inside a block its patches row by row.

    Args:
        grid_thw: (n_images, 3) ``image_grid_thw``.
        merge: ``spatial_merge_size`` m.

    Returns:
        per image, three (t h w,) long tensors.

    Examples::

        >>> [c.tolist() for c in patch_cells(torch.tensor([[1, 2, 4]]), 2)[0]]
        [[0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 2, 3, 2, 3]]
    """
    cells = []
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(f"a {h} x {w} patch grid is not made of {merge} x {merge} blocks")
        shape = (t, h // merge, w // merge, merge, merge)
        ft = torch.arange(t).view(t, 1, 1, 1, 1).expand(shape)
        inner = torch.arange(merge)
        rr = (torch.arange(h // merge).view(1, -1, 1, 1, 1) * merge + inner.view(1, 1, 1, -1, 1)).expand(shape)
        cc = (torch.arange(w // merge).view(1, 1, -1, 1, 1) * merge + inner.view(1, 1, 1, 1, -1)).expand(shape)
        cells.append((ft.reshape(-1), rr.reshape(-1), cc.reshape(-1)))
    return cells


def _relative(a: Tensor, b: Tensor) -> float:
    a, b = a.detach(), b.detach().to(a.dtype)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def _norm(module: nn.Module, dtype: torch.dtype) -> NormParams:
    r"""The tower's norm (LayerNorm in Qwen2-VL, RMSNorm in Qwen2.5-VL) as :class:`NormParams`."""
    kind = "layernorm" if isinstance(module, nn.LayerNorm) else "rmsnorm"
    if kind == "rmsnorm" and not (type(module).__name__.endswith("RMSNorm") or isinstance(module, nn.RMSNorm)):
        raise UnsupportedModelError(f"the tower's norm {type(module).__name__} is neither a LayerNorm nor an RMSNorm")
    return norm_params(module, kind, dtype)


def _feed_forward(mlp: nn.Module, dtype: torch.dtype) -> FFParams:
    r"""The block's MLP: Qwen2-VL's fc1 -> act -> fc2, or Qwen2.5-VL's SwiGLU (gate, up, down)."""
    def w(lin: nn.Linear) -> Tuple[Tensor, Optional[Tensor]]:
        return lin.weight.detach().to(dtype).T, None if lin.bias is None else lin.bias.detach().to(dtype)

    if all(hasattr(mlp, n) for n in ("fc1", "fc2", "act")):
        (w_in, b_in), (w_out, b_out) = w(mlp.fc1), w(mlp.fc2)
        return FFParams(w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out, act=mlp.act)
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        (w_g, b_g), (w_in, b_in), (w_out, b_out) = w(mlp.gate_proj), w(mlp.up_proj), w(mlp.down_proj)
        return FFParams(w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out, act=mlp.act_fn, w_gate=w_g, b_gate=b_g)
    raise UnsupportedModelError(f"the tower's MLP {type(mlp).__name__} is neither fc1 -> act -> fc2 nor a gated "
                                "(gate_proj, up_proj, down_proj) block")


class _TowerTape:
    r"""The real tensors of the tower's first forward pass inside the block: hooks on the patch embedding,
    every block (its input, ``cu_seqlens``, rotary ``position_embeddings``, its attention's and its own
    outputs) and the merger."""

    def __init__(self, tower: nn.Module) -> None:
        self.tower = tower
        self.got: Dict[Any, Any] = {}
        self.done = False
        self.handles: List[Any] = []

    def __enter__(self) -> "_TowerTape":
        tower = self.tower

        def keep(key):
            def hook(module, args, output):
                if not self.done:
                    self.got[key] = output.detach()
                if key == "merger":
                    self.done = True
            return hook

        def block_input(l):
            def hook(module, args, kwargs):
                if not self.done:
                    x = args[0] if args else kwargs["hidden_states"]
                    self.got[("in", l)] = (x.detach(), kwargs["cu_seqlens"], kwargs["position_embeddings"])
            return hook

        self.handles.append(tower.patch_embed.register_forward_hook(keep("patches")))
        for l, blk in enumerate(tower.blocks):
            self.handles.append(blk.register_forward_pre_hook(block_input(l), with_kwargs=True))
            self.handles.append(blk.attn.register_forward_hook(keep(("attn", l))))
            self.handles.append(blk.register_forward_hook(keep(("out", l))))
        self.handles.append(tower.merger.register_forward_hook(keep("merger")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def _segments(cu: Tensor, start: int, end: int) -> List[Tuple[int, int]]:
    r"""The attention segments (``cu_seqlens``) inside [start, end), counted from ``start``; raises if one crosses an
    image's border."""
    bounds = [int(c) for c in cu.tolist()]
    inside = [c for c in bounds if start <= c <= end]
    if not inside or inside[0] != start or inside[-1] != end:
        raise UnsupportedModelError("an attention segment of the tower crosses an image's border: images are "
                                    "decomposed one at a time")
    return [(a - start, b - start) for a, b in zip(inside[:-1], inside[1:])]  # in the image's own rows


def _block_tensors(blk: nn.Module, l: int, x: Tensor, segments: List[Tuple[int, int]], cos: Tensor, sin: Tensor,
                   attn_real: Tensor, out_real: Tensor, dtype: torch.dtype,
                   rotary) -> Tuple[LayerTensors, Tensor, Optional[Tensor], float]:
    r"""(the block's :class:`LayerTensors` over one image's T tower rows, W_V, b_V, the relative difference of the
    rebuilt attention output from the real one): the probabilities recomputed per segment from the real input by
    the block's own norm, qkv projection and rotary function."""
    attn = blk.attn
    t, d = x.shape
    h = attn.num_heads
    ln1 = _norm(blk.norm1, dtype)
    ln1_out = blk.norm1(x.to(blk.norm1.weight.dtype)).to(dtype)
    qkv = attn.qkv(ln1_out.to(attn.qkv.weight.dtype)).to(dtype).reshape(t, 3, h, -1).permute(1, 0, 2, 3)
    q, k, v = qkv.unbind(0)
    q, k = rotary(q, k, cos, sin)  # the model's own rotary (it computes in float32), so the same probabilities
    q, k = q.to(dtype).transpose(0, 1), k.to(dtype).transpose(0, 1)  # (H, T, Dh)
    probs = x.new_zeros(h, t, t)
    for s0, s1 in segments:
        scores = q[:, s0:s1] @ k[:, s0:s1].transpose(1, 2) * attn.scaling
        probs[:, s0:s1, s0:s1] = torch.softmax(scores, -1)
    values = v.transpose(0, 1)  # (H, T, Dh), the value bias inside
    w_o = attn.proj.weight.detach().to(dtype).T
    b_o = None if attn.proj.bias is None else attn.proj.bias.detach().to(dtype)
    attn_out = (probs @ values).transpose(0, 1).reshape(t, -1) @ w_o + (0 if b_o is None else b_o)
    hidden = x + attn_real
    ln2 = _norm(blk.norm2, dtype)
    ln2_out = blk.norm2(hidden.to(blk.norm2.weight.dtype)).to(dtype)
    layer = LayerTensors(
        hidden_in=x[None], probs=probs[None], values=values[None], out_weight=w_o, out_bias=b_o, ln1=ln1,
        ln1_in=x[None], ln1_out=ln1_out[None], ln2=ln2, ln2_in=hidden[None], ln2_out=ln2_out[None],
        ff_out=(out_real - hidden)[None], layer_out=out_real[None], ff=_feed_forward(blk.mlp, dtype), causal=False,
        index=l, topology="pre_ln", ff_input_key="ln2_out",
    )
    w_qkv = attn.qkv.weight.detach().to(dtype)
    b_qkv = attn.qkv.bias
    b_v = None if b_qkv is None else b_qkv.detach().to(dtype)[2 * d:]
    return layer, w_qkv[2 * d:].T, b_v, _relative(attn_out, attn_real)


def _tower_order(tower: nn.Module, grid_thw: Tensor, n: int) -> Tensor:
    r"""(N,) the patch (index into ``pixel_values``) at each position of the tower's sequence: the identity for
    Qwen2-VL, the window order (``window_index``, groups of m^2 patches) for Qwen2.5-VL."""
    order = torch.arange(n, device=grid_thw.device)
    if not hasattr(tower, "fullatt_block_indexes"):
        return order
    module = sys.modules.get(type(tower).__module__)
    window = getattr(module, "get_vision_window_index", None)
    if window is None or not hasattr(tower, "permute_input_for_window_attn"):
        raise UnsupportedModelError(f"{type(tower).__name__} reorders its patches by windows, but this transformers "
                                    "version's window index function is not where the package reads it")
    index, _ = window(grid_thw, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
                      patch_size=tower.patch_size)
    return tower.permute_input_for_window_attn(order.unsqueeze(-1), index.to(order.device), seq_len=n).squeeze(-1)


def _image_parts(tower: nn.Module, tape: Dict[Any, Any], order: Tensor, start: int, end: int, dtype: torch.dtype,
                 nodes: int, memory_budget_mb: float, checks: Dict[str, float]) -> Tuple[Tensor, Tensor, Tensor, float]:
    r"""One image's merged tokens as parts: (parts (G, P + 1, D) in the image's token order, the last source the
    merger's norm shift; the tower's bias part (G, D); the merger's constant (G, D); the largest quadrature error)."""
    module = sys.modules.get(type(tower).__module__)
    rotary = getattr(module, "apply_rotary_pos_emb_vision", None)
    if rotary is None:
        raise UnsupportedModelError(f"the rotary function of {type(tower).__name__} is not where the package reads it")
    conv = tower.patch_embed.proj
    local = order[start:end] - start  # tower row -> the image's own patch index
    t = end - start
    m2 = tower.spatial_merge_size ** 2
    blocks = local.view(-1, m2)
    if local.min() < 0 or local.max() >= t or not torch.equal(
            blocks, (blocks[:, :1] // m2) * m2 + torch.arange(m2, device=local.device)):
        raise UnsupportedModelError("the tower's window order mixes the patches of two images or splits a merge block")
    patches = tape["patches"][start:end].to(dtype)  # in the image's (pixel_values) order
    bias0 = torch.zeros_like(patches) if conv.bias is None else conv.bias.detach().to(dtype).expand_as(patches).clone()
    emb = patches - bias0  # each patch's own W_conv * pixels
    parts = patches.new_zeros(1, t, t, patches.shape[-1])
    parts[0, torch.arange(t), local] = emb[local]
    bias = bias0[local][None]
    x0 = tape[("in", 0)][0][start:end].to(dtype) if tower.blocks else None
    if x0 is not None:
        checks["patch_order"] = max(checks.get("patch_order", 0.0), _relative(patches[local], x0))
    quad = 0.0
    kind = layer_kind("pre_ln")
    for l, blk in enumerate(tower.blocks):
        x, cu, (cos, sin) = tape[("in", l)]
        rows = slice(start, end)
        layer, w_v, b_v, attn_check = _block_tensors(
            blk, l, x[rows].to(dtype), _segments(cu, start, end), cos[rows], sin[rows],
            tape[("attn", l)][rows].to(dtype), tape[("out", l)][rows].to(dtype), dtype, rotary)
        checks["attention"] = max(checks.get("attention", 0.0), attn_check)
        coefs = ff_coefficients(layer, nodes)
        if "quadrature_error" in coefs:
            quad = max(quad, float(coefs["quadrature_error"].max()))
        parts, bias = kind.decompx_step(parts, bias, layer, w_v, b_v, "separate", rows=torch.arange(t, device=x.device),
                                        memory_budget_mb=memory_budget_mb, coefs=coefs)
        checks["blocks"] = max(checks.get("blocks", 0.0), _relative(parts.sum(2) + bias, layer.layer_out))
    real = (tape[("out", len(tower.blocks) - 1)][start:end] if tower.blocks else tape["patches"][start:end][local])
    real = real.to(dtype)
    merger = tower.merger
    ln = _norm(merger.ln_q, dtype)
    shift = torch.zeros_like(real) if ln.bias is None else ln.bias.expand_as(real)
    # the norm frozen at each patch's real scale: the patches' parts, then its shift as one more (merger) source
    z_parts = torch.cat([apply_norm_to_parts(parts, real[None], ln)[0], shift.unsqueeze(1)], 1)  # (T, P + 1, D)
    z_bias = apply_norm_to_parts(bias.unsqueeze(2), real[None], ln)[0, :, 0]  # the tower's bias part through it
    z_real = merger.ln_q(real.to(merger.ln_q.weight.dtype)).to(dtype)
    g = t // m2
    d = real.shape[-1]
    cat = z_parts.view(g, m2, t + 1, d).permute(0, 2, 1, 3).reshape(g, t + 1, m2 * d)
    lin1, act, lin2 = merger.mlp[0], merger.mlp[1], merger.mlp[2]
    out, out_bias, const = frozen_mlp_parts(lin1, act, lin2, cat, z_bias.reshape(g, m2 * d), z_real.reshape(g, m2 * d))
    back = _tokens_back(local, m2)  # the merged tokens back in the image's order
    return out[back], out_bias[back], const[back], quad


def _model_parts(model: nn.Module) -> Tuple[nn.Module, nn.Module]:
    r"""(the base model, its tower); refuses what is not Qwen2-VL / Qwen2.5-VL."""
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None or description.family not in FAMILIES:
        raise UnsupportedModelError(
            f"merged_patch_contributions carries {' and '.join(FAMILIES)} to the patches; {type(model).__name__} is "
            "not one (LLaVA: vlm_end_to_end.patch_contributions; docs/vlm_end_to_end.md)")
    base = model.model
    tower = base.visual
    if not all(hasattr(tower, n) for n in ("patch_embed", "blocks", "merger")):
        raise UnsupportedModelError(f"the tower {type(tower).__name__} is not a patch-embed / blocks / merger tower")
    return base, tower


@log_usage()
@torch.no_grad()
def merged_patch_contributions(
    model: nn.Module,
    input_ids: Tensor,
    pixel_values: Tensor,
    image_grid_thw: Tensor,
    target: Any = None,
    attention_mask: Optional[Tensor] = None,
    mm_token_type_ids: Optional[Tensor] = None,
    explained_position: Any = None,
    foil: Any = None,
    nodes: int = DEFAULT_NODES,
    memory_budget_mb: float = 256.0,
    strict: bool = False,
) -> MergedPatchContributions:
    r"""DecompX of a Qwen2-VL / Qwen2.5-VL next-token logit, end to end: every image patch's score, exact.

    The language model's DecompX cotangent at each image token is dotted with the token's embedding split
    over the image's patches through the tower's blocks and the patch merger (module docstring;
    ``docs/vlm_end_to_end.md`` gives the equations).

    Args:
        model: a ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``.
        input_ids: (B, T) ids with the image tokens (``config.image_token_id``), padded left or right.
        pixel_values: (N, C t_p p p) the images' patches, as the processor gives them.
        image_grid_thw: (n_images, 3) each image's (t, h, w) patch grid.
        target: the explained token id(s) (None: the predicted next token), as for DecompX.
        attention_mask: (B, T), or None (all ones).
        mm_token_type_ids: (B, T) as the processor gives them (None: 1 on the image tokens).
        explained_position: ``"last"`` (default), an int or a (B,) tensor, as for DecompX.
        foil: token id(s) whose logit is subtracted, as for DecompX.
        nodes: Gauss-Legendre nodes of a gated FF's integrals (the decoder's, Qwen2.5-VL's tower's).
        memory_budget_mb: bound on one tower block step's temporaries.
        strict: raise instead of warning where DecompX's guards find a mismatch.

    Returns:
        :class:`MergedPatchContributions`.

    Raises:
        UnsupportedModelError: not Qwen2-VL / Qwen2.5-VL, a tower whose norm or MLP is not the known one, an
            attention segment across images.
        ValueError: image tokens that do not match the images, or rebuilt tensors that differ from the model's own.

    Examples::

        >>> batch = processor(images=image, text=prompt, return_tensors="pt")
        >>> res = merged_patch_contributions(model, batch["input_ids"], batch["pixel_values"],
        ...                                  batch["image_grid_thw"], attention_mask=batch["attention_mask"],
        ...                                  mm_token_type_ids=batch["mm_token_type_ids"])
        >>> res.patch_scores[0].shape   # (1, h, w): the first image's patch grid
    """
    model = unwrap_model(model)
    base, tower = _model_parts(model)
    dtype = compute_dtype(model)
    tol = _CHECK.get(next(tower.parameters()).dtype, 1e-3)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    token_id = model.config.image_token_id
    if mm_token_type_ids is None:
        mm_token_type_ids = (input_ids == token_id).long()
    attr = DecompXAttribution(model, algorithm="adjoint", explained_position=explained_position, nodes=nodes,
                              strict=strict)
    inputs = {"attention_mask": mask, "pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
              "mm_token_type_ids": mm_token_type_ids}
    with _TowerTape(tower) as tape:
        cot = attr.input_cotangents(input_ids, target, inputs, foil)
    if "merger" not in tape.got:
        raise ValueError("the model did not run its vision tower (no images in the call?)")
    g, e, dx = cot.cotangent, cot.embeddings, cot.result
    grid = image_grid_thw.to(g.device)
    m = tower.spatial_merge_size
    sizes = [int(s) for s in grid.prod(-1).tolist()]
    n = sum(sizes)
    order = _tower_order(tower, image_grid_thw, n).to(g.device)
    checks: Dict[str, float] = {}
    per_image: List[Tuple[Tensor, Tensor, Tensor]] = []
    quad, start = 0.0, 0
    merged_real = tape.got["merger"].to(dtype)
    for size in sizes:
        out, out_bias, const, q = _image_parts(tower, tape.got, order, start, start + size, dtype, nodes,
                                               memory_budget_mb, checks)
        quad = max(quad, q)
        per_image.append((out, out_bias, const))
        start += size
    rebuilt = torch.cat([o.sum(1) + b + c for o, b, c in per_image])
    checks["merger"] = _relative(rebuilt, merged_real[_tokens_back(order, m * m)])
    image = (input_ids.to(g.device) == token_id) & (mask.to(g.device) > 0)
    if int(image.sum()) != rebuilt.shape[0]:
        raise ValueError(f"{int(image.sum())} image tokens for {rebuilt.shape[0]} merged patches of the images")
    checks["embeddings"] = _relative(rebuilt, e[image])
    if max(checks.values()) > tol:
        raise ValueError(f"the image tokens rebuilt through the tower and the merger differ from the model's "
                         f"(relative, tolerance {tol:g}): {checks}")
    g_img = g[image]
    example_of_token = image.nonzero()[:, 0]
    b = input_ids.shape[0]
    cells = patch_cells(grid, m)
    patch_scores, token_sources, examples = [], [], []
    tower_bias = torch.zeros(b, dtype=dtype, device=g.device)
    merger_bias = torch.zeros_like(tower_bias)
    patch_total = torch.zeros_like(tower_bias)
    row = 0
    for (out, out_bias, const), (tt, rr, cc), (t_, h_, w_) in zip(per_image, cells, grid.tolist()):
        gi = g_img[row:row + out.shape[0]]
        ex = example_of_token[row]
        if bool((example_of_token[row:row + out.shape[0]] != ex).any()):
            raise ValueError("an image's tokens are split over two examples")
        row += out.shape[0]
        merger_part = torch.einsum("gd,gd->g", out[:, -1], gi) + (gi * const).sum(-1)  # its norm shift + constant
        src = torch.cat([torch.einsum("gsd,gd->gs", out[:, :-1], gi), (gi * out_bias).sum(-1, keepdim=True),
                         merger_part.unsqueeze(-1)], -1)
        token_sources.append(src)
        scores = src[:, :-2].sum(0)
        grid_scores = scores.new_zeros(int(t_), int(h_), int(w_))
        grid_scores[tt.to(g.device), rr.to(g.device), cc.to(g.device)] = scores
        patch_scores.append(grid_scores)
        examples.append(ex)
        tower_bias[ex] += src[:, -2].sum()
        merger_bias[ex] += src[:, -1].sum()
        patch_total[ex] += scores.sum()
    no_token = {"tower_biases": tower_bias, "merger_biases": merger_bias,
                "language_model_biases": dx.bias_scores[:, 0]}
    scores = dx.scores
    text = torch.where(image, torch.zeros_like(scores), scores)
    image_scores = torch.where(image, scores, torch.zeros_like(scores))
    total = patch_total + text.sum(1) + sum(no_token.values())
    logit = dx.logits[:, 0]
    return MergedPatchContributions(
        patch_scores=tuple(patch_scores), image_example=torch.stack(examples) if examples else example_of_token[:0],
        text_scores=text, image_token_scores=image_scores, token_sources=tuple(token_sources), no_token=no_token,
        logit=logit, delta=(total - logit).abs(), target=dx.target, explained_position=dx.explained_position,
        checks=checks, quadrature_error=quad,
    )


def _tokens_back(order: Tensor, m2: int) -> Tensor:
    r"""(G,) the merger's output rows (tower order) of the merged tokens in the images' order, from the patch at
    each tower position (``order``): tower group j holds the image-order group order[j m^2] // m^2."""
    group_of = order.view(-1, m2)[:, 0] // m2
    back = torch.empty_like(group_of)
    back[group_of] = torch.arange(group_of.shape[0], device=group_of.device)
    return back
