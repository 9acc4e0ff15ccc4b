"""Allow `python -m rlx ...` as well as the `rlx` console script."""

from rlx.cli import main

main()
