r"""The "explained output" of the signed methods (ALTI-Logit, DecompX): which logit, along which direction.

Two kinds, each parsing ``target`` once for every method that explains it:

- :class:`NextTokenLogit`: the next-token logit of a decoder at the explained position,
  ``<FinalNorm(x_L,i), u> + u_bias`` with u = W_U[target] (or W_U[target] - W_U[foil]) from
  the LM head (or an explicit unembedding matrix). ``target``: a token id, per-example ids,
  or None for the token the model predicts; the contrast is the separate ``foil`` (same forms).
- :class:`ClassLogit`: a class logit of a sequence classifier through its classification
  head, ``act(h_p W_d + b_d) W_c + b_c`` on the last layer's output at the head's token p.
  ``target``: a class index, per-example indices, or None for the predicted class.
- :class:`ImageClassLogit`: a class logit of a Vision Transformer classifier, linear in the
  final-norm output of the rows its head reads ([CLS]; [CLS] and distillation token;
  [CLS] and the mean of the patches).

Then the guard every call runs against the model's own logits (:func:`check_explained_logit`) and
the one check of a model for an additive next-token logit (:func:`check_additive_next_token_logit`).
The module is over 700 lines because the three explained outputs share the target parsing
(:func:`as_token_ids`) and the guard's tolerances; apart, each would import the others.
"""
from __future__ import annotations

import copy
import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from captum_normattr.arch.registry import supported_causal_families
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.primitives.guards import rebuild_norm
from captum_normattr.arch.spec import ArchitectureSpec
from captum_normattr.models.adapters import base_model, get_path, language_config, unwrap_model
from captum_normattr.models.heads import HeadParams, ResolvedHead, find_classifier_head, head_params
from captum_normattr.models.weights import weight_and_bias


VOCAB_BLOCK = 8192  # unembedding rows cast at a time for the predicted-token logits
#: the most logits (B x kept positions x V) the output guard asks the model for (2**26: 256 MB in float32)
GUARD_LOGIT_ELEMENTS = 2 ** 26


#: what a tuple target meant before version 3 for the logit classes, and what to write now
CONTRAST_MOVED = (
    "target={target!r}: a tuple target no longer means (target, foil). Pass the contrast explicitly: "
    "target=<token id(s)>, foil=<token id(s)> (e.g. attribute(ids, target=7, foil=11); per example: lists or (B,) "
    "tensors). In Captum a tuple target indexes the output's dimensions for every example, which this method does not "
    "take; a list or a (B,) tensor gives one id per example."
)


def _plain_int(x: Any) -> Optional[int]:
    r"""``x`` as an int if it is a Python or numpy integer (never a bool), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if isinstance(x, np.integer):
        return int(x)
    return None


def as_token_ids(x: Any, b: int, name: str, device) -> Tensor:
    r"""(B,) long ids (or class indices) from one id for every example or one id per example.

    Accepted: a Python or numpy integer, a 0-d or (1,) integer tensor / numpy array (the same
    id for every example), a list of B integers, a (B,) integer tensor or numpy array.

    Raises:
        TypeError: floats, bools, tuples and other types (the message says what to pass).
        ValueError: a list or tensor whose length is not B.
    """
    v = _plain_int(x)
    if v is not None:
        return torch.full((b,), v, dtype=torch.long, device=device)
    if isinstance(x, tuple):
        raise TypeError(CONTRAST_MOVED.format(target=x) if name == "target" else
                        f"{name} must be an id, a list of ids or a (B,) tensor, not a tuple ({x!r})")
    if type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape"):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer ids; got a numpy array of dtype {x.dtype}")
        x = torch.as_tensor(x)
    if isinstance(x, list):
        vals = [_plain_int(v) for v in x]
        if any(v is None for v in vals):
            raise TypeError(f"{name} list must hold integers (one per example); got {x!r}")
        if len(vals) != b:
            raise ValueError(f"{name} list must have one id per example ({b}); got {len(vals)}")
        x = torch.tensor(vals, dtype=torch.long)
    if isinstance(x, Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer ids; got a {x.dtype} tensor")
        if x.dim() == 0 or tuple(x.shape) == (1,):
            return x.reshape(1).expand(b).to(device=device, dtype=torch.long)
        if tuple(x.shape) == (b,):
            return x.to(device=device, dtype=torch.long)
        hint = " (a (B, 2) tensor of (target, foil) rows is now target=t[:, 0], foil=t[:, 1])" if (
            x.dim() == 2 and x.shape[-1] == 2) else ""
        raise ValueError(f"{name} must be one id or a ({b},) tensor of ids (one per example); got shape "
                         f"{tuple(x.shape)}{hint}")
    raise TypeError(
        f"{name} must be an integer id (int or numpy integer), a list of ints or a ({b},) integer tensor; "
        f"got {type(x).__name__}"
    )


@dataclass
class LogitDirection:
    r"""One explained logit per example.

    Attributes:
        direction: (B, D) u, the unembedding row (or row difference).
        bias: (B,) the LM-head bias along u (0 if none).
        target: (B,) long target ids; foil: (B,) long foil ids or None.
    """

    direction: Tensor
    bias: Tensor
    target: Tensor
    foil: Optional[Tensor]


def logit_scale(model: nn.Module, adapter: ArchitectureSpec) -> float:
    r"""The factor the model applies to its LM head's output: ``logit_multiplier / logit_divisor``.

    Cohere multiplies its logits by ``config.logit_scale`` (the description's
    :attr:`~captum_normattr.arch.spec.Head.logit_multiplier`), Granite divides them by
    ``config.logits_scaling`` (:attr:`~captum_normattr.arch.spec.Head.logit_divisor`). A scalar
    is linear: it is folded into the explained direction and bias, so that the explained logit
    is the model's own output logit.

    Args:
        model: the model (its ``config`` holds the attributes the description names).
        adapter: its description.

    Returns:
        The factor (1.0 when the description names neither).

    Raises:
        ValueError: a named attribute that the config lacks, that is not a number, or a zero divisor.
    """
    return _config_logit_scale(getattr(unwrap_model(model), "config", None), adapter)


def _config_logit_scale(config: Any, adapter: ArchitectureSpec) -> float:
    r""":func:`logit_scale` from the model's config."""
    scale = 1.0
    for attribute, divides in ((adapter.head.logit_multiplier, False), (adapter.head.logit_divisor, True)):
        if attribute is None:
            continue
        value = getattr(config, attribute, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (divides and value == 0):
            raise ValueError(
                f"the {adapter.family} description scales the logits by config.{attribute}, but the model's config has "
                f"{'no such attribute' if value is None else repr(value)}; fix the description's head"
            )
        scale = scale / float(value) if divides else scale * float(value)
    return scale


def explains_next_token(model: nn.Module, adapter: ArchitectureSpec) -> bool:
    r"""Whether a logit-explaining method explains a next-token logit of ``model`` (else a class logit).

    Chosen from the model's head, not from its layer kind: a sequence classifier (a
    ``*ForSequenceClassification``, whatever its layers) explains class logits; a model
    with the LM head its description names, or a bare causal model (with an explicit
    unembedding), explains next-token logits.
    """
    model = unwrap_model(model)
    if type(model).__name__.endswith(("ForSequenceClassification", "ForImageClassification")):
        return False
    if adapter.lm_head is not None:
        try:
            get_path(model, adapter.lm_head)
            return True
        except AttributeError:
            pass
    return bool(adapter.causal)


class NextTokenLogit:
    r"""The next-token logit of a decoder (its LM head, or an explicit unembedding).

    Args:
        model: a decoder with an LM head (``GPT2LMHeadModel``, ``*ForCausalLM``), or a bare
            ``*Model`` together with ``unembedding``.
        adapter: its adapter.
        unembedding: optional (V, D) unembedding matrix (rows = tokens).

    The model's own logit scaling (:func:`logit_scale`: Granite's ``logits_scaling``, Cohere's
    ``logit_scale``) is folded into the LM head's rows and bias, and so is a linear projection
    between the final norm and the LM head (``Head.projection``: OPT's ``project_out``), so the
    explained logit is the one the model outputs; an explicit ``unembedding`` is used as given.

    Raises:
        ValueError: for a model without an LM head and no ``unembedding``.
    """

    def __init__(self, model: nn.Module, adapter: ArchitectureSpec, unembedding: Optional[Tensor] = None) -> None:
        model = unwrap_model(model)
        d = language_config(model).hidden_size
        if unembedding is not None:
            if not isinstance(unembedding, Tensor) or unembedding.dim() != 2 or unembedding.shape[1] != d:
                raise ValueError(f"unembedding must be a (vocab, {d}) tensor")
            self._weights = (unembedding, None)
            self._head = None
            self.softcap = None  # an explicit unembedding: the explained logit is u . final-norm output
            self.scale = 1.0
            return
        head = None
        if adapter.lm_head is not None:
            try:
                head = get_path(model, adapter.lm_head)
            except AttributeError:
                head = None
        if head is None:
            raise ValueError(
                f"{type(model).__name__} has no LM head: pass a causal LM of a supported decoder family "
                f"({supported_causal_families()}; GPT2LMHeadModel, *ForCausalLM) or an explicit "
                f"unembedding=(vocab, {d}) matrix"
            )
        self._head, self._weights = head, None
        self._projection = None
        path = getattr(adapter.head, "projection", None)
        if path is not None:  # a linear map between the final norm and the LM head (OPT's project_out): folded in
            try:
                self._projection = get_path(base_model(model), path)
            except AttributeError:
                self._projection = None
        self.softcap = _config_softcap(language_config(model), adapter)  # (:func:`final_softcap`)
        #: the model's logit scaling (:func:`logit_scale`), folded into every direction and logit
        self.scale = _config_logit_scale(language_config(model), adapter)

    @property
    def weight(self) -> Tensor:
        r"""(V, D) the effective unembedding (nn.Linear weight times the logit scale), read where it lives (also
        from an accelerate hook)."""
        w = self._head_weights()[0]
        return w if self.scale == 1.0 else w.detach() * self.scale

    @property
    def weight_bias(self) -> Optional[Tensor]:
        r"""(V,) the LM head's bias times the logit scale, or None."""
        b = self._head_weights()[1]
        return b if b is None or self.scale == 1.0 else b.detach() * self.scale

    def _head_weights(self):
        if self._head is None:
            return self._weights
        w, b = weight_and_bias(self._head, "lm_head")  # read at use: an offloaded head is on meta until then
        if self._projection is not None:  # logits = (x P^T + c) W^T + b: the unembedding W P (V, D), bias b + W c
            p, p_bias = weight_and_bias(self._projection, "projection")
            key = (w.data_ptr(), w._version, p.data_ptr(), p._version, None if p_bias is None else p_bias._version)
            cached = getattr(self, "_folded", None)
            if cached is None or cached[0] != key:  # one product per weights, not one per use
                w2 = w.detach() @ p.detach().to(w.dtype)
                b2 = b if p_bias is None else (p_bias.detach().to(w.dtype) @ w.detach().T + (0 if b is None else b))
                self._folded = cached = (key, w2, b2)
            w, b = cached[1], cached[2]
        return w, b

    @property
    def vocab_size(self) -> int:
        return int((self._head.weight if self._head is not None else self._weights[0]).shape[0])  # meta has shapes

    @property
    def from_model_head(self) -> bool:
        r"""True when the explained logit is the model's own (its LM head), False for an explicit ``unembedding``."""
        return self._head is not None

    def real_logit(self, model_logits: Tensor, kept: Optional[Tensor], position: Tensor, out: LogitDirection) -> Tensor:
        r"""(B,) the explained logit (difference) read from the model's own output logits, in float64.

        Args:
            model_logits: the model's ``logits``: (B, K, V) at the positions ``kept`` (K,)
                (``logits_to_keep``), or (B, T, V) when ``kept`` is None.
            kept: sorted positions the logits were kept at, or None.
            position: (B,) explained positions.
            out: the resolved direction (its target and foil ids).
        """
        b = position.shape[0]
        ar = torch.arange(b, device=model_logits.device)
        idx = position.to(model_logits.device)
        if kept is not None:
            idx = torch.searchsorted(kept.to(model_logits.device), idx)
        rows = model_logits.detach()[ar, idx]  # (B, V)
        real = rows[ar, out.target.to(rows.device)].to(torch.float64)
        if out.foil is not None:
            real = real - rows[ar, out.foil.to(rows.device)].to(torch.float64)
        return real

    def guarded_forward(self, model: nn.Module, prepared: Any, position: Tensor):
        r"""How to run the recorded forward so that the model's own logits come back for the guard.

        Args:
            model: the (unwrapped) causal LM.
            prepared: the validated inputs.
            position: (B,) explained positions.

        Returns:
            ``(inputs, top_model, kept)``: the inputs to run (a copy asking for
            ``logits_to_keep=kept`` where the model takes it, so the LM head runs on the
            explained rows only), whether to run the whole model, and the kept positions
            (None: all). Without an LM head of the model (``unembedding=``) there is no
            model logit to compare: ``(prepared, False, None)``.
        """
        if not self.from_model_head:
            return prepared, False, None
        if accepts_logits_to_keep(model):
            kept = torch.unique(position)
            if position.shape[0] * kept.numel() * self.vocab_size > GUARD_LOGIT_ELEMENTS:
                # many distinct positions (right padding) and a large vocabulary: the logits at every kept row
                # of every example would be (B, K, V); check the examples at the most common position only
                kept = position.mode().values.reshape(1)
            return with_forward_kwargs(prepared, logits_to_keep=kept), True, kept
        return prepared, True, None

    def check_against_model(self, model_out: Any, kept: Optional[Tensor], position: Tensor, out: LogitDirection,
                            final_out: Tensor, rebuilt: Tensor, strict: Optional[bool] = None) -> None:
        r"""Guard: the explained logit (``rebuilt`` from the final-norm output) is the model's own output logit.

        ``model_out``: the model's forward output (None: nothing to compare, e.g. ``unembedding=``).
        See :func:`check_explained_logit`.
        """
        logits = getattr(model_out, "logits", None)
        if logits is None and isinstance(model_out, tuple) and model_out and isinstance(model_out[0], Tensor):
            logits = model_out[0]  # return_dict=False
        if logits is None:
            return
        examples = None
        if kept is not None:
            rows = torch.isin(position, kept.to(position.device))
            examples = rows.nonzero().flatten()
            if not bool(rows.all()):  # only the examples at the kept positions (see guarded_forward)
                out = LogitDirection(out.direction[rows], out.bias[rows], out.target[rows],
                                     None if out.foil is None else out.foil[rows])
                logits, position = logits[rows.to(logits.device)], position[rows]
                final_out, rebuilt = final_out[rows], rebuilt[rows]
        real = self.real_logit(logits, kept, position, out)
        rebuilt = self.capped(rebuilt, final_out, out)  # the model's logits are capped: compare cap(pre-cap)
        check_explained_logit(rebuilt, real, self.magnitude(final_out, out), final_out.shape[-1],
                              "next-token logit" + (" difference" if out.foil is not None else ""), strict, logits.dtype,
                              examples)

    def capped(self, pre_cap: Tensor, final_out: Tensor, out: LogitDirection) -> Tensor:
        r"""(B,) the model's output value of an explained pre-cap logit (difference) ``pre_cap``.

        Without a final soft-cap, ``pre_cap`` itself. With one (:func:`final_softcap`),
        cap * tanh(pre / cap); for a difference target minus foil, cap(pre_target) - cap(pre_foil)
        with pre_target = ``pre_cap`` + pre_foil, pre_foil from ``final_out`` (B, D) and the head.
        """
        if self.softcap is None:
            return pre_cap
        if out.foil is None:
            return apply_final_softcap(pre_cap, self.softcap)
        weight, bias = self._head_weights()
        w = weight.detach()[out.foil.to(weight.device)].to(device=final_out.device, dtype=final_out.dtype)
        foil = (final_out * w).sum(-1)
        if bias is not None:
            foil = foil + bias.detach()[out.foil.to(bias.device)].to(device=final_out.device, dtype=final_out.dtype)
        return apply_final_softcap(pre_cap + foil, self.softcap) - apply_final_softcap(foil, self.softcap)

    def cap_extras(self, pre_cap: Tensor, final_out: Tensor, out: LogitDirection) -> Dict[str, Any]:
        r"""What a result says about a final soft-cap: ``{}`` without one, else
        ``{"explained_logit": "pre-cap logit", "capped_logit": (B,) the model's output value,
        "final_softcap": cap}`` (the scores explain the pre-cap logit: the cap is not linear)."""
        if self.softcap is None:
            return {}
        return {"explained_logit": "pre-cap logit", "capped_logit": self.capped(pre_cap, final_out, out),
                "final_softcap": self.softcap}

    def magnitude(self, final_out: Tensor, out: LogitDirection) -> Tensor:
        r"""(B,) sum of |terms| of the explained logit(s): |f| . |W_U[target]| (+ |f| . |W_U[foil]|) + |biases|."""
        weight, bias = self._head_weights()
        mag = torch.zeros(final_out.shape[0], dtype=final_out.dtype, device=final_out.device)
        for ids in (out.target, out.foil):
            if ids is None:
                continue
            w = weight.detach()[ids.to(weight.device)].to(device=final_out.device, dtype=final_out.dtype)
            mag = mag + (final_out.abs() * w.abs()).sum(-1)
            if bias is not None:
                mag = mag + bias.detach()[ids.to(bias.device)].to(device=final_out.device, dtype=final_out.dtype).abs()
        return mag * abs(self.scale)

    def logits(self, final_out: Tensor) -> Tensor:
        r"""(B, V) next-token logits from the real final-norm output at the explained positions (B, D).

        The unembedding is cast to ``final_out``'s dtype and device :data:`VOCAB_BLOCK` rows at
        a time: a bfloat16 LM head of 128k x 4096 is never copied whole in float32 (2 GB).
        """
        weight, bias = self._head_weights()
        out = final_out.new_empty((final_out.shape[0], weight.shape[0]))
        for start in range(0, weight.shape[0], VOCAB_BLOCK):
            w = weight[start:start + VOCAB_BLOCK].detach().to(device=final_out.device, dtype=final_out.dtype)
            out[:, start:start + w.shape[0]] = final_out @ w.T
        if bias is not None:
            out = out + bias.detach().to(device=final_out.device, dtype=final_out.dtype)
        if self.scale != 1.0:
            out = out * self.scale
        return out if self.softcap is None else apply_final_softcap(out, self.softcap)

    def resolve(self, target: Any, final_out: Tensor, foil: Any = None) -> LogitDirection:
        r"""The explained direction of every example.

        Args:
            target: a token id (int, numpy integer, 0-d tensor), per-example ids (list or
                (B,) tensor / array), or None: the token the model predicts (argmax of its
                real logits). A tuple raises a ValueError pointing to ``foil``.
            final_out: (B, D) the real final-norm output at the explained positions.
            foil: None, or token id(s) of the same forms: the explained quantity is then
                logit(target) - logit(foil).

        Returns:
            :class:`LogitDirection` in ``final_out``'s dtype and device.
        """
        b, device, dtype = final_out.shape[0], final_out.device, final_out.dtype
        if isinstance(target, tuple):
            raise ValueError(CONTRAST_MOVED.format(target=target))
        if target is None:
            target = self.logits(final_out).argmax(-1)
        t_ids = as_token_ids(target, b, "target", device)
        f_ids = None if foil is None else as_token_ids(foil, b, "foil", device)
        for ids, name in ((t_ids, "target"), (f_ids, "foil")):
            if ids is not None and bool(((ids < 0) | (ids >= self.vocab_size)).any()):
                raise ValueError(f"{name} token ids must lie in [0, {self.vocab_size - 1}]; got {ids.tolist()}")
        weight, bias = self._head_weights()

        def rows(t: Tensor, ids: Tensor) -> Tensor:  # only the rows used are cast (not the whole head)
            return t.detach()[ids.to(t.device)].to(device=device, dtype=dtype)

        u = rows(weight, t_ids)
        ub = torch.zeros(b, dtype=dtype, device=device)
        if bias is not None:
            ub = rows(bias, t_ids)
        if f_ids is not None:
            u = u - rows(weight, f_ids)
            if bias is not None:
                ub = ub - rows(bias, f_ids)
        if self.scale != 1.0:  # Granite's logits / logits_scaling, Cohere's logits * logit_scale: linear, folded
            u, ub = u * self.scale, ub * self.scale
        return LogitDirection(u, ub, t_ids, f_ids)


def final_softcap(model: nn.Module, adapter: ArchitectureSpec) -> Optional[float]:
    r"""The final-logit soft-cap of ``model`` (``cap * tanh(logits / cap)``), or None.

    Read from the config attribute the description names (``adapter.head.final_softcap``,
    Gemma 2's ``final_logit_softcapping``); None when the description names none or the
    config sets it to None / 0.
    """
    return _config_softcap(language_config(model), adapter)


def _config_softcap(config: Any, adapter: ArchitectureSpec) -> Optional[float]:
    r""":func:`final_softcap` from the model's config."""
    name = getattr(getattr(adapter, "head", None), "final_softcap", None)
    if not name:
        return None
    cap = getattr(config, name, None)
    return float(cap) if cap else None


def apply_final_softcap(logits: Tensor, cap: Optional[float]) -> Tensor:
    r"""``cap * tanh(logits / cap)`` (``logits`` itself when ``cap`` is None), as the model's head applies it."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class ClassLogit:
    r"""The class logits of a sequence classifier, through its classification head.

    Args:
        model: a classifier with a supported head
            (:func:`~captum_normattr.models.heads.supported_heads`).

    Raises:
        UnsupportedModelError: for a model without a supported classification head.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = unwrap_model(model)
        self.head: ResolvedHead = find_classifier_head(self.model)

    @property
    def position(self) -> int:
        r"""The token whose last-layer output the head reads."""
        return self.head.position

    def params(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> HeadParams:
        r"""The head's parameters as right-multiplied matrices in ``dtype`` (on ``device`` if given)."""
        return head_params(self.model, self.head, dtype, device)

    def check_against_model(self, pooled: Tensor, params: HeadParams, model_logits: Tensor,
                            strict: Optional[bool] = None) -> None:
        r"""Guard: the head applied to the recorded last-layer output at its token gives the model's own logits.

        Args:
            pooled: (B, D) the last layer's real output at the head's token (a head with a
                final norm, :attr:`~captum_normattr.models.heads.HeadParams.pre_norm`, applies it).
            params: the head parameters the decomposition propagates through.
            model_logits: (B, C) the model's forward output.
            strict: see :func:`check_explained_logit`.
        """
        x = pooled.to(params.w_dense.dtype)
        if params.pre_norm is not None:  # a pre-LN encoder: the head reads the final norm's output
            x = rebuild_norm(x, params.pre_norm)
        hidden = x @ params.w_dense + (params.b_dense if params.b_dense is not None else 0.0)
        a = params.act(hidden)
        if params.norm is not None:  # ModernBERT's head: a norm after the activation
            a = rebuild_norm(a, params.norm)
        rebuilt = a @ params.w_cls + (params.b_cls if params.b_cls is not None else 0.0)
        magnitude = a.abs() @ params.w_cls.abs() + (params.b_cls.abs() if params.b_cls is not None else 0.0)
        check_explained_logit(rebuilt, model_logits, magnitude, params.w_cls.shape[0], "class logits", strict)

    def resolve(self, target: Any, logits: Tensor) -> Tensor:
        r"""The explained class of every example.

        Args:
            target: None (the predicted class, argmax of ``logits``), an int or numpy
                integer, a 1-tuple ``(c,)`` (Captum's output index), a list of ints (one per
                example) or a 0-d / (1,) / (B,) integer tensor or numpy array.
            logits: (B, C) the model's real logits.

        Returns:
            (B,) long class indices on ``logits``' device.

        Raises:
            TypeError / ValueError: for a target of the wrong type, shape or range.
        """
        b, c = logits.shape
        if target is None:
            return logits.argmax(-1)
        if isinstance(target, tuple):  # Captum: the index of the output's non-batch dimensions, for every example
            if len(target) != 1:
                raise ValueError(
                    f"target={target!r}: in Captum a tuple target indexes the output's dimensions for every example; "
                    f"the logits are (B, C), so it takes one index (target=(c,) or target=c). For one class per example "
                    "pass a list or a (B,) tensor (target=[1, 0])."
                )
            target = target[0]
        t = as_token_ids(target, b, "target", logits.device)
        if bool(((t < 0) | (t >= c)).any()):
            raise ValueError(f"target class(es) {t.tolist()} out of range: the model has {c} classes (0..{c - 1})")
        return t


class ImageClassLogit(ClassLogit):
    r"""The class logits of a Vision Transformer classifier: a linear head on final-norm outputs.

    ViT/DeiT: the [CLS] row; the distilled DeiT: the mean of its [CLS] and distillation
    heads (both rows are explained together); DINOv2: [CLS] concatenated with the mean of
    the patch rows (the family's ``Head.image_classifiers``). The head, not an
    explained position, defines what is explained.

    Args:
        model: a supported vision classifier.

    Raises:
        UnsupportedModelError: for a model without a supported head.
    """

    def __init__(self, model: nn.Module) -> None:
        from captum_normattr.models.heads import find_image_head, vision_head

        model = unwrap_model(model)
        self.model = model
        self.head = None
        self._build = vision_head
        find_image_head(model)  # raises the error naming the supported heads

    @property
    def position(self) -> int:
        return 0

    def check_against_model(self, rows_out: Tensor, head: Any, model_logits: Tensor,  # type: ignore[override]
                            strict: Optional[bool] = None) -> None:
        r"""Guard: the linear head on the recorded final-norm rows (B, R, D) gives the model's own logits."""
        x = rows_out.to(head.weight.dtype)
        rebuilt = torch.einsum("brd,rdc->bc", x, head.weight)
        magnitude = torch.einsum("brd,rdc->bc", x.abs(), head.weight.abs())
        if head.bias is not None:
            rebuilt, magnitude = rebuilt + head.bias, magnitude + head.bias.abs()
        check_explained_logit(rebuilt, model_logits, magnitude, head.weight.shape[0] * head.weight.shape[1],
                              "class logits", strict)

    def linear_head(self, num_tokens: int, num_prefix: int, dtype: torch.dtype, device: Optional[torch.device] = None):
        r"""The :class:`~captum_normattr.models.heads.LinearTokenHead` for inputs of ``num_tokens`` tokens (on ``device``)."""
        return self._build(self.model, num_tokens, num_prefix, dtype, device)


# --------------------------------------------------------------------------------------
# Guard: the explained logit is the model's own output logit
# --------------------------------------------------------------------------------------
class ExplainedOutputMismatchWarning(UserWarning):
    r"""The logit a decomposition explains differs from the model's own output logit beyond rounding."""


class ExplainedOutputMismatchError(RuntimeError):
    r"""The logit a decomposition explains is not the model's own output logit (far beyond rounding)."""


def logit_tolerances(real: Tensor, magnitude: Tensor, width: int, dtype: Optional[torch.dtype] = None):
    r"""(tight, loose) bounds on |rebuilt - real| of an explained logit, (B,) each.

    The rebuilt logit (the package's own product of the recorded head input with the head's
    weights) and the model's logit are the same sum of ``width`` terms whose absolute values
    add up to ``magnitude``; they differ by the accumulation order of the matmul (at most
    ~sqrt(width) x eps of the accumulation dtype x magnitude, times a safety factor 8) and by
    the rounding of the model's output to its dtype (4 eps x |logit|; half precision: also
    4 eps x magnitude, for reduced-precision reductions). Beyond ``tight`` the logit is
    suspicious; beyond ``loose`` = max(1e-3 (|logit| + magnitude), 64 tight) it is another
    quantity (a scale, a cap, a hook the decomposition does not model). ``dtype``: the dtype
    the model computed its logits in (default: ``real``'s).
    """
    dtype = real.dtype if dtype is None else dtype
    out_eps = torch.finfo(dtype).eps
    acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    mag = magnitude.to(torch.float64)
    size = real.detach().to(torch.float64).abs()
    tight = 4 * out_eps * size + 8 * math.sqrt(max(width, 1)) * acc_eps * mag
    if dtype in (torch.float16, torch.bfloat16):
        tight = tight + 4 * out_eps * mag
    loose = torch.maximum(1e-3 * (size + mag), 64 * tight)
    return tight, loose


def check_explained_logit(
    rebuilt: Tensor, real: Tensor, magnitude: Tensor, width: int, what: str, strict: Optional[bool] = None,
    dtype: Optional[torch.dtype] = None, examples: Optional[Tensor] = None,
) -> None:
    r"""Compare the explained logit with the model's own output logit; warn or raise on a mismatch.

    Args:
        rebuilt: (B, ...) the logit as the decomposition explains it (from the recorded head
            input and the head weights the package reads).
        real: (B, ...) the same logits from the model's forward output (after every scaling,
            cap and hook of the real model).
        magnitude: (B, ...) the sum of the absolute terms of the rebuilt logit (its scale).
        width: the number of terms (the head's input width).
        what: a readable name of the explained output, for the message.
        strict: True: raise beyond the tight tolerance; otherwise warn beyond the tight one
            and raise beyond the loose one (:func:`logit_tolerances`).
        dtype: the dtype the model computed ``real`` in (default: ``real``'s).
        examples: (B,) the batch indices of the rows compared (default: 0..B-1), for the message.

    Raises:
        ExplainedOutputMismatchError: see ``strict``.

    Warns:
        ExplainedOutputMismatchWarning: beyond the tight tolerance (not ``strict``).
    """
    diff = (rebuilt.detach().to(torch.float64) - real.detach().to(device=rebuilt.device, dtype=torch.float64)).abs()
    tight, loose = logit_tolerances(real.to(rebuilt.device), magnitude.to(rebuilt.device), width, dtype)
    over_tight = ~(diff <= tight)  # NaN counts as a mismatch only where the model's logit is finite
    over_tight &= torch.isfinite(real.to(rebuilt.device))
    if not bool(over_tight.any()):
        return
    b = diff.shape[0]
    per_example = lambda t: t.reshape(b, -1).amax(-1)
    bad = per_example(over_tight.to(torch.float64)).bool()
    names = (bad.nonzero().flatten() if examples is None else examples.to(bad.device)[bad]).tolist()
    worst = float(diff[over_tight].max())
    tol = float(tight[over_tight].max())
    far = bool((over_tight & ~(diff <= loose)).any())
    msg = (
        f"the {what} that the decomposition explains differs from the model's own output by up to {worst:.3g} "
        f"(rounding allows {tol:.3g}) for example(s) {names}: the model changes its "
        "logits after the head input the package reads (a logit scale or soft-cap, a hook on the head, a wrapped or "
        "customised head, an adapter the package does not read). The scores explain the rebuilt logit, not the "
        "model's; check the model, or merge adapters / remove the hook."
    )
    if far or strict:
        raise ExplainedOutputMismatchError(msg)
    warnings.warn(msg, ExplainedOutputMismatchWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def _with_extra_kwargs(cls: type) -> type:
    def forward_kwargs(self) -> dict:
        kw = cls.forward_kwargs(self)
        kw.update(self.extra_forward_kwargs)
        return kw

    return type(cls.__name__, (cls,), {"forward_kwargs": forward_kwargs, "__doc__": cls.__doc__})


def with_forward_kwargs(prepared: Any, **extra: Any) -> Any:
    r"""A copy of validated inputs whose ``forward_kwargs()`` also pass ``extra`` to the model.

    Used to ask a causal LM for the logits at the explained positions only
    (``logits_to_keep``). The copy is what the recorded forward pass updates (its
    ``finite``): read the results from it.
    """
    new = copy.copy(prepared)
    new.__class__ = _with_extra_kwargs(type(prepared))
    new.extra_forward_kwargs = dict(extra)
    return new


def accepts_logits_to_keep(model: nn.Module) -> bool:
    r"""True when the model's forward takes transformers' ``logits_to_keep`` (the LM head on some rows only)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def check_additive_next_token_logit(adapter: ArchitectureSpec, method: str) -> None:
    r"""Raise unless the model gives an additive next-token logit (what ALTI-Logit splits over tokens).

    That is a model that predicts a next token (not a bidirectional text encoder), whose layer
    kind splits the residual stream into additive updates (the kind decomposes ``"alti_logit"``:
    norms inside the branches, not the stream norms of post-LN layers), read through a final norm.

    Args:
        adapter: the model's description.
        method: named in the messages.

    Raises:
        ValueError: a bidirectional text encoder, or no final norm.
        UnsupportedModelError: a layer kind that does not decompose ``"alti_logit"``.
    """
    if not adapter.causal and adapter.modality == "text":  # a bidirectional encoder (ModernBERT) has no next token
        raise ValueError(
            f"{method} explains next-token logits of decoders; {adapter.family} is a bidirectional encoder, "
            "which predicts no next token: explain its class logits with DecompXAttribution and its token mixing with "
            "ALTIAttribution or GlobEncAttribution"
        )
    layer_kind(adapter.topology, adapter.family).require("alti_logit", adapter.family)
    if adapter.final_norm is None:
        raise ValueError(
            f"{method} explains next-token logits of decoders with norms inside the branches, through their final "
            f"norm ({supported_causal_families()}); {adapter.family} is not one"
        )


__all__ = [
    "CONTRAST_MOVED",
    "ClassLogit",
    "ExplainedOutputMismatchError",
    "ExplainedOutputMismatchWarning",
    "GUARD_LOGIT_ELEMENTS",
    "ImageClassLogit",
    "LogitDirection",
    "NextTokenLogit",
    "VOCAB_BLOCK",
    "accepts_logits_to_keep",
    "apply_final_softcap",
    "as_token_ids",
    "check_additive_next_token_logit",
    "check_explained_logit",
    "explains_next_token",
    "final_softcap",
    "logit_scale",
    "logit_tolerances",
    "with_forward_kwargs",
]
