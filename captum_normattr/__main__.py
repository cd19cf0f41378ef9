r"""``python -m captum_normattr``: the command line, identical to ``captum-normattr`` (:mod:`captum_normattr.cli.entry`).

Also what ``accelerate launch -m captum_normattr ...`` runs (see ``docs/scale.md``); ``python -m
captum_normattr.cli`` (:mod:`captum_normattr.cli.__main__`) is the same program. Python imports the
package's ``__init__`` first; it is lazy (its names are imported on first use), so ``--help`` and
usage errors stay fast here too.
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
