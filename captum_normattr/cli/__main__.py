r"""``python -m captum_normattr.cli``: the command line, as ``captum-normattr`` and ``python -m captum_normattr``.

Runs :func:`captum_normattr.cli.entry.main` (the subcommand table; nothing heavy is imported
before a subcommand runs), then closes a ``torch.distributed`` group a dataset run may have
started (:func:`~captum_normattr.cli.dataset.launch.close_process_group`).
"""
import sys
from typing import List

from captum_normattr.cli.dataset.launch import close_process_group
from captum_normattr.cli.entry import main

__all__: List[str] = []

if __name__ == "__main__":
    code = main()
    if "torch.distributed" in sys.modules:  # a group exists only where a run imported torch.distributed
        close_process_group()
    sys.exit(code)
