r"""``python -m captum_normattr``: the command line, identical to ``captum-normattr`` (:mod:`captum_normattr.cli.main`).

Also what ``accelerate launch -m captum_normattr ...`` runs (see ``docs/scale.md``); ``python -m
captum_normattr.cli`` (:mod:`captum_normattr.cli.__main__`) is the same program.
"""
import sys
from typing import List

from captum_normattr.cli.dataset.launch import close_process_group
from captum_normattr.cli.main import main

__all__: List[str] = []

if __name__ == "__main__":
    code = main()
    close_process_group()
    sys.exit(code)
