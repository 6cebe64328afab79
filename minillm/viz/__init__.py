"""Diagrams and plots the book draws from real runs (needs matplotlib: ``pip install 'minillm[book]'``)."""
