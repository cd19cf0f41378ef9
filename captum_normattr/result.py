r"""The typed result object returned by ``decompose``."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional

import torch
from torch import Tensor


@dataclass
class DecompositionResult:
    r"""Layer maps, their rollout and the token attributions of one batch.

    Attributes:
        method: readable method name, e.g. ``"GlobEnc (N_ENC)"`` or ``"ALTI"``.
        layer_maps: (B, L, T, T); entry [b, l, i, j] = how much token j contributes to
            token i in layer l. Pad rows and columns are exactly 0.
        rollout: (B, T, T), the product of the layer maps (``rollout_convention``).
        scores: (B, T), row ``explained_position`` of ``rollout``: the attribution of
            every input token. Pads are exactly 0.
        attention_mask: (B, T), 1 for real tokens.
        explained_position: (B,) long, the explained row of every example.
        rollout_convention: ``"raw"`` or ``"row_normalized"``.
        mixing_ratio: (B, L, T) context-mixing ratio per layer and token, or None.
        extras: method-specific tensors, e.g. ``"completeness_error"`` (L,): the largest
            absolute error of parts + bias parts against the model's real tensors.
    """

    method: str
    layer_maps: Tensor
    rollout: Tensor
    scores: Tensor
    attention_mask: Tensor
    explained_position: Tensor
    rollout_convention: str
    mixing_ratio: Optional[Tensor] = None
    extras: Dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.layer_maps.shape[1]

    def to(self, device) -> "DecompositionResult":
        r"""A copy with every tensor moved to ``device``."""
        mv = lambda t: t.to(device) if isinstance(t, Tensor) else t
        return replace(
            self,
            layer_maps=mv(self.layer_maps),
            rollout=mv(self.rollout),
            scores=mv(self.scores),
            attention_mask=mv(self.attention_mask),
            explained_position=mv(self.explained_position),
            mixing_ratio=mv(self.mixing_ratio),
            extras={k: mv(v) for k, v in self.extras.items()},
        )

    def example(self, index: int) -> Dict[str, Tensor]:
        r"""One example's tensors with the pad positions removed.

        Args:
            index: the example in the batch.

        Returns:
            dict with ``layer_maps`` (L, n, n), ``rollout`` (n, n), ``scores`` (n,),
            ``mixing_ratio`` (L, n) or None, and ``explained_position`` (int), where n is
            the number of real tokens.
        """
        keep = self.attention_mask[index].bool()
        idx = keep.nonzero().squeeze(-1)
        pos = int(self.explained_position[index])
        return {
            "layer_maps": self.layer_maps[index][:, idx][:, :, idx],
            "rollout": self.rollout[index][idx][:, idx],
            "scores": self.scores[index][idx],
            "mixing_ratio": None if self.mixing_ratio is None else self.mixing_ratio[index][:, idx],
            "explained_position": int((idx < pos).sum()),
        }
