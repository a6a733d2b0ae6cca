"""userdp: user-level differentially private fine-tuning of language models.

The library behind the Snakemake pipeline: data loading and user grouping
(`userdp.data`), privacy accounting and planning (`userdp.privacy`), the DP
training engine (`userdp.training`), evaluation (`userdp.evaluation`), the
synthetic studies (`userdp.experiments`) and figures (`userdp.plotting`).
"""

__version__ = "0.1.0"
