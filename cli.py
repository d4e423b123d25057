"""Run the quantdiff command line from a checkout: `python cli.py --help` (same as the `quantdiff` script)."""

from quantdiff.cli.app import main

if __name__ == "__main__":
    main()
