r"""Presentation of attributions, apart from computing them.

Reports (:mod:`~captum_normattr.present.report`), the interactive page
(:mod:`~captum_normattr.present.interactive`), pictures (:mod:`~captum_normattr.present.visualization`,
:mod:`~captum_normattr.present.visualization_seq2seq`, :mod:`~captum_normattr.present.figures`,
:mod:`~captum_normattr.present.vision`), the one colour scale of every page and plot
(:mod:`~captum_normattr.present.colours`), the model's name as pages show it
(:mod:`~captum_normattr.present.labels`) and readable tokens (:mod:`~captum_normattr.tokens`).
Nothing under :mod:`captum_normattr.attr` imports from here.
"""
from typing import List

__all__: List[str] = []
