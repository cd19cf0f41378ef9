r"""Recording sessions: a recorder made this thread's recording of a model for the duration of a block.

:func:`recording` opens a :class:`~captum_normattr.models.capture.recorder.Recorder` on a
model; :func:`recorder_session` is the one place that switches a model's attention to the
recording function (:mod:`captum_normattr.models.capture.attention`) and back, for the
recorder and for the encoder-decoder recorder alike; :func:`eval_mode` runs a block in eval
mode, reference-counted with the recordings. On exit, also after an error and with several
threads recording or running the model at once, the hooks are removed and the model's
attention implementation and every submodule's training flag are as before
(``docs/design.md``, "Streaming engine").
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from captum_normattr.arch.spec import ArchitectureSpec
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.capture.attention import (
    ProbabilityBuffers,
    active_recorders,
    model_configs,
    register_attention,
    switch_off,
    switch_on,
)
from captum_normattr.models.capture.recorder import Recorder

__all__ = ["eval_mode", "recorder_session", "recording"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    r"""Run the block with ``model`` in eval mode; every submodule's training flag is restored afterwards.

    Reference-counted together with the recorded forward passes (:func:`recording`), so that a
    block nested in a recording (or a recording in the block) restores the flags only when the
    last of them ends.
    """
    switch_on(model, ())
    try:
        yield
    finally:
        switch_off(model, ())


@contextlib.contextmanager
def recording(
    model: nn.Module,
    adapter: ArchitectureSpec,
    on_layer: Callable[[LayerTensors], None],
    dtype: torch.dtype = torch.float32,
    keep_calls: bool = False,
    probabilities: bool = True,
    two_way: bool = False,
) -> Iterator[Recorder]:
    r"""Record the forward passes run inside the block, handing each layer to ``on_layer``.

    Inside the block the model runs in eval mode with the recording attention function;
    afterwards its hooks, attention implementation and the training flag of every
    submodule are as before (also after an error, and with several threads recording or
    running the model at once).

    Args:
        model: a supported ``transformers`` model.
        adapter: its :class:`ArchitectureSpec`.
        on_layer: callback receiving each layer's :class:`LayerTensors` in the compute dtype.
        dtype: the compute dtype.
        keep_calls: allow :meth:`Recorder.rerun_layer`.
        probabilities: False: the attention modules run the model's own attention function
            (sdpa, ...; the eager recording attention where the model was configured eager) and
            the handed-over layers have ``probs=None``; :meth:`Recorder.rerun_layer` still
            records them. For passes that keep only checkpoints (the DecompX adjoint).
        two_way: the pass's attention is two-way over part of a decoder's sequence (a vision-language
            model's ``token_type_ids``): the handed-over layers (and reruns) are marked not causal
            (``LayerTensors.causal=False``: full maps, no triangular shortcuts).

    Yields:
        The :class:`Recorder`.

    Examples::

        >>> maps = []
        >>> with recording(model, get_adapter(model), lambda layer: maps.append(layer.probs.mean(1))) as rec:
        ...     model(input_ids=ids, attention_mask=mask)
    """
    recorder = Recorder(model, adapter, dtype, on_layer, keep_calls)
    recorder.record_probabilities = probabilities
    recorder.two_way = two_way
    with recorder_session(model, recorder, recorder.install_hooks):
        try:
            yield recorder
        finally:
            recorder.records.clear()
            recorder.calls.clear()
            recorder.versions.clear()
            recorder.checks.clear()


@contextlib.contextmanager
def recorder_session(model: nn.Module, recorder: Any, install_hooks: Callable[[], list]) -> Iterator[Any]:
    r"""Make ``recorder`` the recording of this thread for the block, with its hooks installed.

    The one place that switches a model's attention to the recording function and back: on
    exit (also after an error) the hooks are removed, the recorder leaves this thread's
    stack and the model's attention implementation and per-module flags are restored.

    Args:
        model: the recorded model.
        recorder: an object with ``record_attention(module, probs, values, context=None)``
            and ``watches(module)`` (:class:`Recorder`, or the encoder-decoder recorder).
        install_hooks: registers the recorder's hooks and returns their handles.

    Yields:
        ``recorder``.
    """
    register_attention()
    stack = active_recorders()
    if any(getattr(r, "model", None) is model for r in stack):
        raise RuntimeError(
            "an attribution of this model was started while one of its own recorded forward passes is running (from a "
            "forward hook or a module of the model?): nested attributions of one model are not supported; run the "
            "second attribution after the first call returns (e.g. collect the inputs in the hook, attribute them after)"
        )
    configs = model_configs(model)
    handles: list = []
    switch_on(model, configs)
    try:
        handles = install_hooks()
        if getattr(recorder, "buffers", None) is None:
            recorder.buffers = ProbabilityBuffers()
        stack.append(recorder)
        yield recorder
    finally:
        if recorder in stack:
            stack.remove(recorder)
        if getattr(recorder, "buffers", None) is not None:
            recorder.buffers.clear()  # the kept buffers go with the recording
        for h in handles:
            h.remove()
        switch_off(model, configs)
