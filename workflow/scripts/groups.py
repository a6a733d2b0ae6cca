"""Snakemake script (rule groups): each evaluated test user's loss per run and the cost of privacy per group."""

from userdp.errors import run_main
from userdp.evaluation import groups
from userdp.logutil import setup_logging

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    groups.run(
        sm.wildcards.dataset,
        list(sm.input.cells),
        sm.input.pretrained,
        sm.input.get("labels"),
        sm.input.summary,
        groups.Settings.from_config(sm.params.settings, int(sm.params.seed)),
        out_users=sm.output.users,
        out_parquet=sm.output.parquet,
        out_csv=sm.output.csv,
    )


run_main(main, log)
