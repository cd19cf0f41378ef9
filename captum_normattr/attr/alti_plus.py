r"""ALTI+ (Ferrando et al., EMNLP 2022): source and target-prefix contributions in encoder-decoders.

For every decoder-input position i (the state that predicts token i + 1) ALTI+ gives how
much every source token and every decoder-input token t_0..t_i contributes to it; each row
sums to 1. The definition and its choices are in ``docs/seq2seq.md``; the mathematics in
:mod:`captum_normattr.decompose.methods.alti_plus`, the recording in
:mod:`captum_normattr.models.seq2seq`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from captum_normattr.attr.base import DecompositionAttribution
from captum_normattr.attr.inputs import explained_positions, has_gaps
from captum_normattr.decompose.methods.alti_plus import (
    DEFAULT,
    OFFICIAL,
    ALTIPlusConventions,
    alti_plus_rollout_step,
    block_contributions,
)
from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.models.engine import mark_non_finite
from captum_normattr.models.seq2seq import BLOCKS, get_seq2seq_adapter, recording_seq2seq, seq2seq_base
from captum_normattr.models.weights import input_device
from captum_normattr.options import check_explained_position, check_memory_budget
from captum_normattr.result import AttributionResult

__all__ = ["ALTIPlusAttribution", "ALTIPlusResult", "GeneratedTokenExplanation", "explain_generation"]

#: Default memory budget of one block's ALTI kernel (the row cap of
#: :func:`~captum_normattr.decompose.primitives.chunking.rows_for_budget`), in MB.
ALTI_PLUS_MEMORY_BUDGET_MB = 256.0


@dataclass
class ALTIPlusResult(AttributionResult):
    r"""ALTI+ contributions of one batch of (source, decoder input) pairs.

    Row i of every decoder matrix is decoder-input position i, the state that predicts
    token i + 1; its target columns include t_i itself. Pad rows and columns are exactly 0.

    Attributes:
        scores: (B, S) the source row of the explained position (``explained_position``).
        attention_mask: (B, S) the source mask.
        explained_position: (B,) long, the explained decoder position (padded tensor).
        delta: (B,) the largest completeness error of the example over all blocks.
        target_scores: (B, T) the target-prefix row of the explained position.
        target_attention_mask: (B, T) the decoder mask.
        source_contributions: (B, T, S) R_L[:, :, :S].
        target_contributions: (B, T, T) R_L[:, :, S:], lower triangular.
        source_share: (B, T) the sum of the source contributions of every row (0 at pads).
        completeness_error: () the largest absolute error of the sum of the parts (bias
            parts included) against the real block outputs, over every block.
        encoder_maps: (B, L_e, S, S) the encoder layer maps C^enc_l, or None.
        encoder_rollout: (B, S, S) the encoder rollout R^enc, or None.
        decoder_self_maps: (B, L_d, T, T) the decoder self-attention maps C^self_l, or None.
        decoder_cross_maps: (B, L_d, T, S + 1) the cross-attention maps C^cross_l (last
            column: the residual stream's share), or None.
        conventions: ``"default"`` or ``"official"`` (or a description of a custom mix).
        extras: per-block completeness errors ``"encoder_completeness_error"`` (L_e,),
            ``"decoder_self_completeness_error"`` and ``"decoder_cross_completeness_error"`` (L_d,).
    """

    TOKEN_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {"scores": (1,)}
    EXPLAINED_AXES: ClassVar[str] = "TARGET_AXES"
    NOT_PER_EXAMPLE: ClassVar[Tuple[str, ...]] = AttributionResult.NOT_PER_EXAMPLE + ("target_attention_mask",)
    #: field -> source token axes (of the batched tensor)
    SOURCE_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {
        "scores": (1,), "source_contributions": (2,), "encoder_maps": (2, 3), "encoder_rollout": (1, 2),
        "decoder_cross_maps": (3,),
    }
    #: field -> target token axes
    TARGET_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {
        "target_scores": (1,), "source_contributions": (1,), "target_contributions": (1, 2), "source_share": (1,),
        "decoder_self_maps": (2, 3), "decoder_cross_maps": (2,),
    }

    target_scores: Optional[Tensor] = None
    target_attention_mask: Optional[Tensor] = None
    source_contributions: Optional[Tensor] = None
    target_contributions: Optional[Tensor] = None
    source_share: Optional[Tensor] = None
    completeness_error: Optional[Tensor] = None
    encoder_maps: Optional[Tensor] = None
    encoder_rollout: Optional[Tensor] = None
    decoder_self_maps: Optional[Tensor] = None
    decoder_cross_maps: Optional[Tensor] = None
    conventions: str = "default"

    @property
    def target_share(self) -> Tensor:
        r"""(B, T) the share of the target prefix, 1 - source share (0 at pads)."""
        return self.target_contributions.sum(-1)

    def kept_positions(self, index: int) -> Dict[str, Tensor]:
        r"""The real source tokens (``SOURCE_AXES``) and decoder positions (``TARGET_AXES``) of
        example ``index``: :meth:`example` drops the pads of both sides, keeps the residual
        column of ``decoder_cross_maps`` (last) and counts ``explained_position`` over the
        real decoder positions."""
        return {
            "SOURCE_AXES": self.attention_mask[index].bool().nonzero().squeeze(-1),
            "TARGET_AXES": self.target_attention_mask[index].bool().nonzero().squeeze(-1),
        }

    def axis_positions(self, name: str, axis: int, positions: Tensor) -> Tensor:
        if name == "decoder_cross_maps" and axis == 3:  # keep the residual column (the last one)
            return torch.cat([positions, positions.new_tensor([self.decoder_cross_maps.shape[3] - 1])])
        return positions


def _describe(conv: ALTIPlusConventions) -> str:
    if conv == DEFAULT:
        return "default"
    if conv == OFFICIAL:
        return "official"
    return f"ln_scale={conv.ln_scale}, l1_eps={conv.l1_eps:g}, renormalize_rollout={conv.renormalize_rollout}"


def _check_ids(name: str, ids: Any, vocab: int) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids (B, T); got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids; got dtype {ids.dtype}")
    if ids.dim() == 1:
        raise ValueError(f"{name} must be a batch (B, T); got shape {tuple(ids.shape)} — use ids.unsqueeze(0)")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T); got {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(ids.shape)}): give at least one token per example")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} must lie in [0, {vocab - 1}] (the model's vocabulary); got values in [{lo}, {hi}]")
    return ids.long()


def _check_mask(name: str, mask: Any, shape: Tuple[int, int], device, contiguous: bool) -> Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.long, device=device)
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (B, T) of 0 and 1 or None; got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of its token ids {tuple(shape)}; got {tuple(mask.shape)}")
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0 (pad) and 1 (token)")
    mask = mask.to(device=device, dtype=torch.long)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"example(s) {empty} have no tokens in {name} (all 0)")
    if contiguous and has_gaps(mask):
        raise ValueError(f"{name} must be one contiguous block of 1s per example (left or right padding)")
    return mask


def _split_inputs(inputs: Any) -> Tuple[Any, Any]:
    if not isinstance(inputs, (tuple, list)) or len(inputs) != 2:
        raise ValueError(
            "inputs must be a pair (src_ids, tgt_ids) of token-id tensors; got "
            + (f"a sequence of {len(inputs)}" if isinstance(inputs, (tuple, list)) else type(inputs).__name__)
        )
    return inputs[0], inputs[1]


def _split_masks(additional_forward_args: Any) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    if additional_forward_args is None:
        return None, None
    if isinstance(additional_forward_args, Tensor):
        return additional_forward_args, None
    if isinstance(additional_forward_args, (tuple, list)):
        if len(additional_forward_args) > 2:
            raise ValueError(
                "additional_forward_args must be (src_mask, tgt_mask), src_mask or None; got a sequence of "
                f"{len(additional_forward_args)}"
            )
        args = list(additional_forward_args) + [None] * (2 - len(additional_forward_args))
        return args[0], args[1]
    raise TypeError(
        f"additional_forward_args must be (src_mask, tgt_mask), src_mask or None; got {type(additional_forward_args).__name__}"
    )


_LEGACY_NAMES = ("src_attention_mask", "tgt_attention_mask", "return_layer_maps", "explained_position")


def _legacy_call(src_ids, tgt_ids, src_mask, args, kwargs, return_layer_maps):
    r"""The arguments of the deprecated ``decompose(src_ids, tgt_ids, src_mask, tgt_mask, return_layer_maps,
    explained_position)`` form (with a DeprecationWarning)."""
    warnings.warn(
        "ALTIPlusAttribution.decompose(src_ids, tgt_ids, src_mask, tgt_mask, ...) is deprecated: call "
        "decompose((src_ids, tgt_ids), target, (src_mask, tgt_mask), return_layer_maps=...) as attribute() "
        "(target: the explained decoder position, the former explained_position)",
        DeprecationWarning,
        stacklevel=3,
    )
    if len(args) > 3:
        raise TypeError(f"decompose() takes at most 6 arguments in its old form, got {3 + len(args)}")
    unknown = sorted(set(kwargs) - set(_LEGACY_NAMES))
    if unknown:
        raise TypeError(f"decompose() got unexpected keyword arguments {unknown}")
    values = {"src_attention_mask": src_mask, "tgt_attention_mask": None, "return_layer_maps": return_layer_maps,
              "explained_position": "last"}
    for name, value in zip(_LEGACY_NAMES[1:], args):
        values[name] = value
    for name, value in kwargs.items():
        if name == "src_attention_mask" and src_mask is not None:
            raise TypeError("decompose() got two source attention masks (positional and src_attention_mask=)")
        values[name] = value
    return (src_ids, tgt_ids, values["src_attention_mask"], values["tgt_attention_mask"], values["return_layer_maps"],
            values["explained_position"])


class _Stream:
    r"""The ``on_block`` of one ALTI+ call: each block's map as soon as the block has run, the rollouts
    updated layer by layer (blocks arrive as encoder layers 0..L_e-1, then decoder self, cross per layer)."""

    def __init__(self, attr: "ALTIPlusAttribution", v_src: Tensor, v_tgt: Tensor, keep: bool, device) -> None:
        self.conv, self.budget = attr.conventions, attr.memory_budget_mb
        self.v_src, self.v_tgt, self.keep, self.device = v_src, v_tgt, keep, device
        self.layers: Dict[str, int] = {}
        self.maps: Dict[str, List[Tensor]] = {name: [] for name in BLOCKS}
        self.errors: Dict[str, List[Tensor]] = {name: [] for name in BLOCKS}
        self.r_enc: Optional[Tensor] = None
        self.r_src: Optional[Tensor] = None
        self.r_tgt: Optional[Tensor] = None
        self._self_map: Optional[Tensor] = None

    def __call__(self, name: str, index: int, blk) -> None:
        expected = len(self.errors[name])
        enc_done = len(self.errors["encoder_self"]) == self.layers.get("encoder_self", 0)
        in_order = index == expected and (name == "encoder_self" or enc_done)
        if name == "decoder_cross":
            in_order = in_order and self._self_map is not None
        elif name == "decoder_self":
            in_order = in_order and self._self_map is None
        if not in_order:
            raise RuntimeError(
                f"ALTI+ expects the blocks in the order of the encoder layers, then each decoder layer's self- and "
                f"cross-attention; got the {name} block of layer {index} out of turn (a model that runs its stacks "
                "differently is not supported)"
            )
        dev = blk.probs.device
        valid_q = (self.v_src if name == "encoder_self" else self.v_tgt).to(dev)
        valid_k = (self.v_tgt if name == "decoder_self" else self.v_src).to(dev)
        causal = name == "decoder_self" and not self.conv.l1_eps  # the official +1e-6 weighs later tokens too
        b, _, _, k = blk.probs.shape
        chunk = rows_for_budget(b, k, blk.head_weight.shape[-1], blk.values.element_size(), self.budget, causal=causal)
        c, err = block_contributions(
            blk.probs, blk.values, blk.head_weight, blk.out_bias, blk.residual, blk.output, valid_q, valid_k,
            cross=blk.cross, norm=blk.norm, norm_input=blk.norm_input, conventions=self.conv, chunk_rows=chunk,
            causal=causal,
        )
        del blk
        c, err = c.to(self.device), err.to(self.device)
        self.errors[name].append(err)
        if self.keep:
            self.maps[name].append(c)
        if name == "encoder_self":
            self.r_enc = c if self.r_enc is None else torch.matmul(c, self.r_enc)
        elif name == "decoder_self":
            self._self_map = c
        else:
            self.r_src, self.r_tgt = alti_plus_rollout_step(
                self.r_src, self.r_tgt, self._self_map, c, self.r_enc, self.conv.renormalize_rollout, layer=index
            )
            self._self_map = None


class ALTIPlusAttribution(DecompositionAttribution):
    r"""ALTI+ source and target-prefix contributions of encoder-decoder Transformers.

    Supported: BART, Marian (post-LN), mBART, M2M100/NLLB, Pegasus (pre-LN) and T5/mT5
    (pre-LN, RMS-style norm, relative position bias), as ``*ForConditionalGeneration`` /
    ``MarianMTModel`` or their base models. The encoder is rolled out with ALTI; every
    decoder layer contributes its self-attention block (over the decoder inputs) and its
    cross-attention block (over the source tokens, through the encoder rollout, and the
    residual stream, handed on through the self-attention map); see ``docs/seq2seq.md``.

    Args:
        model: the encoder-decoder.
        conventions: ``"default"`` (the exact norm scale, plain L1 distance) or
            ``"official"`` (the official code's unbiased std, +1e-6 inside the L1 distance
            and row re-normalisation of the decoder rollout), or an
            :class:`~captum_normattr.decompose.methods.alti_plus.ALTIPlusConventions`.
        memory_budget_mb: memory budget of one block's ALTI kernel (the cap on its rows per
            tile, :func:`~captum_normattr.decompose.primitives.chunking.rows_for_budget`).

    Raises:
        UnsupportedModelError: for a model of another family (the message lists the supported ones).

    Examples::

        >>> alti = ALTIPlusAttribution(model)
        >>> res = alti.decompose((src_ids, tgt_ids), additional_forward_args=(src_mask, tgt_mask))
        >>> res.source_contributions.shape, res.source_share.shape  # (B, T, S), (B, T)
        >>> src_scores, tgt_scores = alti.attribute((src_ids, tgt_ids), additional_forward_args=(src_mask, tgt_mask))
    """

    method_name = "ALTI+"

    def __init__(
        self,
        model: nn.Module,
        conventions: Union[str, ALTIPlusConventions] = "default",
        memory_budget_mb: float = ALTI_PLUS_MEMORY_BUDGET_MB,
    ) -> None:
        self.adapter = get_seq2seq_adapter(model)
        seq2seq_base(model)  # raises for a model without both stacks (T5EncoderModel, ...)
        if isinstance(conventions, str):
            if conventions not in ("default", "official"):
                raise ValueError(f"conventions must be 'default', 'official' or an ALTIPlusConventions, got {conventions!r}")
            conventions = DEFAULT if conventions == "default" else OFFICIAL
        elif not isinstance(conventions, ALTIPlusConventions):
            raise TypeError(f"conventions must be 'default', 'official' or an ALTIPlusConventions, got {type(conventions).__name__}")
        Attribution.__init__(self, model)
        self.model = model
        self.conventions = conventions
        self.memory_budget_mb = check_memory_budget(memory_budget_mb)

    # --- inputs -------------------------------------------------------------------------
    def _prepare(self, src_ids, tgt_ids, src_mask, tgt_mask):
        config = self.model.config
        vocab = int(getattr(config, "vocab_size"))
        tgt_vocab = int(getattr(config, "decoder_vocab_size", None) or vocab)  # Marian: separate vocabularies
        src_ids = _check_ids("source ids", src_ids, vocab)
        tgt_ids = _check_ids("decoder input ids", tgt_ids, tgt_vocab)
        if src_ids.shape[0] != tgt_ids.shape[0]:
            raise ValueError(
                f"source and decoder inputs must hold the same number of examples; got {src_ids.shape[0]} and {tgt_ids.shape[0]}"
            )
        # learned or fixed-size position tables; M2M100 extends its sinusoids and T5 has relative positions
        limit = None if self.adapter.model_types[0] in ("t5", "m2m_100") else getattr(config, "max_position_embeddings", None)
        for name, ids in (("source", src_ids), ("decoder input", tgt_ids)):
            if limit is not None and ids.shape[1] > int(limit):
                raise ValueError(f"the {name} has {ids.shape[1]} tokens but the model accepts at most {limit}; truncate it")
        device = input_device(self.model, src_ids)
        src_ids, tgt_ids = src_ids.to(device), tgt_ids.to(device)
        src_mask = _check_mask("source attention mask", src_mask, tuple(src_ids.shape), device, contiguous=False)
        tgt_mask = _check_mask("decoder attention mask", tgt_mask, tuple(tgt_ids.shape), device, contiguous=True)
        return src_ids, tgt_ids, src_mask, tgt_mask

    # --- decomposition ------------------------------------------------------------------
    def decompose(  # type: ignore[override]
        self,
        inputs: Tuple[Tensor, Tensor],
        target: Union[int, str, Tensor, None] = None,
        additional_forward_args: Any = None,
        *legacy_args: Any,
        return_layer_maps: bool = False,
        **legacy_kwargs: Any,
    ) -> ALTIPlusResult:
        r"""ALTI+ contributions of every decoder position to the source tokens and the decoder inputs.

        The arguments are those of :meth:`attribute` (Captum's form). The blocks are
        decomposed as the forward pass runs (each one as soon as it has run, then dropped) and
        the rollouts are updated layer by layer, so the memory does not grow with depth
        (``docs/seq2seq.md``, "Memory and speed").

        Args:
            inputs: ``(src_ids (B, S), tgt_ids (B, T))``: source token ids and decoder input
                ids starting with the decoder start token (row i of the result predicts token
                i + 1).
            target: the explained decoder position of ``scores`` / ``target_scores``: None or
                ``"last"`` (default: the last real position), an int (k >= 0 counted from the
                first real position, k < 0 from the last) or a (B,) tensor of positions.
            additional_forward_args: ``(src_mask, tgt_mask)``, ``src_mask`` alone, or None:
                ``src_mask`` (B, S) 1 for real source tokens (any padding); ``tgt_mask`` (B, T)
                1 for real decoder positions (one contiguous block: left or right padding).
            return_layer_maps: keep the per-layer maps (encoder C_l, decoder C^self_l and
                C^cross_l) and the encoder rollout in the result (their memory grows with
                depth: L (B, S, S) and 2 L (B, T, .) maps).

        Returns:
            :class:`ALTIPlusResult`.

        The old form ``decompose(src_ids, tgt_ids, src_attention_mask=None,
        tgt_attention_mask=None, return_layer_maps=False, explained_position="last")`` still
        works, with a ``DeprecationWarning``.

        Examples::

            >>> res = alti.decompose((src_ids, tgt_ids), additional_forward_args=(src_mask, tgt_mask))
            >>> res.source_contributions.shape  # (B, T, S)
        """
        if isinstance(inputs, Tensor):
            src_ids, tgt_ids, src_mask, tgt_mask, return_layer_maps, position = _legacy_call(
                inputs, target, additional_forward_args, legacy_args, legacy_kwargs, return_layer_maps)
        else:
            if legacy_args or legacy_kwargs:
                extra = list(legacy_kwargs) or [f"{len(legacy_args)} more positional argument(s)"]
                raise TypeError(
                    f"decompose() got unexpected arguments {extra}: call decompose((src_ids, tgt_ids), target, "
                    "(src_mask, tgt_mask), return_layer_maps=...) (target: the explained decoder position)"
                )
            self.check_target(target, inputs)
            src_ids, tgt_ids = _split_inputs(inputs)
            src_mask, tgt_mask = _split_masks(additional_forward_args)
            position = "last" if target is None else target
        return self._decompose(src_ids, tgt_ids, src_mask, tgt_mask, bool(return_layer_maps), position)

    def _decompose(self, src_ids, tgt_ids, src_attention_mask, tgt_attention_mask, keep: bool,
                   explained_position) -> ALTIPlusResult:
        explained_position = check_explained_position(explained_position)
        src_ids, tgt_ids, src_mask, tgt_mask = self._prepare(src_ids, tgt_ids, src_attention_mask, tgt_attention_mask)
        v_src, v_tgt = src_mask.bool(), tgt_mask.bool()
        pos = explained_positions(explained_position, v_tgt)
        param = next(self.model.parameters())
        dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        conv = self.conventions
        stream = _Stream(self, v_src, v_tgt, keep, src_ids.device)
        with torch.no_grad(), recording_seq2seq(self.model, self.adapter, dtype, on_block=stream) as rec:
            stream.layers = {name: len(rec.stack_layers(name)) for name in BLOCKS}
            rec.base(  # the module holding encoder and decoder: no head (a classification head needs no run)
                input_ids=src_ids, attention_mask=src_mask, decoder_input_ids=tgt_ids,
                decoder_attention_mask=tgt_mask, use_cache=False,
            )
            rec.check_complete()
        with torch.no_grad():
            r_enc, r_src, r_tgt = stream.r_enc, stream.r_src * v_tgt[..., None], stream.r_tgt * v_tgt[..., None]
            share = r_src.sum(-1)
            rows = torch.arange(r_src.shape[0], device=r_src.device)
            per_block = {name: torch.stack(stream.errors[name], 1) for name in BLOCKS}  # (B, L)
            delta = torch.cat(list(per_block.values()), 1).amax(1)
        extras = {f"{name}_completeness_error": per_block[name].amax(0) for name in BLOCKS}
        maps = stream.maps
        result = ALTIPlusResult(
            method=self.get_name(),
            scores=r_src[rows, pos],
            attention_mask=src_mask,
            explained_position=pos,
            delta=delta,
            extras=extras,
            target_scores=r_tgt[rows, pos],
            target_attention_mask=tgt_mask,
            source_contributions=r_src,
            target_contributions=r_tgt,
            source_share=share,
            completeness_error=delta[torch.isfinite(delta)].amax() if bool(torch.isfinite(delta).any()) else delta.amax(),
            encoder_maps=torch.stack(maps["encoder_self"], 1) if keep else None,
            encoder_rollout=r_enc if keep else None,
            decoder_self_maps=torch.stack(maps["decoder_self"], 1) if keep else None,
            decoder_cross_maps=torch.stack(maps["decoder_cross"], 1) if keep else None,
            conventions=_describe(conv),
        )
        # an example whose forward pass held NaN or infinity: every per-example number NaN, with a warning
        bad = ~(torch.isfinite(r_src).flatten(1).all(1) & torch.isfinite(r_tgt).flatten(1).all(1) & torch.isfinite(delta))
        return mark_non_finite(result, ~bad)

    def attribution_and_delta(self, inputs, target, additional_forward_args):
        r"""((source scores (B, S), target scores (B, T)), delta (B,)): ``attribute``'s output.

        ``attribute(inputs, target=None, additional_forward_args=None,
        return_convergence_delta=False)`` takes what :meth:`decompose` takes: ``inputs`` =
        ``(src_ids, tgt_ids)``, ``target`` = the explained decoder position (None or
        ``"last"``: the last real position, which predicts the next token; an int, k >= 0
        counted from the first real position, k < 0 from the last; or a (B,) tensor of
        positions), ``additional_forward_args`` = ``(src_mask, tgt_mask)``, ``src_mask`` alone
        or None. The source and target scores sum to 1 per example (pads and positions after
        the explained one are 0); the delta is the largest completeness error of every
        block's parts (:attr:`ALTIPlusResult.delta`).
        """
        _split_inputs(inputs)  # attribute takes the pair only (decompose also the old form)
        res = self.decompose(inputs, target, additional_forward_args)
        return (res.scores, res.target_scores), res.delta


@dataclass
class GeneratedTokenExplanation:
    r"""ALTI+ of one generated sequence, token by token.

    Attributes:
        tokens: (n,) the generated token ids (the decoder start token left out).
        decoder_inputs: (n,) the decoder input ids t_0..t_{n-1} (t_0: the start token).
        source: (n, S_real) row k: the contributions of the real source tokens to the
            prediction of ``tokens[k]``.
        prefix: (n, n) row k: the contributions of the decoder inputs t_0..t_k (columns
            after k are 0) to the prediction of ``tokens[k]``.
        source_share: (n,) the source share of every prediction.
    """

    tokens: Tensor
    decoder_inputs: Tensor
    source: Tensor
    prefix: Tensor
    source_share: Tensor


def explain_generation(
    model: nn.Module,
    src_ids: Tensor,
    generated_ids: Tensor,
    src_attention_mask: Optional[Tensor] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    conventions: Union[str, ALTIPlusConventions] = "default",
) -> List[GeneratedTokenExplanation]:
    r"""Explain a ``generate()`` output of an encoder-decoder token by token with ALTI+.

    The generated sequences (``model.generate(src_ids, ...)``: the decoder start token, then
    the generated tokens, right-padded after the end-of-sequence token) are fed back as
    decoder inputs in one teacher-forced pass: the decoder state that predicted a token is
    the same with or without the cache. Token k (k >= 1) of a sequence is explained by row
    k - 1. A sequence ends at its first end-of-sequence token after the start token (kept) or
    at the end of the tensor.

    Args:
        model: the encoder-decoder that generated.
        src_ids: (B, S) the source ids given to ``generate``.
        generated_ids: (B, 1 + n) what ``generate`` returned (greedy or beam search; one
            sequence per source row: with ``num_return_sequences > 1`` repeat the source rows).
        src_attention_mask: (B, S) the source mask given to ``generate``, or None.
        eos_token_id: the end-of-sequence id(s); None: from the model's generation config.
        pad_token_id: unused positions after the end; None: from the generation config.
        conventions: see :class:`ALTIPlusAttribution`.

    Returns:
        one :class:`GeneratedTokenExplanation` per sequence.

    Examples::

        >>> gen = model.generate(src_ids, attention_mask=src_mask, max_new_tokens=20)
        >>> steps = explain_generation(model, src_ids, gen, src_mask)
        >>> steps[0].source_share  # how much each generated token takes from the source
    """
    if not isinstance(generated_ids, Tensor) or generated_ids.dim() != 2 or generated_ids.shape[1] < 2:
        raise ValueError("generated_ids must be a (B, 1 + n) tensor from generate(), with at least one generated token")
    if isinstance(src_ids, Tensor) and src_ids.dim() == 2 and src_ids.shape[0] != generated_ids.shape[0]:
        raise ValueError(
            f"src_ids has {src_ids.shape[0]} rows but generated_ids {generated_ids.shape[0]}: give one source row per "
            "generated sequence (repeat_interleave the sources for num_return_sequences > 1)"
        )
    gen_cfg = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gen_cfg, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    eos = [] if eos_token_id is None else ([int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id])
    ids = generated_ids.long()
    b, t = ids.shape
    is_eos = torch.zeros_like(ids, dtype=torch.bool)
    for e in eos:
        is_eos |= ids == e
    is_eos[:, 0] = False
    # positions after the first end-of-sequence token (position 0 is the start token) are unused
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    length = (~after).sum(-1)  # decoder inputs kept per row: start token .. first EOS (inclusive)
    # Row k - 1 explains token k, so the last token needs row length - 2: the decoder inputs are ids[:, :-1].
    tgt = ids[:, :-1]
    tgt_mask = (~after[:, 1:]).long()  # decoder input k is used when token k + 1 exists
    if pad_token_id is None:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None)
    tgt = tgt.clone()
    if pad_token_id is not None:
        tgt[tgt_mask == 0] = int(pad_token_id)
    alti = ALTIPlusAttribution(model, conventions=conventions)
    res = alti.decompose((src_ids, tgt), additional_forward_args=(src_attention_mask, tgt_mask))
    out = []
    for i in range(b):
        n = int(length[i]) - 1
        src_idx = res.attention_mask[i].bool().nonzero().squeeze(-1)
        out.append(GeneratedTokenExplanation(
            tokens=ids[i, 1 : n + 1],
            decoder_inputs=ids[i, :n],
            source=res.source_contributions[i, :n].index_select(-1, src_idx),
            prefix=res.target_contributions[i, :n, :n],
            source_share=res.source_share[i, :n],
        ))
    return out
