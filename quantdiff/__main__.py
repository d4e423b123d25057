"""`python -m quantdiff …` runs the CLI (also what `torchrun -m quantdiff stats …` needs)."""

from quantdiff.cli.app import main

main()
