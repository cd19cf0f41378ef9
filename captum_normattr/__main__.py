r"""``python -m captum_normattr``: the command line, identical to ``captum-normattr`` (see :mod:`captum_normattr.cli.main`).

Also what ``accelerate launch -m captum_normattr ...`` runs (see ``docs/scale.md``).
"""
import sys

from captum_normattr.cli.main import main
from captum_normattr.cli.dataset.launch import close_process_group

if __name__ == "__main__":
    code = main()
    close_process_group()
    sys.exit(code)
