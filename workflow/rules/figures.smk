# Figures: one rule `plot_<name>` per figure of the registry
# userdp.plotting.registry (the families: contribution histograms, the
# accounting comparison, the language-model grid per dataset, the
# mean-estimation study). Each reads only finished artifacts (plotting is
# separate from computation, so changing a plot never reruns anything else)
# and writes PNG and PDF; the report shows them with their caption from
# workflow/report/<name>.rst. Rule all's figure targets come from
# userdp.plotting.registry.figure_targets.
#
# Snakemake fixes a report caption per rule, so each figure has its own rule
# (made by this loop) rather than one rule per family with a {figure}
# wildcard.
import os

from userdp import layout

from userdp.plotting.registry import FIGURES, FORMATS


def _figure_output(fig, fmt):
    path = fig.path(fmt)
    if fmt not in fig.family.report_formats:
        return path
    return report(
        path,
        caption=os.path.relpath(fig.caption, "workflow/rules"),
        category=fig.family.category,
        subcategory=fig.family.subcategory,
        labels=fig.report_labels(fmt),
    )


for _fig in FIGURES.values():

    rule:
        name:
            _fig.rule
        input:
            **_fig.inputs_for(config),
        output:
            **{fmt: _figure_output(_fig, fmt) for fmt in FORMATS},
        params:
            **_fig.plot_params(config),
        wildcard_constraints:
            **({"dataset": _fig.family.dataset_regex(config)} if _fig.family.dataset_regex else {}),
        log:
            _fig.log,
        benchmark:
            layout.benchmark_of(_fig.log),
        threads: 1
        priority: PRIORITY["side"]
        resources:
            mem_mb=1000,
            runtime=10,
        conda:
            "../envs/userdp.yaml"
        script:
            "../scripts/plot_figure.py"
