r"""captum_normattr.models.capture: the streaming capture of a forward pass, in five modules.

* :mod:`~captum_normattr.models.capture.attention`: the package's own attention function
  (registered in transformers' ``AttentionInterface``), its thread state and the switching
  of a model to it and back;
* :mod:`~captum_normattr.models.capture.record`: what a layer's recorded tensors become
  (:func:`~captum_normattr.models.capture.record.layer_record`, weights read and folded,
  :func:`~captum_normattr.models.capture.record.norm_params`) and the checks on a record;
* :mod:`~captum_normattr.models.capture.recorder`: the
  :class:`~captum_normattr.models.capture.recorder.Recorder` and its hooks and guards;
* :mod:`~captum_normattr.models.capture.mamba2`: the hooks recording a Mamba-2 mixer as attention
  with one head per channel (its per-channel mixing tensor from the real scan coefficients);
* :mod:`~captum_normattr.models.capture.session`: the sessions
  (:func:`~captum_normattr.models.capture.session.recording`, ``recorder_session``, ``eval_mode``).

See ``docs/design.md``, "The house".
"""

__all__ = []
