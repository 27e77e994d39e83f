"""``python -m attnx``: the command line of attnx/_cli.py."""

import sys

from ._cli import run

if __name__ == "__main__":
    sys.exit(run())
