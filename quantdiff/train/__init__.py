"""Training matched standard/differential pairs from recipes."""
