"""quantdiff: where are a model's activation outliers, and how many bits does it survive?"""

__version__ = "0.1.0"
