"""Reporting: the paper's numbers, tables, plots and the markdown report."""
