r"""Feed-forward-inclusive decomposition (Kobayashi et al. 2023): GlobEnc+FF, ALTI+FF, post-LN and pre-LN."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
from captum_normattr.decompose.primitives.feed_forward import CONTRIBUTIONS, IG_METHODS, LN_SCOPES, SCOPES
from captum_normattr.decompose.kinds.registry import FFOptions
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.engine import LayerContribution
from captum_normattr.options import check_fraction, check_memory_budget, check_optional_positive_int, check_positive_int

__all__ = ["FFIntegratedDecomposition"]


class FFIntegratedDecomposition(LayerDecompositionAttribution):
    r"""Token attributions from whole-layer maps, the feed-forward block included.

    The FF block is decomposed by integrated gradients of its elementwise activation with a
    zero baseline, in closed form (exact completeness) or by a midpoint Riemann sum. The
    per-layer map is chosen by ``scope``: ``ATB`` (LN1-output parts), ``FF`` (FF-output
    parts), ``RES2`` (FF parts + residual) or ``LN2`` (the whole layer; default), and by
    ``contribution``: ``"norm"`` (the L2 norm of each part; with ``LN2`` this is
    **GlobEnc+FF**, and ``ATB`` is the N_RESLN map) or ``"alti"`` (ALTI's L1 contribution of
    each part against the real output of the scope, rows normalised; with ``LN2`` this is
    **ALTI+FF**, and ``ATB`` is plain ALTI). The maps are rolled out over layers like
    GlobEnc and ALTI, and do not depend on a target (class-agnostic: ``decompose`` and
    ``attribute`` take ``target=None`` only). The convergence delta is, per example, the largest
    ``|parts + bias part - real tensor|`` over layers, real tokens and features, for the FF output
    and the layer output.

    Pre-LN decoders (GPT-2, Llama, Mistral, Qwen2): ``ATB`` = |h_{i<-j}| (attention block with
    residual), ``LN2`` = LN2-output parts (the FF input), ``FF`` = FF-output parts, ``RES2`` =
    the whole layer output h + FF (the default for them; with ``contribution="alti"`` this is
    ALTI+FF, every scope scored against its real output). A gated FF (SwiGLU) is integrated by
    Gauss-Legendre quadrature with ``nodes`` nodes; its completeness error is the delta.

    Args:
        model: a supported Hugging Face model (post-LN encoder or pre-LN decoder).
        scope: one of ``"LN2"``, ``"RES2"``, ``"FF"``, ``"ATB"``; None (default): ``"LN2"`` for
            post-LN encoders, ``"RES2"`` for pre-LN decoders (the whole layer in both cases).
        method: ``"closed_form"`` (default) or ``"riemann"`` (elementwise FF).
        steps: Riemann steps (ignored for the closed form).
        nodes: Gauss-Legendre nodes for a gated FF (None: the default, 48).
        explained_position: explained row (None: 0 = [CLS] for encoders, ``"last"`` for decoders).
        rollout: ``"raw"`` (default) or ``"row_normalized"``.
        chunk_rows: query rows per chunk when building explicit parts (overrides
            ``memory_budget_mb``).
        contribution: ``"norm"`` (default) or ``"alti"``.
        memory_budget_mb: memory for one chunk's explicit parts (default 128: MiniLM at
            512 tokens decomposes in a few hundred MB).
        ignore_low_gamma: share of LayerNorm dimensions with the lowest gamma ignored in the
            norms of the LN-output scopes ATB and LN2 (Kobayashi et al. 2023 use 0.01);
            0 (default) ignores none; ``"norm"`` contribution and post-LN models only.
        strict: raise instead of warning when the model's real tensors disagree with what
            the decomposition assumes (see :class:`~captum_normattr.models.guard.ConsistencyGuard`).

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a gripping, funny film"], return_tensors="pt")
        >>> ffd = FFIntegratedDecomposition(model)                        # GlobEnc+FF
        >>> scores, delta = ffd.attribute(batch["input_ids"], additional_forward_args=(batch["attention_mask"],),
        ...                               return_convergence_delta=True)
        >>> alti_ff = FFIntegratedDecomposition(model, contribution="alti")  # ALTI+FF
    """

    method_name = "GlobEnc+FF"

    def __init__(
        self,
        model: nn.Module,
        scope: Optional[str] = None,
        method: str = "closed_form",
        steps: int = 50,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
        chunk_rows: Optional[int] = None,
        contribution: str = "norm",
        memory_budget_mb: float = 128.0,
        ignore_low_gamma: float = 0.0,
        nodes: Optional[int] = None,
        strict: bool = False,
    ) -> None:
        if scope is not None and scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose from {SCOPES}")
        if method not in IG_METHODS:
            raise ValueError(f"method must be one of {IG_METHODS}, got {method!r}")
        if contribution not in CONTRIBUTIONS:
            raise ValueError(f"unknown contribution {contribution!r}; choose from {CONTRIBUTIONS}")
        memory_budget_mb = check_memory_budget(memory_budget_mb)
        steps = check_positive_int("steps", steps)
        nodes = check_optional_positive_int("nodes", nodes)
        chunk_rows = check_optional_positive_int("chunk_rows", chunk_rows)
        ignore_low_gamma = check_fraction("ignore_low_gamma", ignore_low_gamma)
        if ignore_low_gamma and contribution != "norm":
            raise ValueError("ignore_low_gamma acts on the norms of LayerNorm-output parts: use contribution='norm'")
        super().__init__(model, explained_position, rollout, strict=strict)
        self.options = FFOptions(method, steps, nodes, contribution, ignore_low_gamma, chunk_rows, memory_budget_mb)
        self.kind.check_ff_options(self.options, self.adapter.family)
        if scope is None:
            scope = self.kind.whole_layer_scope
        self.scope, self.method, self.steps, self.chunk_rows, self.nodes = scope, method, steps, chunk_rows, nodes
        self.contribution, self.memory_budget_mb, self.ignore_low_gamma = contribution, memory_budget_mb, ignore_low_gamma

    kind_method = "ff"
    guards_completeness = False  # the FF completeness is the delta (and a Riemann sum's error is expected)

    def _map_key(self) -> str:
        return f"{self.scope}_ablated" if self.ignore_low_gamma and self.scope in LN_SCOPES else self.scope

    def layer_contribution(self, layer: LayerTensors, valid: Tensor, keep_maps: bool) -> LayerContribution:
        maps, err = self.kind.scope_maps(layer, valid, self.options)
        return LayerContribution(
            map=maps[self._map_key()],
            errors={
                "completeness_error": err["ff"],
                "layer_completeness_error": err["layer"],
                "example_completeness_error": torch.maximum(err["ff_per_example"], err["layer_per_example"]),
            },
            maps={f"scope_{name}": m for name, m in maps.items()} if keep_maps else {},
        )

    def get_name(self) -> str:
        if self.scope == self.kind.whole_layer_scope:
            name = "GlobEnc+FF" if self.contribution == "norm" else "ALTI+FF"
        elif self.contribution == "norm":
            name = f"FF decomposition ({self.scope})"
        else:
            name = f"ALTI, FF decomposition ({self.scope})"
        if self.ignore_low_gamma and self.scope in LN_SCOPES:
            name += f" [lowest {self.ignore_low_gamma:.0%} LN gamma ignored]"
        return name
