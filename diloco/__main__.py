"""`python -m diloco ...`: the `diloco` console script without an installed entry point."""

from diloco.cli.app import main

main()
