r"""Feed-forward-inclusive norm decomposition of post-LN encoders (Kobayashi et al. 2023)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
from captum_normattr.decompose.decoder import pre_ln_component_scope_maps
from captum_normattr.decompose.feed_forward import SCOPES, component_scope_maps
from captum_normattr.decompose.records import LayerTensors


class FFIntegratedDecomposition(LayerDecompositionAttribution):
    r"""Token attributions from whole-layer norm maps, the feed-forward block included.

    The FF block is decomposed by integrated gradients of its elementwise activation with a
    zero baseline, in closed form (exact completeness) or by a midpoint Riemann sum. The
    per-layer map is chosen by ``scope``: ``ATB`` (LN1-output parts, = N_RESLN), ``FF``
    (FF-output parts), ``RES2`` (FF parts + residual) or ``LN2`` (the whole layer; default).
    The maps do not depend on ``target`` (class-agnostic).

    Pre-LN decoders (GPT-2, Llama, Mistral, Qwen2): ``ATB`` = |h_{i<-j}| (attention block with
    residual), ``LN2`` = LN2-output parts (the FF input), ``FF`` = FF-output parts, ``RES2`` =
    the whole layer output h + FF (the default for them). A gated FF (SwiGLU) is integrated by
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
        chunk_rows: query rows per chunk when building explicit parts.

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a gripping, funny film"], return_tensors="pt")
        >>> ffd = FFIntegratedDecomposition(model)
        >>> scores, delta = ffd.attribute(batch["input_ids"], additional_forward_args=(batch["attention_mask"],),
        ...                               return_convergence_delta=True)
    """

    def __init__(
        self,
        model: nn.Module,
        scope: Optional[str] = None,
        method: str = "closed_form",
        steps: int = 50,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
        chunk_rows: Optional[int] = None,
        nodes: Optional[int] = None,
    ) -> None:
        if scope is not None and scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose from {SCOPES}")
        if method not in ("closed_form", "riemann"):
            raise ValueError(f"method must be 'closed_form' or 'riemann', got {method!r}")
        super().__init__(model, explained_position, rollout)
        if scope is None:
            scope = "RES2" if self.adapter.pre_ln else "LN2"
        self.scope, self.method, self.steps, self.chunk_rows, self.nodes = scope, method, steps, chunk_rows, nodes

    def _layer_maps(self, layers: List[LayerTensors], valid: Tensor) -> Tuple[Tensor, Optional[Tensor], Dict[str, Tensor]]:
        per_scope: Dict[str, list] = {s: [] for s in SCOPES}
        ff_err, layer_err, per_ex = [], [], []
        for layer in layers:
            if layer.pre_ln:
                maps, err = pre_ln_component_scope_maps(
                    layer, valid, self.chunk_rows, self.method, self.steps, self.nodes, self.adapter.causal
                )
            else:
                maps, err = component_scope_maps(layer, valid, self.chunk_rows, self.method, self.steps)
            for s in SCOPES:
                per_scope[s].append(maps[s])
            ff_err.append(err["ff"])
            layer_err.append(err["layer"])
            per_ex.append(err["ff_per_example"])
        extras = {
            "completeness_error": torch.stack(ff_err),
            "layer_completeness_error": torch.stack(layer_err),
            "example_completeness_error": torch.stack(per_ex, 1).amax(1),
        }
        for s in SCOPES:
            extras[f"scope_{s}"] = torch.stack(per_scope[s], 1)
        return extras[f"scope_{self.scope}"], None, extras

    @log_usage()
    def attribute(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
        return_convergence_delta: bool = False,
    ) -> Union[Tensor, Tuple[Tensor], Tuple[Union[Tensor, Tuple[Tensor]], Tensor]]:
        r"""Token attributions: the explained row of the rolled-out maps.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple of them.
            target: accepted for Captum compatibility and ignored (the maps are class-agnostic).
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).
            return_convergence_delta: also return delta (B,), the per-example largest
                |sum of FF parts + bias part - real FF output| over layers and tokens.

        Returns:
            (B, T) scores (a 1-tuple for tuple inputs); pad positions are exactly 0; with
            ``return_convergence_delta``, (scores, delta).
        """
        res = self.decompose(inputs, additional_forward_args)
        scores = (res.scores,) if isinstance(inputs, tuple) else res.scores
        if return_convergence_delta:
            return scores, res.extras["example_completeness_error"]
        return scores

    def has_convergence_delta(self) -> bool:
        return True

    def get_name(self) -> str:
        return f"FF decomposition ({self.scope})"
