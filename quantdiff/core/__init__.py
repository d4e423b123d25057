"""Small shared pieces every layer may use: errors, device resolution, atomic writes, progress bars."""
