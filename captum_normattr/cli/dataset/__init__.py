r"""Dataset runs of the command line (``--format jsonl``): :mod:`~captum_normattr.cli.dataset.run` (the run),
:mod:`~captum_normattr.cli.dataset.inputs` (its inputs), :mod:`~captum_normattr.cli.dataset.resume` (its output:
lock, resume, records) and :mod:`~captum_normattr.cli.dataset.launch` (CPU processes under ``accelerate launch``).
"""
from typing import List

__all__: List[str] = []
