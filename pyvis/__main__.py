"""`python -m pyvis` = the `pyvis` command."""
import sys

from .cli import main

sys.exit(main())
