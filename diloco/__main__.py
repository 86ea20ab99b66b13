"""`python -m diloco ...`: the `diloco` console script without an installed entry point."""

from diloco.cli import main

main()
