"""Data: loaders per source, user grouping and split, contribution statistics, tokens."""
