"""Reporting: number formatting, the paper's numbers, stats and sweep tables, plots and the markdown report."""
