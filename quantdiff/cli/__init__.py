"""The typer command line: the only layer that knows flags."""
