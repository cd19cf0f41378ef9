r"""Test helper: every layer's tensors of one forward pass, kept (the package itself streams them)."""

from captum_normattr.attr.base import streamed_forward
from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.models.adapters import get_adapter


def capture_layers(model, ids, mask=None, with_final=False, top_model=False):
    r"""The list of LayerTensors of one recorded forward pass (and the final norm's tensors if asked)."""
    adapter = get_adapter(model)
    prepared = prepare_inputs(model, adapter, ids, None if mask is None else (mask,))
    layers = []
    with streamed_forward(model, adapter, prepared, layers.append, top_model=top_model) as (rec, _):
        final = rec.final_norm_tensors() if with_final else None
    return (layers, final) if with_final else layers
