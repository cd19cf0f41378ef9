r"""The declarative description of a Transformer architecture (``docs/architectures.md``).

An :class:`ArchitectureSpec` says, as data, how one model family computes a layer: its
branches (self-attention, feed-forward), each branch's optional pre-norm, post-norm and
output scale, whether the branches run in parallel on the same input, the norms on the
residual stream (post-LN), the norm type and its quirks (RMSNorm or LayerNorm, Gemma's
``1 + w`` gain), the feed-forward type, the value projection's layout, the heads (LM head,
logit scaling, soft-capping) and the input quirks. Nothing else in the package knows a
family by name: the engine chooses the layer's topology kind from :attr:`ArchitectureSpec.topology`,
the capture records the tensors the description names, and the explained output is chosen
from the model's head.

Paths are dotted attribute paths: :attr:`ArchitectureSpec.layers` and the final norm from
the base model (``model.base_model``), the LM head from the model with the head, every
other path from one layer module.

The module is over 700 lines because the description is one schema, read as a
whole: its dataclasses, their docstrings and their validation stay together.

Examples::

    >>> from captum_normattr.arch import (ArchitectureSpec, Attention, FeedForward, Head, Layer, Norm,
    ...                                   ValueProjection, register_architecture)
    >>> spec = ArchitectureSpec(
    ...     family="MyLM", model_types=("my_lm",), layers="layers", causal=True,
    ...     layer=Layer(
    ...         attention=Attention("self_attn", out="self_attn.o_proj", value=ValueProjection("self_attn.v_proj"),
    ...                             pre_norm=Norm("input_layernorm", "rmsnorm")),
    ...         ff=FeedForward(up="mlp.up_proj", gate="mlp.gate_proj", act="mlp.act_fn", down="mlp.down_proj",
    ...                        pre_norm=Norm("post_attention_layernorm", "rmsnorm")),
    ...     ),
    ...     head=Head(final_norm=Norm("norm", "rmsnorm"), lm_head="lm_head"),
    ... )
    >>> spec.topology
    'pre_ln'
    >>> register_architecture(spec)  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Tuple

__all__ = [
    "UnsupportedModelError",
    "ArchitectureSpec",
    "Attention",
    "ClassifierHead",
    "DELTA_LAYOUTS",
    "EXPERT_KINDS",
    "Experts",
    "FeedForward",
    "HEAD_FUNCTIONS",
    "Head",
    "IMAGE_READOUTS",
    "ImageClassifierHead",
    "Inputs",
    "FUNCTIONAL_ACT",
    "Layer",
    "MIXER_KINDS",
    "Norm",
    "TOPOLOGIES",
    "ValueProjection",
    "Variant",
]

#: The norm types a description can name. ``identity`` stands for a branch without a pre-norm
#: (OLMo 2): :attr:`ArchitectureSpec.norm1` / :attr:`~ArchitectureSpec.norm2` give one, recorded
#: at the input of the branch's first module (its output is its input).
NORM_KINDS: Tuple[str, ...] = ("layernorm", "rmsnorm", "identity")
#: The feed-forward types: ``plain`` act(u W1 + b1) W2 + b2; ``gated`` (act(u Wg) * (u W1)) W2
#: (SwiGLU, GeGLU); ``fused_gate_up``: a gated FF whose gate and up projections are one module
#: (Phi-3's ``gate_up_proj``), split into its two halves when the weights are read.
#: ``experts``: a mixture of gated experts with a top-k router and an optional shared expert
#: (:class:`Experts`; Mixtral, Qwen2-MoE, Qwen3-MoE), decomposed with the routing of the real
#: forward pass held fixed (``docs/architectures.md``, "Mixtures of experts").
FF_KINDS: Tuple[str, ...] = ("plain", "gated", "fused_gate_up", "experts")
#: The expert types of an ``experts`` feed-forward (:attr:`Experts.kind`): ``gated`` (transformers'
#: fused gated experts without biases: Mixtral, Qwen-MoE) and ``clamped_swiglu`` (GPT-OSS: biases,
#: a clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)).
#: ``input_scaled`` (Llama 4: every expert reads the routing-scaled input, FF_e(r u), the scores
#: read from the router's output, :attr:`Experts.router`).
#: ``squared_relu`` (Nemotron-H: non-gated ReLU² experts, relu(u W_up^e)^2 W_down^e, with a plain
#: ReLU² shared expert; read as the gated form relu(a) * a, W_gate = W_up).
EXPERT_KINDS: Tuple[str, ...] = ("gated", "clamped_swiglu", "input_scaled", "squared_relu")
#: The fixed functions a classification head may apply (:attr:`ClassifierHead.activation_fn`), by
#: their name in ``torch``: the activation is ``getattr(torch, name)``.
HEAD_FUNCTIONS: Tuple[str, ...] = ("tanh", "relu")
#: Value projection layouts: ``plain`` (its own projection), ``fused`` (one projection whose
#: output is ``count`` equal slices, the value being slice ``index``: GPT-2's [q | k | v]),
#: ``interleaved`` (one projection whose output is per head [q_h | k_h | v_h]: GPT-NeoX),
#: ``fused_gqa`` (one projection whose output is [q | k | v] with H * Dh query columns and
#: H_kv * Dh key and value columns each, the head counts read from the attention module:
#: Phi-3's ``qkv_proj`` with grouped-query attention; with H_kv = 1 Falcon's multi-query
#: ``query_key_value``), ``grouped`` (one projection whose output is, per key/value head, its
#: H / H_kv query heads, then its key and its value head, Dh columns each: Falcon's new decoder
#: architecture).
#: ``latent`` (multi-head latent attention, DeepSeek-V3: the values are projected up from an
#: RMS-normalised low-rank latent, v_j = RMSNorm(x_j W_a^c + b_a^c) W_b^v; see :class:`ValueProjection`).
#: ``delta_grouped`` (a Gated DeltaNet's fused input projection grouped per key head, Qwen3-Next's
#: ``in_proj_qkvz``: per key head [q (d_k) | k (d_k) | v (r d_v) | z (r d_v)] with r = H_v / H_k value
#: heads per key head; the value is slice 2 of 4, value heads in order) and ``delta_split`` (its
#: projection [q (H_k d_k) | k (H_k d_k) | v (H_v d_v)], Qwen3.5's ``in_proj_qkv``; slice 2 of 3); the
#: sizes are read from the mixer module (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``).
#: ``mamba2_x`` (a Mamba-2 mixer's input projection [z | x | B | C | dt]: the value channels are the x
#: slice, columns [I, 2 I) with I the mixer module's ``intermediate_size``).
VALUE_LAYOUTS: Tuple[str, ...] = ("plain", "fused", "interleaved", "fused_gqa", "grouped", "latent",
                                  "delta_grouped", "delta_split", "mamba2_x")
#: Where the attention probabilities are recorded: ``interface`` (the module calls transformers'
#: attention function, which the capture replaces by its recording one), ``returned`` (the module
#: computes its attention itself and returns its probabilities, as BLOOM's ALiBi attention),
#: ``module_output`` (the module computes its attention itself, as DeBERTa's disentangled
#: attention, and returns its probabilities as its second output when called with
#: ``output_attentions=True``: the capture asks for them and records the value projection's
#: output as the values).
PROBABILITY_SOURCES: Tuple[str, ...] = ("interface", "returned", "module_output")
#: The prefix of a :attr:`FeedForward.act` that names a function of ``torch.nn.functional``.
FUNCTIONAL_ACT = "torch.nn.functional."
#: The token mixers a layer's mixing branch (:class:`Attention`) can be: ``softmax`` (attention
#: probabilities recorded as :data:`PROBABILITY_SOURCES` says) and ``short_conv`` (LFM2's gated
#: short convolution, y_t = C_t * sum_k w_k * B_{t-k} * x_{t-k}: with the gates B and C recorded
#: from the real forward pass, a per-channel mixing tensor G[c, t, s] = C_{t,c} w_{t-s,c} B_{s,c}
#: applied to the value channels x_s, recorded as attention with one head per channel and head
#: size 1; ``docs/frontier.md``, "Short-convolution mixers"). The extension point for the
#: linear-attention and state-space mixers: a mixer kind whose capture builds its per-channel mixing
#: tensor (B, C, T, S) from the recorded coefficients and its value channels (B, C, S, 1) is
#: decomposed by every layer kind unchanged (a no-token term per target is not expressed yet).
#: ``gated_delta_net`` (Qwen3-Next's and Qwen3.5's Gated DeltaNet, transformers' ``*GatedDeltaNet``: a
#: delta-rule recurrence behind a causal depthwise convolution and a gated RMSNorm; with its coefficients
#: recorded from the real forward pass, a per-channel mixing tensor over the value channels of its input
#: projection, recorded as attention with one head of size 1 per value channel;
#: :mod:`captum_normattr.models.capture.gated_delta_net`, ``docs/linear_mixers.md``).
#: The value layouts of a ``gated_delta_net`` mixer's input projection.
DELTA_LAYOUTS: Tuple[str, ...] = ("delta_grouped", "delta_split")
#: ``kimi_delta``: Kimi Linear's Kimi Delta Attention (a gated delta rule with a decay per key channel,
#: after causal depthwise convolutions and SiLUs of q, k and v, then a sigmoid-gated RMSNorm): with its
#: coefficients recorded, the per-channel mixing tensor of the value projection's output (the values before
#: the convolution), recorded as attention with one head per channel and head size 1
#: (``docs/linear_mixers.md``, "Kimi Delta Attention").
#: ``mamba2``: a Mamba-2 (state-space) mixer (Granite 4): with the time steps, B, C, the
#: convolution's SiLU slope and the gated norm's per-target scale recorded, a per-channel mixing
#: tensor G[c, t, s] over the x channels of its input projection before the causal convolution
#: (``docs/linear_mixers.md``, "Wiring Mamba-2 into the families").
MIXER_KINDS: Tuple[str, ...] = ("softmax", "short_conv", "gated_delta_net", "kimi_delta", "mamba2")
#: The layer topologies (one layer kind each; ``captum_normattr.decompose.kinds.registry``):
#:
#: - ``post_ln``: z = x + Attn(x), zt = LN1(z), y = LN2(zt + FF(zt)) (BERT);
#: - ``pre_ln``: h = x + Attn(N1(x)), y = h + FF(N2(h)) (GPT-2, Llama);
#: - ``sandwich``: h = x + P1(Attn(N1(x))), y = h + P2(FF(N2(h))), norms after the branches
#:   too (Gemma 2, Gemma 3);
#: - ``parallel``: y = x + Attn(N1(x)) + FF(N2(x)), both branches on the layer input
#:   (GPT-NeoX, GPT-J, Phi-2, Falcon, Cohere);
#: - ``single_branch``: y = x + B(N(x)), ONE branch per layer, a mixing branch (attention, a linear
#:   mixer) or a feed-forward, chosen by the layer's type (Nemotron-H; :attr:`Layer.single_branches`).
#: - ``sandwich_per_layer_input``: a sandwich layer with Gemma 4's additions (:attr:`Layer.per_layer_input`):
#:   y = c (z + N_ple((act(z W_gate) * e_t) W_proj)), z the sandwich layer's output, e_t a per-layer
#:   input of the token, c a learned scalar; values normalised per head, shared across layers.
TOPOLOGIES: Tuple[str, ...] = ("post_ln", "pre_ln", "sandwich", "parallel", "single_branch", "sandwich_per_layer_input")
#: The branch names of a single-branch layer's description (:attr:`Layer.branch`).
SINGLE_BRANCH_NAMES: Tuple[str, ...] = ("self_attention", "feed_forward")


def _has_path(module: Any, path: str) -> bool:
    r"""True when the dotted attribute ``path`` exists on ``module``."""
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:  # missing, or set to None (Granite 4's layer keeps self_attn = None beside its mamba)
            return False
    return True


def _has_parts(module: Any, att: "Attention") -> bool:
    r"""True when ``module`` (a layer) has the mixer ``att``'s module, value projection and convolution (Kimi Linear's
    two mixers share the module path ``self_attn``: their parts tell them apart)."""
    paths = [att.module] + [p for p in (att.value.path if att.value is not None else None, att.conv) if p is not None]
    return all(_has_path(module, p) for p in paths)


def _has_branch_parts(module: Any, branch: Any) -> bool:
    r"""True when ``module`` (a layer) has the parts of ``branch``: an :class:`Attention` (:func:`_has_parts`) or a
    :class:`FeedForward` (its projections, and its experts module; a functional activation is no module)."""
    if isinstance(branch, Attention):
        return _has_parts(module, branch)
    paths = [branch.up, branch.down] + [p for p in (branch.gate, branch.experts.module if branch.experts else None)
                                        if p is not None]
    if not branch.act.startswith(FUNCTIONAL_ACT):
        paths.append(branch.act)
    return all(_has_path(module, p) for p in paths)


class UnsupportedModelError(ValueError):
    r"""Raised for a model whose architecture has no description, or a method its layer kind cannot decompose."""


@dataclass(frozen=True)
class Norm:
    r"""One normalisation module.

    Attributes:
        path: the module's path.
        kind: ``"layernorm"`` or ``"rmsnorm"``. Whether it has a gain and a bias is read
            from the module (a parameter-free LayerNorm, as in OLMo, has neither).
        weight_offset: the effective gain is ``weight + weight_offset`` (Gemma computes
            ``x_hat * (1 + w)``: offset 1.0).
        eps: the epsilon, for a module that does not carry one (OLMo's parameter-free
            LayerNorm uses a fixed 1e-5 in its code); None: read from the module's ``eps`` /
            ``variance_epsilon`` (a module that has one always wins).
    """

    path: str
    kind: str = "layernorm"
    weight_offset: float = 0.0
    eps: Optional[float] = None

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ValueError(f"Norm {self.path!r}: kind must be one of {NORM_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class ValueProjection:
    r"""Where the value projection W_V (and b_V) is.

    Attributes:
        path: the projection module.
        layout: one of :data:`VALUE_LAYOUTS`.
        index, count: for ``fused``: the value is output slice ``index`` of ``count``
            equal slices; for ``interleaved``: each head's output block is ``count``
            equal slices, the value being slice ``index``; for ``fused_gqa`` and ``grouped``:
            ``count`` is 3 and ``index`` 0, 1 or 2 (q, k, v: the value is 2).
        latent_norm, latent_up: for ``latent`` (multi-head latent attention): the norm of the
            latent (``kv_a_layernorm``) and the up-projection (``kv_b_proj``, per head
            [key part | value part]); ``path`` is then the down-projection whose first
            ``kv_lora_rank`` outputs are the latent c (``kv_a_proj_with_mqa``, the decoupled
            rotary key part after them). The head sizes are the attention module's
            ``kv_lora_rank``, ``qk_nope_head_dim`` and ``v_head_dim``. With the latent's norm
            scale s_j = 1 / rms(c_j) recorded, v_j = s_j (x_j W_a^c diag(g) W_b^v + b_a^c diag(g) W_b^v):
            the capture folds s_j into the probabilities (p_ij s_j) and records v_j / s_j, a
            linear map of the attention input (``docs/frontier.md``, "Multi-head latent attention").
    """

    path: str
    layout: str = "plain"
    index: int = 0
    count: int = 1
    latent_norm: Optional[Norm] = None
    latent_up: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.layout == "latent") != (self.latent_norm is not None and self.latent_up is not None):
            raise ValueError(f"ValueProjection {self.path!r}: a latent value projection (and only it) names its "
                             "latent_norm and latent_up")
        if self.layout not in VALUE_LAYOUTS:
            raise ValueError(f"ValueProjection {self.path!r}: layout must be one of {VALUE_LAYOUTS}, got {self.layout!r}")
        if self.layout != "plain" and not 0 <= self.index < self.count:
            raise ValueError(f"ValueProjection {self.path!r}: index {self.index} outside the {self.count} slices")
        if self.layout in ("fused_gqa", "grouped") and self.count != 3:
            raise ValueError(f"ValueProjection {self.path!r}: a {self.layout} projection has 3 slices (q, k, v)")
        if self.layout in DELTA_LAYOUTS and (self.index, self.count) != (2, 4 if self.layout == "delta_grouped" else 3):
            raise ValueError(f"ValueProjection {self.path!r}: the value of a {self.layout} projection is slice 2 of "
                             f"{4 if self.layout == 'delta_grouped' else 3} ([q | k | v{' | z' if self.layout == 'delta_grouped' else ''}])")


@dataclass(frozen=True)
class Attention:
    r"""The self-attention branch of a layer.

    Attributes:
        module: the attention module, the one that calls transformers' attention function
            (the capture records its real probabilities there).
        out: the output projection W_O.
        value: the value projection (:class:`ValueProjection`), or None where no method needs
            it (DecompX propagates parts through it).
        pre_norm: the norm applied to the branch input (pre-LN kinds), or None (post-LN
            layers; a sandwich layer without pre-norms, OLMo 2: the branch reads the raw stream).
        post_norm: the norm applied to the branch output before the residual (sandwich), or None.
        probabilities: where the real attention probabilities come from: ``"interface"`` (the
            module calls transformers' attention function, which the capture replaces by a
            recording one) or ``"returned"`` (the module computes its attention itself, as
            BLOOM's with its ALiBi biases, and returns ``(output, probabilities)``; the capture
            records what it returns, the value states from the value projection's output, the
            context from the output projection's input; the module's first input is the
            attention input, BLOOM passes the residual beside it).
        scale: a per-channel layer-scale module after the branch (DINOv2's ``layer_scale1``),
            folded into W_O and b_O when the weights are read, or None.
        softcap: the config attribute of attention-score soft-capping (Gemma 2:
            ``attn_logit_softcapping``), applied by the recording attention exactly as the
            model does, or None.
        multiplier: the config attribute of a scalar the model multiplies the branch output
            by before the residual join (Granite's ``residual_multiplier``:
            h = x + m * Attn(N1(x))), folded into W_O and b_O when the weights are read, or
            None.
        probabilities: one of :data:`PROBABILITY_SOURCES`: how the module's real
            probabilities are recorded (never by re-implementing its attention).
        sinks: the attention module's parameter of learned per-head sink logits (GPT-OSS's
            ``sinks``, passed to the attention function as ``s_aux``), or None. Each head's
            softmax row has one more logit s_h in its denominator,
            p_ij = exp(z_ij) / (sum_k exp(z_ik) + exp(s_h)), so the probabilities over the tokens
            sum to less than 1 (the sink's mass goes nowhere); the recording attention computes
            them so, and every method is exact with them (``docs/frontier.md``, "Attention sinks").
        mixer: one of :data:`MIXER_KINDS`: ``softmax`` (the default), ``short_conv`` (``module``
            is the short-convolution block, ``value`` its input projection's value slice
            ``ValueProjection(in_proj, "fused", index=2, count=3)`` for [B | C | x], ``conv`` the
            causal depthwise ``Conv1d``, ``out`` the output projection), ``gated_delta_net`` (Qwen3-Next's
            and Qwen3.5's Gated DeltaNet block, ``value`` its input projection, layout in :data:`DELTA_LAYOUTS`)
            , ``kimi_delta`` (``module``
            is Kimi's delta-attention block with its ``q_proj``, ``k_proj``, ``forget_gate``, ``b_proj``
            and ``o_norm``, ``value`` its ``v_proj`` (layout ``plain``), ``conv`` the depthwise ``Conv1d``
            over [q | k | v], ``out`` its ``o_proj``) or ``mamba2`` (``module`` the
            Mamba-2 mixer, ``value`` ``ValueProjection(in_proj, "mamba2_x")``, ``conv`` its ``conv1d``
            over [x | B | C], ``out`` its output projection; its ``norm``, ``A_log``, ``D``, ``dt_bias``
            and ``time_step_limit`` are read from the module).
        conv: the causal depthwise convolution of a ``short_conv``, ``gated_delta_net``, ``kimi_delta`` or
            ``mamba2`` mixer (its kernel w[c, k]), from the layer.
        output_gate: a softmax attention whose output is gated per channel, o_t = attn_t * sigmoid(g_t) with
            the gate g_t from the same target token (Qwen3-Next's and Qwen3.5's full-attention layers): the
            query projection whose output is per head [query_h | gate_h] (``self_attn.q_proj``), or None. The
            capture records it as attention with one head of size 1 per channel, p[h Dh + c, t, s] =
            p_h[t, s] * sigmoid(g_t[h, c]), the values of the key/value head h serves
            (``docs/linear_mixers.md``, "Gated attention"); the value projection's columns are then read
            once per query head (grouped-query attention expanded).
    """

    module: str
    out: str
    value: Optional[ValueProjection] = None
    pre_norm: Optional[Norm] = None
    post_norm: Optional[Norm] = None
    scale: Optional[str] = None
    softcap: Optional[str] = None
    multiplier: Optional[str] = None
    probabilities: str = "interface"
    sinks: Optional[str] = None
    mixer: str = "softmax"
    conv: Optional[str] = None
    output_gate: Optional[str] = None

    def __post_init__(self) -> None:
        if self.mixer not in MIXER_KINDS:
            raise ValueError(f"Attention {self.module!r}: mixer must be one of {MIXER_KINDS}, got {self.mixer!r}")
        if (self.mixer in ("short_conv", "gated_delta_net", "kimi_delta", "mamba2")) != (self.conv is not None):
            raise ValueError(f"Attention {self.module!r}: a short_conv, gated_delta_net, kimi_delta or mamba2 mixer "
                             "(and only it) names its conv")
        if self.mixer == "gated_delta_net" and (self.value is None or self.value.layout not in DELTA_LAYOUTS
                                                or self.sinks is not None or self.softcap is not None
                                                or self.probabilities != "interface"):
            raise ValueError(f"Attention {self.module!r}: a gated_delta_net mixer reads its values from its input "
                             f"projection (layout one of {DELTA_LAYOUTS}), without sinks or soft-caps")
        if self.mixer != "gated_delta_net" and self.value is not None and self.value.layout in DELTA_LAYOUTS:
            raise ValueError(f"Attention {self.module!r}: a {self.value.layout} value projection belongs to a "
                             "gated_delta_net mixer")
        if self.output_gate is not None and (self.mixer != "softmax" or self.probabilities != "interface"
                                             or self.value is None or self.value.layout != "plain"):
            raise ValueError(f"Attention {self.module!r}: an output gate is recorded on a softmax attention whose "
                             "probabilities come from the attention interface, with its own value projection "
                             "(layout 'plain')")
        if self.mixer == "kimi_delta" and (self.value is None or self.value.layout != "plain" or self.sinks is not None
                                           or self.softcap is not None or self.probabilities != "interface"):
            raise ValueError(f"Attention {self.module!r}: a kimi_delta mixer reads its values from its own value "
                             "projection (layout 'plain', before the convolution), without sinks or soft-caps")
        if self.mixer == "mamba2" and (self.value is None or self.value.layout != "mamba2_x"
                                       or self.sinks is not None or self.softcap is not None
                                       or self.probabilities != "interface"):
            raise ValueError(f"Attention {self.module!r}: a mamba2 mixer reads its values as the x slice of its input "
                             "projection (ValueProjection(in_proj, 'mamba2_x')), without sinks or soft-caps")
        if self.value is not None and self.value.layout == "mamba2_x" and self.mixer != "mamba2":
            raise ValueError(f"Attention {self.module!r}: a 'mamba2_x' value projection belongs to a mamba2 mixer")
        if self.mixer == "short_conv" and (self.value is None or self.value.layout != "fused" or self.value.count != 3
                                           or self.sinks is not None or self.softcap is not None):
            raise ValueError(f"Attention {self.module!r}: a short_conv mixer reads its values as slice index of a fused "
                             "[B | C | x] input projection (layout 'fused', count 3), without sinks or soft-caps")
        if self.sinks is not None and self.probabilities != "interface":
            raise ValueError(f"Attention {self.module!r}: sinks are applied by the recording attention function "
                             "(probabilities='interface')")
        if self.probabilities not in PROBABILITY_SOURCES:
            raise ValueError(f"Attention {self.module!r}: probabilities must be one of {PROBABILITY_SOURCES}, "
                             f"got {self.probabilities!r}")
        if self.probabilities == "returned" and self.value is None:
            raise ValueError(f"Attention {self.module!r}: returned probabilities need the value projection (the value "
                             "states are read from its output)")
        if self.probabilities == "module_output" and (self.value is None or self.value.layout != "plain"):
            raise ValueError(f"Attention {self.module!r}: probabilities from the module's output need its own "
                             "value projection (layout 'plain'), whose output is recorded as the values")


@dataclass(frozen=True)
class Experts:
    r"""A mixture of gated experts: what an ``experts`` feed-forward branch is made of.

    FF(u_i) = sum_{e in top_k(i)} r_ie (g(u_i W_gate^e) * (u_i W_up^e)) W_down^e
              [+ sigmoid(u_i w_s) (g(u_i W_gate^s) * (u_i W_up^s)) W_down^s]

    with the chosen experts top_k(i) and their routing weights r_ie read from the real
    forward pass (the arguments the experts module is called with) and held fixed, as is
    the shared expert's gate sigmoid(u_i w_s) (Qwen2-MoE).

    Attributes:
        module: the experts module (transformers' fused ``*Experts``: 3-D ``gate_up_proj``
            (E, 2 F, D) and ``down_proj`` (E, D, F), called as ``experts(hidden, top_k_index,
            top_k_weights)``), from the layer.
        shared: the shared expert (a gated :class:`FeedForward` whose paths are from the
            layer), or None.
        shared_gate: the shared expert's gate projection (D -> 1, its output passed through
            a sigmoid), or None (a shared expert without gate is added as it is).
        dense: the feed-forward of the layers that have no experts module (Qwen2-MoE's and
            Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``), or None.
        kind: one of :data:`EXPERT_KINDS`: ``"gated"`` (transformers' fused experts, no
            biases: g(u W_gate^e) * (u W_up^e)) or ``"clamped_swiglu"`` (GPT-OSS:
            (E, D, 2F) ``gate_up_proj`` applied as u @ W^e with interleaved [gate, up] columns and
            a bias ``gate_up_proj_bias``, the expert computing
            (clamp(b, -L, L) + 1) * c sigmoid(alpha c), c = min(a, L), then ``down_proj`` (E, F, D)
            plus ``down_proj_bias``; L and alpha are the module's ``limit`` and ``alpha``) or
            ``"input_scaled"`` (Llama 4: the experts module is called with every token repeated
            per expert and multiplied by its routing score, FF_e(r_e u) =
            (g(r_e u W_gate^e) * (r_e u W_up^e)) W_down^e, r_e = 0 for the experts not chosen; the
            (E, D, 2F) ``gate_up_proj`` [gate | up] is applied as u @ W^e; the scores are recorded
            from the output of :attr:`router`) or ``"squared_relu"`` (Nemotron-H: non-gated experts,
            ``up_proj`` (E, F, D) and ``down_proj`` (E, D, F) applied as ``F.linear``,
            r_e relu(u W_up^e)^2 W_down^e; the shared expert a plain ReLU² :class:`FeedForward`; every
            neuron read as the gated form relu(a) * a with W_gate = W_up, whose integrated gradients
            are the elementwise ReLU²'s: ``docs/frontier.md``, "Single-branch layers").
        router: for ``input_scaled``: the router module, whose first output is the (N, E)
            routing scores the experts' input is multiplied by; None otherwise.
        shared_beside: the shared expert's module when the *layer*, not the sparse block, adds its
            output (Granite 4: ``block_sparse_moe(u) + shared_mlp(u)`` in the layer's forward); its
            output is recorded and added to the block's (the FF's ``down``) as the FF output; None
            when the block's output holds the shared expert's.
        latent: for ``squared_relu``: the linear maps the block applies around the routed experts,
            ``(into the latent space, back)`` (Nemotron-H's ``fc1_latent_proj`` and ``fc2_latent_proj``
            with ``moe_latent_size``; an ``nn.Identity`` there without), folded into the stacked
            W_up and W_down (and the output bias) when the weights are read; None: none.
    """

    module: str
    shared: Optional["FeedForward"] = None
    shared_gate: Optional[str] = None
    dense: Optional["FeedForward"] = None
    kind: str = "gated"
    router: Optional[str] = None
    shared_beside: Optional[str] = None
    latent: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_KINDS:
            raise ValueError(f"Experts: kind must be one of {EXPERT_KINDS}, got {self.kind!r}")
        if (self.kind == "input_scaled") != (self.router is not None):
            raise ValueError("Experts: input-scaled experts (and only they) name the router whose scores they read")
        for name, ff in (("shared expert", self.shared), ("dense feed-forward", self.dense)):
            plain = self.kind == "squared_relu" and name == "shared expert"  # Nemotron-H's shared ReLU² MLP
            if ff is not None and ff.kind not in (("plain",) if plain else ("gated", "fused_gate_up")):
                raise ValueError(f"Experts: the {name} is a {'plain' if plain else 'gated'} FeedForward, got kind "
                                 f"{ff.kind!r}")
        if self.kind == "squared_relu" and self.shared_gate is not None:
            raise ValueError("Experts: squared_relu experts have an ungated shared expert")
        if self.latent is not None and (self.kind != "squared_relu" or len(self.latent) != 2):
            raise ValueError("Experts: latent projections (into, back) are read for squared_relu experts")
        if self.shared_gate is not None and self.shared is None:
            raise ValueError("Experts: a shared_gate needs a shared expert")
        if self.shared_beside is not None and (self.shared is None or self.shared_gate is not None):
            raise ValueError("Experts: shared_beside names the module of an ungated shared expert (shared=...)")


@dataclass(frozen=True)
class FeedForward:
    r"""The feed-forward branch of a layer.

    FF(u) = act(u W_up + b_up) W_down + b_down, or, gated,
    FF(u) = (act(u W_gate + b_gate) * (u W_up + b_up)) W_down + b_down.

    Attributes:
        up: the first projection W_up (W1); for ``fused_gate_up``, the one projection
            whose output is both halves (Phi-3's ``gate_up_proj``).
        act: the activation (a module or callable attribute), or ``"torch.nn.functional.<name>"`` for a
            feed-forward that calls torch's function itself (LFM2: ``F.silu``, :data:`FUNCTIONAL_ACT`).
        down: the output projection W_down (W2); its output is FF(u).
        gate: the gate projection of a gated FF, or None.
        kind: one of :data:`FF_KINDS` (None: ``gated`` with a gate, else ``plain``).
        pre_norm, post_norm, scale: as in :class:`Attention` (``scale``: DINOv2's
            ``layer_scale2``; the recorded FF output is then the scale module's output).
        multiplier: as in :class:`Attention` (Granite's ``residual_multiplier``:
            y = h + m * FF(N2(h))), folded into W_down and b_down (for ``experts``: into the
            stacked experts' W_down, Granite-MoE).
        gate_first: for ``fused_gate_up``: the output's first half is the gate (Phi-3's
            ``gate, up = gate_up_proj(x).chunk(2, -1)``); False: the up half comes first.
        experts: for ``experts``: the :class:`Experts`; ``up`` then names the module that
            receives the FF input and ``down`` the one whose output is FF(u) (both the
            sparse block, ``mlp``), ``act`` the experts' activation.
    """

    up: str
    act: str
    down: str
    gate: Optional[str] = None
    kind: Optional[str] = None
    pre_norm: Optional[Norm] = None
    post_norm: Optional[Norm] = None
    scale: Optional[str] = None
    multiplier: Optional[str] = None
    gate_first: bool = True
    experts: Optional[Experts] = None

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", "experts" if self.experts is not None else
                               "gated" if self.gate is not None else "plain")
        if (self.kind == "experts") != (self.experts is not None):
            raise ValueError("FeedForward: an experts FF names its Experts (experts=...), and only an experts FF does")
        if self.kind not in FF_KINDS:
            raise ValueError(f"FeedForward: kind must be one of {FF_KINDS}, got {self.kind!r}")
        if self.kind == "gated" and self.gate is None:
            raise ValueError("FeedForward: a gated FF names its gate projection")
        if self.kind == "fused_gate_up" and self.gate is not None:
            raise ValueError("FeedForward: a fused_gate_up FF has one projection (up) holding the gate and up halves; "
                             "it names no separate gate")


@dataclass(frozen=True)
class Layer:
    r"""One layer: its branches and how they join the residual stream.

    Attributes:
        attention: the self-attention branch.
        ff: the feed-forward branch.
        parallel: both branches read the layer input (y = x + Attn(..x..) + FF(..x..)).
        stream_norms: post-LN norms on the residual stream, one after each branch's residual
            join, in order (BERT's two LayerNorms; three in a post-LN decoder layer with
            cross-attention); empty for the other kinds.
        cross_attention: the cross-attention branch of an encoder-decoder's decoder layer
            (one more :class:`Attention`, run between the self-attention and the
            feed-forward, its keys and values from the encoder output), or None.
        mixers: a hybrid model's other token mixers, ``(layer type, Attention)``: a layer whose
            type (``config.<mixer_types>[i]``) is listed runs that mixer instead of ``attention``
            (LFM2: ``(("conv", short_conv),)``); the norms and the feed-forward are the same.
        mixer_types: the config attribute listing each layer's type (LFM2: ``"layer_types"``), or None.
        single_branches: a model whose layers are each ONE branch behind its own norm, y = x + B(N(x))
            (Nemotron-H): ``(layer type, branch)``, the branch an :class:`Attention` (a mixing branch:
            attention or a linear mixer) or a :class:`FeedForward`, with its ``pre_norm`` N; the layer's
            type is ``config.<mixer_types>[i]``. ``attention`` and ``ff`` are then the family's defaults
            (what its docs row shows); each layer's description (:meth:`ArchitectureSpec.for_layer`) has
            only its own branch (:attr:`branch`). Empty: every layer has both branches.
        branch: ``"self_attention"`` or ``"feed_forward"``: the one branch of a single-branch layer's
            description (its other branch is absent, decomposed as identically zero:
            :mod:`captum_normattr.decompose.kinds.single_branch`); None: the layer has both.
        per_layer_input: Gemma 4's layer (``docs/frontier.md``, "Gemma 4"): the config attribute of
            the width of the per-layer inputs (``"hidden_size_per_layer_input"``; 0 in a config
            without them), or None. Such a sandwich layer adds a third residual branch
            N_ple((act(z W_gate) * e_t) W_proj) on a per-layer input e_t of the token, multiplies
            its output by a learned scalar (``layer_scalar``), normalises its values per head
            (``v_norm``), may reuse an earlier layer's keys and values (``num_kv_shared_layers``)
            or its keys as values (``attention_k_eq_v``) and may put experts beside its dense
            feed-forward (``enable_moe_block``); its topology is ``sandwich_per_layer_input``,
            whose layer kind reads those modules by their Gemma 4 names
            (:mod:`captum_normattr.decompose.kinds.per_layer_input`).
    """

    attention: Attention
    ff: FeedForward
    parallel: bool = False
    stream_norms: Tuple[Norm, ...] = ()
    cross_attention: Optional[Attention] = None
    mixers: Tuple[Tuple[str, Attention], ...] = ()
    mixer_types: Optional[str] = None
    single_branches: Tuple[Tuple[str, Any], ...] = ()
    branch: Optional[str] = None
    per_layer_input: Optional[str] = None

    def branches(self) -> Tuple[Tuple[str, Any], ...]:
        r"""(name, branch) in the order the layer runs them: self-attention, cross-attention, feed-forward
        (a single-branch layer's description: its one branch)."""
        if self.branch == "self_attention":
            return (("self_attention", self.attention),)
        if self.branch == "feed_forward":
            return (("feed_forward", self.ff),)
        out = [("self_attention", self.attention)]
        if self.cross_attention is not None:
            out.append(("cross_attention", self.cross_attention))
        out.append(("feed_forward", self.ff))
        return tuple(out)


@dataclass(frozen=True)
class ClassifierHead:
    r"""A sequence-classification head: logits = N(act(h_p W_d + b_d)) W_c + b_c.

    ``h_p`` is the head's input at token ``position``: the last layer's output (post-LN
    models), or the final norm's output (models whose :class:`Head` names a final norm). Paths
    are from the model with the head (``*ForSequenceClassification``).

    Attributes:
        dense: the first dense layer W_d (DeBERTa: ``pooler.dense``; BERT: ``base_model.pooler.dense``).
        classifier: the output projection W_c.
        activation: the activation module's path, or None (see ``activation_config`` and
            ``activation_fn``).
        activation_config: the config attribute naming a transformers activation that the
            head applies by name (DeBERTa's ``ContextPooler``: ``ACT2FN[config.pooler_hidden_act]``),
            or None.
        activation_fn: a fixed elementwise function the head's forward calls, by its name in
            :data:`HEAD_FUNCTIONS` (RoBERTa's ``torch.tanh``, DistilBERT's ``nn.ReLU`` applied
            as ``relu``), or None.
        norm: a norm after the activation (ModernBERT's ``head.norm``), or None.
        position: the token the head reads.
        pooling_config: the config attribute choosing how the head pools the tokens
            (ModernBERT's ``classifier_pooling``: ``"cls"`` reads ``position``, ``"mean"`` the
            mean over the real tokens; another value is refused by the methods that need the
            head), or None: always ``position``.
    """

    dense: str
    classifier: str
    activation: Optional[str] = None
    activation_config: Optional[str] = None
    norm: Optional[Norm] = None
    position: int = 0
    pooling_config: Optional[str] = None
    activation_fn: Optional[str] = None

    def __post_init__(self) -> None:
        named = [a for a in (self.activation, self.activation_config, self.activation_fn) if a is not None]
        if len(named) != 1:
            raise ValueError(f"ClassifierHead {self.dense!r}: name the activation module, its config attribute "
                             "or a fixed function (one)")
        if self.activation_fn is not None and self.activation_fn not in HEAD_FUNCTIONS:
            raise ValueError(f"ClassifierHead {self.dense!r}: unknown activation_fn {self.activation_fn!r} "
                             f"(known: {', '.join(HEAD_FUNCTIONS)})")


#: How an image classifier reads the final-norm rows (:attr:`ImageClassifierHead.readout`).
IMAGE_READOUTS: Tuple[str, ...] = ("cls", "mean_of_heads", "cls_and_patch_mean")


@dataclass(frozen=True)
class ImageClassifierHead:
    r"""An image classifier linear in the final-norm output y of some tokens: logits = sum_r y_{rows[r]} W_r + b.

    Attributes:
        model_class: the class name of the models with this head (a family can have several:
            DeiT with and without its distillation head).
        classifiers: paths of the linear classifiers, from the model with the head.
        readout: ``"cls"`` (logits = W y_[CLS] + b), ``"mean_of_heads"`` (one classifier per
            prefix token, [CLS] and [DIST], the logits their mean: the distilled DeiT) or
            ``"cls_and_patch_mean"`` (W [y_[CLS]; mean of the patch outputs] + b: DINOv2, whose
            registers are not patches).
        description: the head in words (results and errors say it).
    """

    model_class: str
    classifiers: Tuple[str, ...]
    readout: str
    description: str

    def __post_init__(self) -> None:
        if self.readout not in IMAGE_READOUTS:
            raise ValueError(f"ImageClassifierHead {self.model_class}: readout must be one of {IMAGE_READOUTS}")
        if len(self.classifiers) != (2 if self.readout == "mean_of_heads" else 1):
            raise ValueError(f"ImageClassifierHead {self.model_class}: readout {self.readout!r} takes "
                             f"{2 if self.readout == 'mean_of_heads' else 1} classifier(s), got {self.classifiers}")


@dataclass(frozen=True)
class Head:
    r"""What follows the last layer.

    Attributes:
        final_norm: the final norm (from the base model), or None.
        lm_head: the unembedding (from the model with the head), or None.
        logit_multiplier: config attribute of a factor the model multiplies its logits by
            (Cohere's ``logit_scale``), or None.
        logit_divisor: config attribute of a divisor of the logits (Granite's
            ``logits_scaling``), or None.
        projection: a linear map (no bias) between the final norm (or, without one, the last
            layer) and the LM head, from the base model (OPT's ``decoder.project_out`` when
            ``word_embed_proj_dim != hidden_size``): folded into the unembedding, so the
            explained logit stays the model's own; None, or a path whose module is None
            (OPT with equal widths): no projection.
        final_softcap: config attribute of the final-logit soft-cap
            ``cap * tanh(logits / cap)`` (Gemma 2's ``final_logit_softcapping``), or None.
            A tanh is not linear: the decompositions explain the pre-cap logit, say so in
            the result, and report the capped one beside it.
        classifier: the sequence-classification head (:class:`ClassifierHead`) of the
            family's ``*ForSequenceClassification`` models, or None (no head DecompX follows).
        image_classifiers: the image-classification heads of a vision family's classifier
            classes (:class:`ImageClassifierHead`), or empty.
    """

    final_norm: Optional[Norm] = None
    lm_head: Optional[str] = None
    logit_multiplier: Optional[str] = None
    logit_divisor: Optional[str] = None
    final_softcap: Optional[str] = None
    projection: Optional[str] = None
    classifier: Optional[ClassifierHead] = None
    image_classifiers: Tuple[ImageClassifierHead, ...] = ()


@dataclass(frozen=True)
class Inputs:
    r"""Input quirks.

    Attributes:
        max_positions_offset: positions the model reserves (RoBERTa: padding_idx + 1 -> -1).
        token_types: ``"embedding"`` (a token-type embedding of ``type_vocab_size`` rows),
            ``"word_embeddings"`` (GPT-2 embeds token types with its word embeddings).
        prefix_tokens: vision: the tokens before the first patch ([CLS], DeiT's distillation
            token), not counting registers (``config.num_register_tokens`` is added).
        prefix_names: their display names.
        interpolates_positions: vision: ``"flag"`` (the model takes
            ``interpolate_pos_encoding``) or ``"always"`` (DINOv2).
        embedding_scale: what the model multiplies the token embeddings by before the first
            layer (Gemma: ``"sqrt(hidden_size)"``), for the docs; the decompositions start at
            the first layer's real input, so it needs no handling.
        embedding_norm: a norm applied to the embeddings before the first layer (BLOOM's
            ``word_embeddings_layernorm``), for the docs: the decompositions start at the
            first layer's real input, the embeddings after that norm.
    """

    max_positions_offset: int = 0
    token_types: str = "embedding"
    prefix_tokens: int = 1
    prefix_names: Tuple[str, ...] = ("[CLS]",)
    interpolates_positions: str = "flag"
    embedding_scale: Optional[str] = None
    embedding_norm: Optional[str] = None


@dataclass(frozen=True)
class Variant:
    r"""Another description for the models whose config sets ``attribute`` to ``value``.

    Examples: DINOv2 with ``use_swiglu_ffn=True`` (a gated FF); GPT-NeoX with
    ``use_parallel_residual=False`` (sequential pre-LN); ``value`` ``...`` selects any true value
    (Granite 4 with ``num_local_experts > 0``). The variant's own ``spec.variants``
    refine it (Falcon: ``new_decoder_architecture`` chooses the grouped QKV layout, then
    ``num_ln_in_parallel_attn`` the norms); the first matching variant wins at each level.
    """

    attribute: str
    value: Any
    spec: "ArchitectureSpec"


@dataclass(frozen=True)
class ArchitectureSpec:
    r"""One model family, described as data (see the module docstring).

    Attributes:
        family: readable family name.
        model_types: the ``config.model_type`` values it serves.
        layers: path of the layer list, from the base model.
        layer: the :class:`Layer` description.
        causal: causal self-attention (decoders): position ids are computed from the mask so
            that a left-padded example gets the positions it has alone.
        modality: ``"text"`` (token ids) or ``"image"`` (pixel values).
        transposed_weights: the projections are GPT-2 ``Conv1D`` ([in, out] weights).
        head: the :class:`Head`.
        inputs: the :class:`Inputs` quirks.
        variants: :class:`Variant` descriptions chosen by a config attribute.
        refused_configs: ``(config attribute, value, why)``: configs of the family that no
            description covers, refused with ``why`` (:meth:`refusal`): the config sets the
            attribute to ``value`` (BLOOM's ``apply_residual_connection_post_layernorm=True``),
            or, with ``value`` ``...``, to any true value (DeBERTa's ``conv_kernel_size``).
        notes: one line for the docs' table (what is special about the family).
        decoder_layers: an encoder-decoder's second stack: the path of the decoder's layer
            list, from the model holding ``encoder`` and ``decoder`` (``layers`` is then the
            encoder's), or None for a one-stack model.
        decoder_layer: the decoder stack's :class:`Layer` (with its ``cross_attention``).
    """

    family: str
    model_types: Tuple[str, ...]
    layers: str
    layer: Layer
    causal: bool = False
    modality: str = "text"
    transposed_weights: bool = False
    head: Head = field(default_factory=Head)
    inputs: Inputs = field(default_factory=Inputs)
    variants: Tuple[Variant, ...] = ()
    refused_configs: Tuple[Tuple[str, Any, str], ...] = ()
    notes: str = ""
    decoder_layers: Optional[str] = None
    decoder_layer: Optional[Layer] = None

    def __post_init__(self) -> None:
        if (self.decoder_layers is None) != (self.decoder_layer is None):
            raise ValueError(f"{self.family}: an encoder-decoder names both decoder_layers and decoder_layer")
        if self.layer.cross_attention is not None:
            raise ValueError(f"{self.family}: only an encoder-decoder's decoder layer has a cross-attention branch")
        if self.decoder_layer is not None and self.decoder_layer.cross_attention is None:
            raise ValueError(f"{self.family}: an encoder-decoder's decoder layer has a cross-attention branch")
        for _, _, lay in self.stacks:
            self._check_layer(lay)
        if self.modality not in ("text", "image"):
            raise ValueError(f"{self.family}: modality must be 'text' or 'image', got {self.modality!r}")

    def _check_layer(self, lay: Layer) -> None:
        if bool(lay.mixers or lay.single_branches) != (lay.mixer_types is not None):
            raise ValueError(f"{self.family}: a hybrid layer names its mixers (or single branches) and the config "
                             "attribute of the layer types (mixer_types) together")
        self._check_single_branch(lay)
        if lay.stream_norms and (any(b.pre_norm for _, b in lay.branches()) or lay.parallel):
            raise ValueError(f"{self.family}: a post-LN layer (stream_norms) has no branch pre-norms and no parallel branches")
        if lay.stream_norms and len(lay.stream_norms) != len(lay.branches()):
            raise ValueError(f"{self.family}: a post-LN layer names one stream norm per branch "
                             f"({len(lay.branches())}: after each residual join)")
        if not lay.stream_norms and lay.attention.post_norm is None and any(b.pre_norm is None for _, b in lay.branches()):
            raise ValueError(
                f"{self.family}: a layer without stream norms needs a pre-norm on every branch, or post-norms on every "
                "branch (a sandwich layer, whose pre-norms may be missing: OLMo 2)"
            )
        if lay.per_layer_input is not None and (lay.attention.post_norm is None or lay.parallel or lay.mixers
                                                 or lay.ff.kind not in ("gated", "fused_gate_up")):
            raise ValueError(f"{self.family}: a per-layer-input layer is a sandwich layer (post-norms on both branches) "
                             "with a gated feed-forward and one mixer")
        if lay.parallel and (lay.attention.post_norm or lay.ff.post_norm or lay.cross_attention is not None):
            raise ValueError(f"{self.family}: parallel branches with post-norms or cross-attention are not supported")
        if len({b.post_norm is None for _, b in lay.branches()}) > 1:
            raise ValueError(f"{self.family}: a sandwich layer has post-norms on every branch")
        if lay.ff.kind == "experts" and (lay.parallel or lay.stream_norms or lay.ff.post_norm is not None
                                          or lay.ff.scale is not None):
            raise ValueError(f"{self.family}: a mixture of experts is supported in pre-LN layers without a post-norm "
                             "or layer scale on its branch (a residual multiplier is folded into the experts' W_down)")
        for name, branch in lay.branches():
            if branch.multiplier is not None and (branch.post_norm is not None or branch.scale is not None):
                raise ValueError(f"{self.family}: the {name} branch's multiplier cannot be combined with a post-norm "
                                 "or a layer scale (it is folded into the output projection)")

    def _check_single_branch(self, lay: Layer) -> None:
        r"""The rules of single-branch layers (:attr:`Layer.single_branches`, :attr:`Layer.branch`)."""
        if lay.branch is not None and lay.branch not in SINGLE_BRANCH_NAMES:
            raise ValueError(f"{self.family}: a single-branch layer's branch is one of {SINGLE_BRANCH_NAMES}, "
                             f"got {lay.branch!r}")
        if not (lay.single_branches or lay.branch is not None):
            return
        if lay.single_branches and (lay.mixers or lay.branch is not None):
            raise ValueError(f"{self.family}: single-branch layers name each type's branch in single_branches, "
                             "without mixers")
        if lay.parallel or lay.stream_norms or lay.cross_attention is not None:
            raise ValueError(f"{self.family}: a single-branch layer has no parallel branches, stream norms or "
                             "cross-attention")
        for name, branch in lay.single_branches + lay.branches():  # each type's branch, and the defaults
            if not isinstance(branch, (Attention, FeedForward)):
                raise ValueError(f"{self.family}: the single branch {name!r} is an Attention or a FeedForward, got "
                                 f"{type(branch).__name__}")
            if branch.pre_norm is None or branch.post_norm is not None or branch.scale is not None:
                raise ValueError(f"{self.family}: a single-branch layer's branch ({name!r}) has its "
                                 "pre-norm, and no post-norm or layer scale")

    # --- hybrid layers: one mixer per layer -------------------------------------------
    def for_layer(self, layer: Any = None, layer_type: Optional[str] = None) -> "ArchitectureSpec":
        r"""This description with the mixer of one layer of a hybrid model as its attention branch.

        Args:
            layer: the layer module (the mixer whose module, value projection and convolution it has
                is chosen when ``layer_type`` is None), or None.
            layer_type: the layer's entry of ``config.<mixer_types>``, or None.

        Returns:
            ``self`` for a model with one mixer (or a layer of the default mixer's type); else a copy
            whose :attr:`Layer.attention` is the layer's mixer and without other mixers. For a
            single-branch model (:attr:`Layer.single_branches`): the description of the layer's one
            branch (:meth:`_single_branch_layer`).

        Raises:
            ValueError: the layer's type names no mixer and the layer lacks the default mixer's module.
        """
        lay = self.layer
        if lay.single_branches:
            return self._single_branch_layer(layer, layer_type)
        if not lay.mixers:
            return self
        chosen = dict(lay.mixers).get(layer_type) if layer_type is not None else None
        if chosen is None and layer is not None and layer_type is None:
            for _, mixer in lay.mixers:
                if _has_parts(layer, mixer) and not _has_parts(layer, lay.attention):
                    chosen = mixer
                    break
        if chosen is None:
            if layer is not None and not _has_parts(layer, lay.attention):
                raise ValueError(f"{self.family}: layer of type {layer_type!r} has neither the attention module "
                                 f"{lay.attention.module!r} nor one of the mixers {[m.module for _, m in lay.mixers]}")
            chosen = lay.attention
        return replace(self, layer=replace(lay, attention=chosen, mixers=(), mixer_types=None))

    def _single_branch_layer(self, layer: Any, layer_type: Optional[str]) -> "ArchitectureSpec":
        r""":meth:`for_layer` of a single-branch model: the description of the layer's one branch (:attr:`Layer.branch`).

        The branch is ``layer_type``'s; without a type, the first listed branch whose parts the layer has; with
        neither, ``self``.

        Raises:
            ValueError: a type the description does not list, or a layer with no listed branch's parts.
        """
        lay = self.layer
        branches = dict(lay.single_branches)
        if layer_type is not None:
            chosen = branches.get(layer_type)
            if chosen is None:
                raise ValueError(f"{self.family}: layer type {layer_type!r} is not one of the described single-branch "
                                 f"layer types {list(branches)}")
        elif layer is not None:
            chosen = next((b for _, b in lay.single_branches if _has_branch_parts(layer, b)), None)
            if chosen is None:
                raise ValueError(f"{self.family}: the layer has the parts of none of the described single branches "
                                 f"(layer types {list(branches)})")
        else:
            return self
        if isinstance(chosen, Attention):
            one = replace(lay, attention=chosen, branch="self_attention", single_branches=(), mixer_types=None)
        else:
            one = replace(lay, ff=chosen, branch="feed_forward", single_branches=(), mixer_types=None)
        return replace(self, layer=one)

    # --- the stacks and the topology --------------------------------------------------
    @property
    def is_encoder_decoder(self) -> bool:
        r"""True for a two-stack (encoder-decoder) description."""
        return self.decoder_layer is not None

    @property
    def stacks(self) -> Tuple[Tuple[str, str, Layer], ...]:
        r"""(name, path of the layer list, :class:`Layer`) per stack: ``("layers", ...)`` for a
        one-stack model; ``("encoder", ...), ("decoder", ...)`` for an encoder-decoder."""
        if self.decoder_layer is None:
            return (("layers", self.layers, self.layer),)
        return (("encoder", self.layers, self.layer), ("decoder", self.decoder_layers, self.decoder_layer))

    @property
    def topology(self) -> str:
        r"""The layer's topology kind, one of :data:`TOPOLOGIES`, chosen from the description."""
        lay = self.layer
        if lay.single_branches or lay.branch is not None:
            return "single_branch"
        if lay.stream_norms:
            return "post_ln"
        if lay.parallel:
            return "parallel"
        if lay.per_layer_input is not None:
            return "sandwich_per_layer_input"
        if lay.attention.post_norm is not None:
            return "sandwich"
        return "pre_ln"

    @property
    def pre_ln(self) -> bool:
        r"""True when the norms sit inside the branches (every kind but ``post_ln``)."""
        return self.topology != "post_ln"

    # --- the names the engine reads (one per recorded tensor) ------------------------------
    def refusal(self, config: Any) -> Optional[str]:
        r"""Why this family's model with ``config`` is not supported (:attr:`refused_configs`), or None."""
        for attribute, value, why in self.refused_configs:
            got = getattr(config, attribute, None) if config is not None else None
            if (bool(got) if value is ... else got == value and hasattr(config, attribute)):
                return f"{self.family} with {attribute}={got!r} is not supported: {why}"
        return None

    @property
    def norm1(self) -> Norm:
        r"""The first norm: the attention pre-norm, or post-LN's norm after the attention residual.

        A branch without a pre-norm (OLMo 2) gives an ``identity`` norm at the attention
        module (recorded at its input)."""
        if self.layer.stream_norms:
            return self.layer.stream_norms[0]
        return self.layer.attention.pre_norm or Norm(self.layer.attention.module, "identity")

    @property
    def norm2(self) -> Norm:
        r"""The second norm: the feed-forward pre-norm, or post-LN's norm after the FF residual.

        A branch without a pre-norm gives an ``identity`` norm at the FF's first projection."""
        if self.layer.stream_norms:
            return self.layer.stream_norms[1]
        return self.layer.ff.pre_norm or Norm(self.layer.ff.up, "identity")

    @property
    def ln1(self) -> str:
        return self.norm1.path

    @property
    def ln2(self) -> str:
        return self.norm2.path

    @property
    def norm_kind(self) -> str:
        return self.norm1.kind

    @property
    def attention(self) -> str:
        return self.layer.attention.module

    @property
    def attn_out(self) -> str:
        return self.layer.attention.out

    @property
    def attn_value(self) -> Optional[str]:
        v = self.layer.attention.value
        return None if v is None else v.path

    @property
    def attn_value_slice(self) -> Optional[Tuple[int, int]]:
        v = self.layer.attention.value
        return None if v is None or v.layout != "fused" else (v.index, v.count)

    @property
    def attn_scale(self) -> Optional[str]:
        return self.layer.attention.scale

    @property
    def ff_in(self) -> str:
        return self.layer.ff.up

    @property
    def ff_gate(self) -> Optional[str]:
        return self.layer.ff.gate

    @property
    def ff_act(self) -> str:
        return self.layer.ff.act

    @property
    def ff_out(self) -> str:
        return self.layer.ff.down

    @property
    def ff_scale(self) -> Optional[str]:
        return self.layer.ff.scale

    @property
    def final_norm(self) -> Optional[str]:
        return None if self.head.final_norm is None else self.head.final_norm.path

    @property
    def lm_head(self) -> Optional[str]:
        return self.head.lm_head

    @property
    def max_positions_offset(self) -> int:
        return self.inputs.max_positions_offset

    def norms(self, layer: Optional[Layer] = None) -> Tuple[Norm, ...]:
        r"""Every norm of one layer (default: :attr:`layer`), in the order the layer applies them."""
        lay = self.layer if layer is None else layer
        if lay.stream_norms:
            return tuple(lay.stream_norms)
        out = []
        for _, branch in lay.branches() + lay.single_branches:
            out += [branch.pre_norm, branch.post_norm]
        return tuple(n for n in out if n is not None)

    def mixer_summary(self) -> str:
        r"""The layers' token mixers, readable, for the docs' table's mixer column.

        Returns:
            e.g. ``"softmax attention"``, ``"softmax attention (sinks)"``,
            ``"softmax attention (latent values)"`` or, for a hybrid model whose layers pick their
            mixer by layer type, ``"softmax attention + short convolution, per layer type"``.
        """
        def one(att: "Attention") -> str:
            if att.mixer == "short_conv":
                return "short convolution"
            if att.mixer == "gated_delta_net":
                return "Gated DeltaNet"
            if att.mixer == "kimi_delta":
                return "Kimi delta attention"
            if att.mixer == "mamba2":
                return "Mamba-2 (state space)"
            extras = [name for name, on in (("output gate", bool(att.output_gate)), ("sinks", bool(att.sinks)),
                                            ("latent values", att.value is not None and att.value.layout == "latent"),
                                            ("soft-cap", bool(att.softcap))) if on]
            return "softmax attention" + (f" ({', '.join(extras)})" if extras else "")

        names: List[str] = []
        singles = [b for _, b in self.layer.single_branches if isinstance(b, Attention)]
        for att in ([self.layer.attention] if not singles else []) + [m for _, m in self.layer.mixers] + singles:
            if one(att) not in names:
                names.append(one(att))
        return " + ".join(names) + (", per layer type" if self.layer.mixers or self.layer.single_branches else "")

    def features(self) -> Tuple[str, ...]:
        r"""Readable features for the docs' table (norm type, FF type, layouts, heads)."""
        lay, out = self.layer, []
        out.append({"post_ln": "post-LN", "pre_ln": "pre-LN", "sandwich": "sandwich norms",
                    "parallel": "parallel attention + FF",
                    "single_branch": "one branch per layer (mixer or FF) behind its own norm",
                    "sandwich_per_layer_input": "sandwich norms + per-layer inputs"}[self.topology])
        kinds = {n.kind for n in self.norms()}
        out.append("RMSNorm" if kinds == {"rmsnorm"} else "LayerNorm" if kinds == {"layernorm"} else "mixed norms")
        if any(n.weight_offset for n in self.norms()):
            out.append("1 + w gain")
        if not lay.stream_norms and (lay.attention.pre_norm is None or lay.ff.pre_norm is None):
            out.append("no pre-norms")
        out.append({"plain": "plain FF", "gated": "gated FF", "fused_gate_up": "fused gate-up FF",
                    "experts": "top-k gated experts"}.get(lay.ff.kind, lay.ff.kind))
        if lay.ff.experts is not None and lay.ff.experts.kind == "clamped_swiglu":
            out.append("clamped SwiGLU experts with biases")
        if lay.ff.experts is not None and lay.ff.experts.kind == "input_scaled":
            out.append("experts on the routing-scaled input")
        for ff in dict.fromkeys(b for _, b in lay.single_branches if isinstance(b, FeedForward) and b.experts):
            out.append("expert layers" + (" (non-gated ReLU² experts, a shared expert)"
                                          if ff.experts.kind == "squared_relu" else ""))
        if lay.ff.experts is not None and lay.ff.experts.shared is not None:
            out.append("sigmoid-gated shared expert" if lay.ff.experts.shared_gate else "shared expert")
        v = lay.attention.value
        if v is not None and v.layout != "plain":
            out.append({"fused_gqa": "fused QKV with GQA", "grouped": "QKV grouped per key/value head",
                        "latent": "multi-head latent attention"}.get(v.layout, f"{v.layout} QKV"))
        if lay.attention.probabilities == "module_output":
            out.append("attention computed in its module")
        if lay.attention.softcap:
            out.append("attention soft-cap")
        if lay.attention.sinks:
            out.append("attention sinks")
        mixers = lay.mixers + tuple((t, b) for t, b in lay.single_branches if isinstance(b, Attention) and b.mixer != "softmax")
        for mixer in dict.fromkeys(m for _, m in mixers):  # once each (a single-branch mixer may serve two type names)
            out.append({"short_conv": "gated short-convolution mixer layers",
                        "gated_delta_net": "Gated DeltaNet mixer layers",
                        "kimi_delta": "Kimi delta attention mixer layers",
                        "mamba2": "Mamba-2 mixer layers"}.get(mixer.mixer, f"{mixer.mixer} mixer layers"))
        if lay.attention.output_gate:
            out.append("attention output gated per channel")
        if lay.attention.probabilities == "returned":
            out.append("attention inside its module")
        if self.head.final_softcap:
            out.append("final-logit soft-cap")
        if self.head.logit_multiplier or self.head.logit_divisor:
            out.append("logit scaling")
        if lay.attention.scale:
            out.append("layer scale")
        if lay.attention.multiplier or lay.ff.multiplier:
            out.append("residual multiplier")
        if self.inputs.embedding_scale:
            out.append("embedding scale")
        if self.inputs.embedding_norm:
            out.append("embedding norm")
        if self.is_encoder_decoder:
            out.append("encoder-decoder with cross-attention")
        else:
            out.append("causal" if self.causal else "bidirectional")
        return tuple(out)
