r"""Encoder-decoder models: declarative adapters and the recording of one forward pass for ALTI+.

An encoder-decoder has three kinds of attention block: encoder self-attention, decoder
(causal) self-attention and decoder cross-attention over the encoder output. For each
block ALTI+ needs (``docs/seq2seq.md``):

- the attention probabilities per head (B, H, Q, K) (T5's relative position bias and the
  masks included) and the value states per head (B, H, K, Dh), value bias inside;
- the output projection W_O and b_O;
- the residual r_i that the block adds to the attention output;
- the real block output y_i (post-LN: the output of the norm that follows the sum, and that
  norm's input u_i and parameters; pre-LN: the raw residual stream after the block).

The probabilities and values come from the package's recording attention function
(:mod:`captum_normattr.models.capture.attention`; registered in transformers' ``AttentionInterface``),
the rest from forward hooks. The recording is streamed, as the decoder-only and encoder
recorder's: as soon as a block's last tensor is recorded (on a forward hook, while the model
runs on), its :class:`BlockTensors` are handed to the caller's ``on_block`` callback and
the recorder drops them, so at most one block's probabilities are alive at a time. As there, everything (hooks, the attention implementation,
the training flags) is restored when the call ends, also when it raises. All architecture
knowledge sits in the families' descriptions (:mod:`captum_normattr.arch.families.seq2seq`, two
stacks, a cross-attention branch); :func:`seq2seq_adapter` derives the blocks from them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch import registry as arch_registry
from captum_normattr.arch.spec import ArchitectureSpec, Layer
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.records import NormParams
from captum_normattr.models.adapters import UnsupportedModelError, get_path, linear_params
from captum_normattr.models.capture.record import norm_params
from captum_normattr.models.capture.recorder import AttentionRecords
from captum_normattr.models.capture.session import recorder_session

__all__ = [
    "BLOCKS",
    "BlockSpec",
    "BlockTensors",
    "SEQ2SEQ_ADAPTERS",
    "Seq2SeqAdapter",
    "Seq2SeqRecorder",
    "attention_blocks",
    "get_seq2seq_adapter",
    "seq2seq_adapter",
    "is_seq2seq",
    "seq2seq_base",
    "recording_seq2seq",
    "supported_seq2seq_families",
]

#: the three attention blocks of an encoder-decoder layer stack, in recording order
BLOCKS: Tuple[str, ...] = ("encoder_self", "decoder_self", "decoder_cross")


@dataclass(frozen=True)
class BlockSpec:
    r"""Where one attention block keeps its pieces (paths from one layer module).

    Attributes:
        attention: the module that calls the attention function (records probs and values).
        attn_out: the output projection W_O (with b_O).
        residual: (path, side): the module whose input (``"in"``, its ``hidden_states``
            argument) or output (``"out"``) is the residual r the block adds.
        output: (path, side): the real block output y (post-LN: the norm's output; pre-LN:
            the raw residual stream after the block).
        norm: post-LN only: the norm applied to the sum (its input u gives the scale).
    """

    attention: str
    attn_out: str
    residual: Tuple[str, str]
    output: Tuple[str, str]
    norm: Optional[str] = None


@dataclass(frozen=True)
class Seq2SeqAdapter:
    r"""What ALTI+ reads of one encoder-decoder family: its stacks and three attention blocks.

    Derived from the family's :class:`~captum_normattr.arch.spec.ArchitectureSpec` (two stacks,
    the decoder layer with a cross-attention branch) by :func:`seq2seq_adapter`; nothing here
    is written by hand.

    Attributes:
        family: readable family name.
        model_types: the ``config.model_type`` values it serves.
        encoder_layers / decoder_layers: paths of the layer lists, from the model holding both stacks.
        encoder_self / decoder_self / decoder_cross: the three :class:`BlockSpec`.
        stream_norms: a norm on the stream follows every branch's join (post-LN, its layer kind's
            ``CaptureRecipe.stream_norms``): a block's output is that norm's; else the raw stream.
        norm_kind: ``"layernorm"`` or ``"rmsnorm"`` (T5's scale-only norm).
        positions: how the family places tokens, for the docs and padding notes.
        spec: the description it was derived from.
    """

    family: str
    model_types: Tuple[str, ...]
    encoder_layers: str
    decoder_layers: str
    encoder_self: BlockSpec
    decoder_self: BlockSpec
    decoder_cross: BlockSpec
    stream_norms: bool
    norm_kind: str = "layernorm"
    positions: str = ""
    spec: Optional[ArchitectureSpec] = None

    def block(self, name: str) -> BlockSpec:
        return getattr(self, name)


def attention_blocks(layer: Layer, stream_norms: bool) -> Tuple[BlockSpec, ...]:
    r"""One :class:`BlockSpec` per attention branch of a layer description, in the layer's order.

    With ``stream_norms`` (post-LN): the residual is what the branch module reads, the block
    output the stream norm after the join (that norm's input gives its scale). Without (pre-LN):
    the residual is the raw stream entering the branch's pre-norm; the block output the raw
    stream entering the next branch's pre-norm.
    """
    branches = layer.branches()
    blocks = []
    for i, (name, branch) in enumerate(branches):
        if name == "feed_forward":
            continue
        if stream_norms:
            norm = layer.stream_norms[i].path
            blocks.append(BlockSpec(branch.module, branch.out, (branch.module, "in"), (norm, "out"), norm=norm))
        else:
            nxt = branches[i + 1][1]
            blocks.append(BlockSpec(branch.module, branch.out, (branch.pre_norm.path, "in"), (nxt.pre_norm.path, "in")))
    return tuple(blocks)


def seq2seq_adapter(spec: ArchitectureSpec) -> Seq2SeqAdapter:
    r"""The :class:`Seq2SeqAdapter` of an encoder-decoder description.

    Raises:
        UnsupportedModelError: for a one-stack description, or a topology ALTI+ does not decompose
            (the post-LN and pre-LN kinds are supported).
    """
    if not spec.is_encoder_decoder:
        raise UnsupportedModelError(f"{spec.family} is not an encoder-decoder description (one stack)")
    if spec.topology not in ("post_ln", "pre_ln"):
        raise UnsupportedModelError(f"ALTI+ decomposes post-LN and pre-LN encoder-decoders; {spec.family} is {spec.topology}")
    stream_norms = layer_kind(spec.topology, spec.family).capture.stream_norms
    (encoder_self,) = attention_blocks(spec.layer, stream_norms)
    decoder_self, decoder_cross = attention_blocks(spec.decoder_layer, stream_norms)
    kinds = {n.kind for n in spec.norms(spec.layer) + spec.norms(spec.decoder_layer)}
    return Seq2SeqAdapter(
        spec.family, spec.model_types, spec.layers, spec.decoder_layers, encoder_self, decoder_self, decoder_cross,
        stream_norms=stream_norms, norm_kind=kinds.pop() if len(kinds) == 1 else "layernorm", positions=spec.notes, spec=spec,
    )


def _adapters() -> Dict[str, Seq2SeqAdapter]:
    return {k: seq2seq_adapter(s) for k, s in arch_registry.ENCODER_DECODERS.items()}


#: The registered encoder-decoder families' adapters, by registry key (derived from the registry when imported;
#: :func:`get_seq2seq_adapter` reads the registry itself, so later registrations count).
SEQ2SEQ_ADAPTERS: Dict[str, Seq2SeqAdapter] = _adapters()


def supported_seq2seq_families() -> str:
    r"""Readable list of the registered encoder-decoder families and their model types."""
    return ", ".join(f"{s.family} ({'/'.join(s.model_types)})" for s in arch_registry.ENCODER_DECODERS.values())


def is_seq2seq(model: nn.Module) -> bool:
    r"""True for an encoder-decoder ``transformers`` model (``config.is_encoder_decoder``)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def get_seq2seq_adapter(model: nn.Module) -> Seq2SeqAdapter:
    r"""The adapter of an encoder-decoder model, from its ``config.model_type``.

    Raises:
        UnsupportedModelError: for other models; the message names the supported families.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = arch_registry.lookup_encoder_decoder(model_type, config)
    if spec is not None:
        return seq2seq_adapter(spec)
    kind = "encoder-decoder model" if is_seq2seq(model) else "model (not an encoder-decoder)"
    raise UnsupportedModelError(
        f"ALTI+ does not support the {kind} type {model_type!r} ({type(model).__name__}). "
        f"Supported encoder-decoder families: {supported_seq2seq_families()}. "
        "(LED, ProphetNet, BigBird-Pegasus, FSMT, NLLB-MoE, UMT5, Switch Transformers and the other encoder-decoders "
        "are not supported; decoder-only and encoder-only models are explained by ALTIAttribution.)"
    )


def seq2seq_base(model: nn.Module) -> nn.Module:
    r"""The module holding ``encoder`` and ``decoder`` (``model.model`` for BART's heads, the model itself for T5's).

    Raises:
        UnsupportedModelError: for a model without both (e.g. ``T5EncoderModel``).
    """
    if hasattr(model, "encoder") and hasattr(model, "decoder"):
        return model
    base = getattr(model, "base_model", model)
    if hasattr(base, "encoder") and hasattr(base, "decoder"):
        return base
    raise UnsupportedModelError(f"{type(model).__name__} has no encoder and decoder to explain with ALTI+")


@dataclass
class BlockTensors:
    r"""What one attention block recorded, in the compute dtype.

    Attributes:
        probs: (B, H, Q, K) attention probabilities.
        values: (B, H, K, Dh) value states (b_V inside).
        head_weight: (H, Dh, D) the output projection per head, right-multiplied.
        out_bias: (D,) b_O or None.
        residual: (B, Q, D) r_i.
        output: (B, Q, D) the real block output y_i.
        norm: post-LN: the parameters of the norm after the sum; None for pre-LN.
        norm_input: post-LN: (B, Q, D) the real input u_i of that norm; None for pre-LN.
        cross: True for the cross-attention block (the residual is an extra part).
        layer: the layer index in its stack.
    """

    probs: Tensor
    values: Tensor
    head_weight: Tensor
    out_bias: Optional[Tensor]
    residual: Tensor
    output: Tensor
    norm: Optional[NormParams]
    norm_input: Optional[Tensor]
    cross: bool
    layer: int


def _hidden_arg(args, kwargs):
    if args:
        return args[0]
    return kwargs.get("hidden_states")


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class Seq2SeqRecorder(AttentionRecords):
    r"""Records the attention blocks of one encoder-decoder forward pass, block by block.

    It is pushed on the calling thread's recorder stack of :mod:`captum_normattr.models.capture.attention`,
    whose recording attention function calls :meth:`watches` and :meth:`record_attention`.
    As soon as a block has recorded everything it needs (its last tensor comes from a forward
    hook, or the recording attention), the record becomes a :class:`BlockTensors`, is handed
    to ``on_block`` and is dropped: the memory of the recording does not grow with depth.

    Args:
        model: a supported encoder-decoder.
        adapter: its :class:`Seq2SeqAdapter`.
        dtype: the compute dtype of the handed-out tensors.
        on_block: called as ``on_block(name, index, tensors)`` (``name`` one of :data:`BLOCKS`,
            ``index`` the layer in its stack) for every block as soon as it has run. None: the
            blocks are kept in ``blocks`` for :meth:`block_tensors` (every block alive until
            the end: for tests and small inputs).
    """

    keeps_context = False  # ALTI+ needs no attention context

    def __init__(
        self,
        model: nn.Module,
        adapter: Seq2SeqAdapter,
        dtype: torch.dtype,
        on_block: Optional[Callable[[str, int, "BlockTensors"], None]] = None,
    ):
        self.model = model
        self.adapter = adapter
        self.dtype = dtype
        self.on_block = on_block
        base = self.base = seq2seq_base(model)
        self.layers = {
            "encoder": list(get_path(base, adapter.encoder_layers)),
            "decoder": list(get_path(base, adapter.decoder_layers)),
        }
        self._attn_keys: Dict[int, Tuple[str, int]] = {}
        for name in BLOCKS:
            for i, layer in enumerate(self.layers[name.split("_")[0]]):
                self._attn_keys[id(get_path(layer, adapter.block(name).attention))] = (name, i)
        self._needed = ("probs", "values", "residual", "output") + (("norm_input",) if adapter.stream_norms else ())
        self.records: Dict[Tuple[str, int], Dict[str, Tensor]] = {}  # blocks still running
        self.blocks: Dict[Tuple[str, int], BlockTensors] = {}  # without on_block: the finished blocks
        self.finished: List[Tuple[str, int]] = []  # the finished blocks, in order

    def stack_layers(self, block: str) -> List[nn.Module]:
        return self.layers[block.split("_")[0]]

    def _store(self, key: Tuple[str, int], names, x: Tensor) -> None:
        rec = self.records.setdefault(key, {})
        for k in names:
            rec[k] = x.detach()
        self._recorded(key, rec, tuple(names))

    def _recorded(self, key, rec, names) -> None:
        r"""After every store: a block with all its tensors is handed on and dropped."""
        if all(k in rec for k in self._needed):
            del self.records[key]
            blk = self._block_tensors(key[0], key[1], rec)
            rec.clear()
            self.finished.append(key)
            if self.on_block is None:
                self.blocks[key] = blk
            else:
                self.on_block(key[0], key[1], blk)

    def hooks(self) -> list:
        handles = []
        for name in BLOCKS:
            spec = self.adapter.block(name)
            wanted: Dict[Tuple[str, str], List[str]] = {}
            wanted.setdefault(tuple(spec.residual), []).append("residual")
            wanted.setdefault(tuple(spec.output), []).append("output")
            if spec.norm is not None:
                wanted.setdefault((spec.norm, "in"), []).append("norm_input")
            for i, layer in enumerate(self.stack_layers(name)):
                for (path, side), keys in wanted.items():
                    module = get_path(layer, path) if path else layer
                    if side == "in":

                        def pre(mod, args, kwargs, key=(name, i), keys=tuple(keys)):
                            if self._mine():
                                self._store(key, keys, _hidden_arg(args, kwargs))

                        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                    else:

                        def post(mod, args, output, key=(name, i), keys=tuple(keys)):
                            if self._mine():
                                self._store(key, keys, _first(output))

                        handles.append(module.register_forward_hook(post))
        return handles

    def check_complete(self) -> None:
        r"""Raise if a block of the model did not record everything it needs (after the forward pass).

        Raises:
            RuntimeError: naming the block and what it missed (the model's structure does not
                match the adapter).
        """
        done = set(self.finished)
        for name in BLOCKS:
            for i in range(len(self.stack_layers(name))):
                if (name, i) not in done:
                    rec = self.records.get((name, i), {})
                    missing = [k for k in self._needed if k not in rec]
                    raise RuntimeError(
                        f"{name} block of layer {i}: the forward pass recorded no {missing}; the model's structure "
                        f"does not match the {self.adapter.family} adapter"
                    )

    # --- what the records become ----------------------------------------------------
    def block_tensors(self, name: str, index: int) -> BlockTensors:
        r"""The kept :class:`BlockTensors` of block ``name`` (one of :data:`BLOCKS`) in layer ``index``.

        Only without ``on_block`` (a streamed recorder hands the blocks on instead).

        Raises:
            RuntimeError: if the forward pass did not record that block.
        """
        if (name, index) not in self.blocks:
            self.check_complete()
            raise RuntimeError(f"{name} block of layer {index} was not kept (a recorder with on_block keeps no block)")
        return self.blocks[(name, index)]

    def _block_tensors(self, name: str, index: int, rec: Dict[str, Tensor]) -> BlockTensors:
        spec = self.adapter.block(name)
        layer = self.stack_layers(name)[index]
        device = rec["probs"].device
        cast = lambda t: None if t is None else t.detach().to(device=device, dtype=self.dtype)
        w_o, b_o = linear_params(get_path(layer, spec.attn_out))  # (H Dh, D), (D,)
        h, dh = rec["values"].shape[1], rec["values"].shape[-1]
        norm = None
        if spec.norm is not None:
            norm = norm_params(get_path(layer, spec.norm), self.adapter.norm_kind, self.dtype, device)
        return BlockTensors(
            probs=cast(rec["probs"]),
            values=cast(rec["values"]),
            head_weight=cast(w_o).reshape(h, dh, -1),
            out_bias=cast(b_o),
            residual=cast(rec["residual"]),
            output=cast(rec["output"]),
            norm=norm,
            norm_input=cast(rec.get("norm_input")) if norm is not None else None,
            cross=name == "decoder_cross",
            layer=index,
        )


@contextlib.contextmanager
def recording_seq2seq(
    model: nn.Module,
    adapter: Seq2SeqAdapter,
    dtype: torch.dtype = torch.float32,
    on_block: Optional[Callable[[str, int, BlockTensors], None]] = None,
) -> Iterator[Seq2SeqRecorder]:
    r"""Record the attention blocks of the forward passes run inside the block.

    Inside the block the model runs in eval mode with the package's recording attention
    function; afterwards its hooks, attention implementation and training flags are as
    before, also after an error (an error raised by ``on_block`` included).

    Args:
        model: a supported encoder-decoder.
        adapter: its :class:`Seq2SeqAdapter`.
        dtype: the compute dtype.
        on_block: ``on_block(name, index, tensors)`` for every block as soon as it has run
            (then dropped); None: the blocks are kept for
            :meth:`Seq2SeqRecorder.block_tensors`.

    Yields:
        The :class:`Seq2SeqRecorder`.

    Examples::

        >>> with recording_seq2seq(model, get_seq2seq_adapter(model), torch.float64) as rec:
        ...     model(input_ids=src, decoder_input_ids=tgt, use_cache=False)
        >>> rec.block_tensors("decoder_cross", 0).probs.shape  # (B, H, T, S)
        >>> shapes = []
        >>> with recording_seq2seq(model, get_seq2seq_adapter(model), torch.float64,
        ...                        on_block=lambda name, i, blk: shapes.append(blk.probs.shape)):
        ...     model(input_ids=src, decoder_input_ids=tgt, use_cache=False)
    """
    recorder = Seq2SeqRecorder(model, adapter, dtype, on_block)
    with recorder_session(model, recorder, recorder.hooks):
        yield recorder
