"""Small shared pieces every layer may use: the error family and atomic file writes."""
