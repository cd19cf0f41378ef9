r"""Feed-forward-inclusive decomposition of post-LN encoders (Kobayashi et al. 2023): GlobEnc+FF, ALTI+FF."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution, format_output
from captum_normattr.decompose.decoder import pre_ln_component_scope_maps
from captum_normattr.decompose.feed_forward import CONTRIBUTIONS, IG_METHODS, LN_SCOPES, SCOPES, component_scope_maps
from captum_normattr.decompose.records import LayerTensors


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
    GlobEnc and ALTI, and do not depend on ``target`` (class-agnostic).

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
        chunk_rows: query rows per chunk when building explicit parts (overrides
            ``memory_budget_mb``).
        contribution: ``"norm"`` (default) or ``"alti"``.
        memory_budget_mb: memory for one chunk's explicit parts (default 128: MiniLM at
            512 tokens decomposes in a few hundred MB).
        ignore_low_gamma: share of LayerNorm dimensions with the lowest gamma ignored in the
            norms of the LN-output scopes ATB and LN2 (Kobayashi et al. 2023 use 0.01);
            0 (default) ignores none; ``"norm"`` contribution only.

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a gripping, funny film"], return_tensors="pt")
        >>> ffd = FFIntegratedDecomposition(model)                        # GlobEnc+FF
        >>> scores, delta = ffd.attribute(batch["input_ids"], additional_forward_args=(batch["attention_mask"],),
        ...                               return_convergence_delta=True)
        >>> alti_ff = FFIntegratedDecomposition(model, contribution="alti")  # ALTI+FF
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
        contribution: str = "norm",
        memory_budget_mb: float = 128.0,
        ignore_low_gamma: float = 0.0,
        nodes: Optional[int] = None,
    ) -> None:
        if scope is not None and scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose from {SCOPES}")
        if method not in IG_METHODS:
            raise ValueError(f"method must be one of {IG_METHODS}, got {method!r}")
        if contribution not in CONTRIBUTIONS:
            raise ValueError(f"unknown contribution {contribution!r}; choose from {CONTRIBUTIONS}")
        if memory_budget_mb <= 0:
            raise ValueError("memory_budget_mb must be positive")
        if not 0.0 <= ignore_low_gamma < 1.0:
            raise ValueError(f"ignore_low_gamma must be in [0, 1), got {ignore_low_gamma}")
        if ignore_low_gamma and contribution != "norm":
            raise ValueError("ignore_low_gamma acts on the norms of LayerNorm-output parts: use contribution='norm'")
        super().__init__(model, explained_position, rollout)
        if self.adapter.pre_ln and (contribution != "norm" or ignore_low_gamma):
            raise ValueError(
                f"{self.adapter.family} is a pre-LN decoder: FFIntegratedDecomposition supports contribution='norm' "
                "without ignore_low_gamma there (ALTI+FF and the LayerNorm-gamma ablation are post-LN analyses)"
            )
        if scope is None:
            scope = "RES2" if self.adapter.pre_ln else "LN2"
        self.scope, self.method, self.steps, self.chunk_rows, self.nodes = scope, method, steps, chunk_rows, nodes
        self.contribution, self.memory_budget_mb, self.ignore_low_gamma = contribution, memory_budget_mb, ignore_low_gamma

    def _layer_maps(self, layers: List[LayerTensors], valid: Tensor) -> Tuple[Tensor, Optional[Tensor], Dict[str, Tensor]]:
        per_map: Dict[str, list] = {}
        ff_err, layer_err, per_ex = [], [], []
        for layer in layers:
            if layer.pre_ln:
                maps, err = pre_ln_component_scope_maps(
                    layer, valid, self.chunk_rows, self.method, self.steps, self.nodes, self.adapter.causal
                )
            else:
                maps, err = component_scope_maps(layer, valid, self.chunk_rows, self.method, self.steps,
                                                 self.contribution, self.ignore_low_gamma, self.memory_budget_mb)
            for name, m in maps.items():
                per_map.setdefault(name, []).append(m)
            ff_err.append(err["ff"])
            layer_err.append(err["layer"])
            per_ex.append(torch.maximum(err["ff_per_example"], err["layer_per_example"]))
        extras = {
            "completeness_error": torch.stack(ff_err),
            "layer_completeness_error": torch.stack(layer_err),
            "example_completeness_error": torch.stack(per_ex, 1).amax(1),
        }
        for name, ms in per_map.items():
            extras[f"scope_{name}"] = torch.stack(ms, 1)
        key = f"scope_{self.scope}_ablated" if self.ignore_low_gamma and self.scope in LN_SCOPES else f"scope_{self.scope}"
        return extras[key], None, extras

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
            return_convergence_delta: also return delta (B,), the completeness error of the
                decomposition: per example, the largest |parts + bias part - real tensor| over
                layers, valid tokens and features, for the FF output and the layer output.

        Returns:
            (B, T) scores (a 1-tuple for tuple inputs); pad positions are exactly 0; with
            ``return_convergence_delta``, (scores, delta).
        """
        res = self.decompose(inputs, additional_forward_args)
        return format_output(inputs, res.scores, res.extras["example_completeness_error"], return_convergence_delta)

    def has_convergence_delta(self) -> bool:
        return True

    def get_name(self) -> str:
        whole_layer = "RES2" if self.adapter.pre_ln else "LN2"
        if self.scope == whole_layer:
            name = "GlobEnc+FF" if self.contribution == "norm" else "ALTI+FF"
        elif self.contribution == "norm":
            name = f"FF decomposition ({self.scope})"
        else:
            name = f"ALTI, FF decomposition ({self.scope})"
        if self.ignore_low_gamma and self.scope in LN_SCOPES:
            name += f" [lowest {self.ignore_low_gamma:.0%} LN gamma ignored]"
        return name
