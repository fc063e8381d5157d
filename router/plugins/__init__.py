"""Filters, scorers and pickers, one per module; contracts in `base`."""
