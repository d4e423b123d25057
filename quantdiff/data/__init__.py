"""Data: the corpus, data sources for statistics, needle documents and the cloze set."""
