"""Saving figures (every format atomically, headless backend) and what the figures' legends share."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes or CI

import matplotlib.pyplot as plt

from ..io import atomic_path


def save_figure(fig: "matplotlib.figure.Figure", *paths: str | os.PathLike, dpi: int = 150) -> None:
    """Write `fig` to each path (format from the extension, e.g. .png, .pdf), then close it."""
    try:
        for path in paths:
            ext = Path(path).suffix.lstrip(".").lower()
            with atomic_path(path, suffix="." + ext) as tmp:
                fig.savefig(tmp, format=ext, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)


def legend_entries(axes) -> tuple[list, list[str]]:
    """The legend handles and labels of all `axes`, each label once (with its first handle), in drawing order."""
    entries: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    return list(entries.values()), list(entries)
