r"""The ``captum-normattr`` command line (:mod:`captum_normattr.cli.entry`); ``python -m captum_normattr.cli`` runs it.

Modules: :mod:`~captum_normattr.cli.entry` (the entry point and the subcommand table, imported alone for
``--help``), :mod:`~captum_normattr.cli.registry_view` (the methods' names and options for the parsers,
without torch), :mod:`~captum_normattr.cli.main` (parsing, explaining texts), :mod:`~captum_normattr.cli.output`
(what a text run writes), :mod:`~captum_normattr.cli.common` (what they share), :mod:`~captum_normattr.cli.seq2seq`
(encoder-decoders), :mod:`~captum_normattr.cli.generate` (``generate``), :mod:`~captum_normattr.cli.images`
(Vision Transformers) and :mod:`captum_normattr.cli.dataset` (dataset runs).
"""
from typing import List

__all__: List[str] = []
