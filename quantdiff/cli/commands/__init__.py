"""One module per CLI command; each holds a typer-annotated function and imports heavy modules lazily."""
