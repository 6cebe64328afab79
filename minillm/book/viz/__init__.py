"""Diagrams and plots the book draws from real runs (needs matplotlib: ``pip install 'minillm[book]'``)."""


def axes_or_new(ax, figsize: tuple[float, float]):
    """``ax``, or the axes of a new figure of ``figsize`` inches when ``ax`` is None."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)[1]
