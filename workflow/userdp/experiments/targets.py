"""Snakemake targets of the synthetic mean-estimation study (light: read when the DAG is built)."""

from __future__ import annotations

from ..layout import MEAN_ESTIMATION_RESULTS


def workflow_targets() -> list[str]:
    """The study's Snakemake targets: the results table (its figures: userdp.plotting.registry)."""
    return [MEAN_ESTIMATION_RESULTS]
