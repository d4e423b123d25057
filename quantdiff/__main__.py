"""`python -m quantdiff …` runs the CLI (also what `torchrun -m quantdiff stats …` needs)."""

from .cli import main

main()
