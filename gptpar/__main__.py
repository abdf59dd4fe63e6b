"""`python -m gptpar ...` (and so `torchrun -m gptpar train ...`) is the `gptpar` command."""

import sys

from gptpar.cli import main

if __name__ == "__main__":
    sys.exit(main())
