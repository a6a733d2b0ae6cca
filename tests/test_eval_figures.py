"""LM figures render from a realistic summary, with labels, legends and reference lines."""

import math

import pytest

from eval_builders import fake_curves, fake_summary
from userdp.plotting import lm
from userdp.plotting.output import save_figure

PRE = {"test_loss": 4.9}


def texts(fig):
    out = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        if ax.get_legend():
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    for leg in fig.legends:
        out += [t.get_text() for t in leg.get_texts()]
    return "\n".join(out)


def saved(fig, tmp_path, name):
    png, pdf = tmp_path / f"{name}.png", tmp_path / f"{name}.pdf"
    save_figure(fig, png, pdf)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert pdf.read_bytes()[:4] == b"%PDF"


def test_loss_vs_epsilon_has_a_panel_per_budget_and_reference_lines(tmp_path):
    s = fake_summary()
    fig = lm.loss_vs_epsilon(s, PRE, "synth")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 3
    t = texts(fig)
    for needle in ("ELS", "ULS", "non-private", "pretrained", "nats/token", "ε", "K = 8,000", "2 seeds"):
        assert needle in t, needle
    ax = visible[0]
    # horizontal reference lines: pretrained + non-private ELS and ULS
    hlines = [l for l in ax.get_lines() if len(set(l.get_ydata())) == 1 and len(l.get_ydata()) == 2]
    ys = sorted(float(l.get_ydata()[0]) for l in hlines)
    assert PRE["test_loss"] in ys and len(ys) == 3
    saved(fig, tmp_path, "eps")


@pytest.mark.integration
def test_loss_vs_budget_a_panel_per_epsilon_with_intervals(tmp_path):
    s = fake_summary(seeds=(0, 1, 2))
    fig = lm.loss_vs_budget(s, PRE, "synth")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split(",")[0] for ax in visible] == ["ε = 1", "ε = 2", "ε = 4", "ε = 8"]
    t = texts(fig)
    for needle in ("DP-SGD-ELS", "DP-SGD-ULS", "ELS, non-private", "ULS, non-private", "pretrained",
                   "95% CI over 3 seeds", "compute budget"):
        assert needle in t, needle
    # the error bars are the 95% t interval of the three seeds
    main = s[~s.is_group_sweep]
    one = main[(main.method == "els") & (main.epsilon == 1) & (main.budget == 8000)].test_loss
    st = lm.mean_over_seeds(main, ["method", "epsilon", "budget"])
    ci = st[(st.method == "els") & (st.epsilon == 1) & (st.budget == 8000)]["ci"].iloc[0]
    assert ci == pytest.approx(2.0 / 2 * 4.302653 * one.std() / 3 ** 0.5, rel=1e-5)
    saved(fig, tmp_path, "budget")


def test_uls_minus_els_heat_map(tmp_path):
    s = fake_summary(seeds=(0, 1, 2))
    grid = lm.uls_minus_els_grid(s)
    assert len(grid) == 5 * 3  # (4 private eps + inf) x 3 budgets
    main = s[~s.is_group_sweep]
    at = main[(main.epsilon == 1) & (main.budget == 128000)]
    want = at[at.method == "uls"].test_loss.mean() - at[at.method == "els"].test_loss.mean()
    row = grid[(grid.epsilon == 1) & (grid.budget == 128000)].iloc[0]
    assert row["diff"] == pytest.approx(want) and row.ci_low < row["diff"] < row.ci_high
    fig = lm.uls_minus_els(s, PRE, "synth")
    cells = [t.get_text() for t in fig.axes[0].texts]
    assert len(cells) == 15 and all("[" in c for c in cells)
    assert "ULS - ELS" in texts(fig)
    saved(fig, tmp_path, "heat")


def test_loss_vs_group_size_marks_heuristic(tmp_path):
    s = fake_summary(heuristic={"els": 8, "uls": 32})
    fig = lm.loss_vs_group_size(s, PRE, "synth", 1, 8000)
    t = texts(fig)
    assert "heuristic G = 8" in t and "heuristic G = 32" in t and "G sweep" in t
    assert "no G sweep" not in t
    vlines = {float(l.get_xdata()[0]) for l in fig.axes[0].get_lines()
              if len(l.get_xdata()) == 2 and len(set(l.get_xdata())) == 1}
    assert vlines == {8.0, 32.0}
    saved(fig, tmp_path, "g")


def test_loss_vs_group_size_without_sweep_says_so(tmp_path):
    s = fake_summary(sweep=())
    fig = lm.loss_vs_group_size(s, PRE, "synth", 1, 8000)
    assert "no G sweep configured" in fig.axes[0].get_title()
    saved(fig, tmp_path, "g0")


def test_training_curves_one_line_per_run(tmp_path):
    s = fake_summary(epsilons=(1, 8), budgets=((8000, 50), (32000, 100)), seeds=(0, 1), sweep=(2,))
    fig = lm.training_curves(fake_curves(s), "synth")
    main_runs = s[~s.is_group_sweep]
    for ax, budget in zip(fig.axes, (8000, 32000)):
        assert len(ax.get_lines()) == int((main_runs.budget == budget).sum())  # sweep runs left out
        assert "rolling mean" in ax.get_title()
    assert "training loss" in fig.axes[0].get_ylabel()
    saved(fig, tmp_path, "curves")


def test_mean_over_seeds():
    s = fake_summary(seeds=(0, 1, 2))
    st = lm.mean_over_seeds(s[~s.is_group_sweep], ["method", "epsilon", "budget"])
    assert (st["count"] == 3).all()
    one = s[(s.method == "els") & (s.epsilon == 1) & (s.budget == 8000) & ~s.is_group_sweep]
    row = st[(st.method == "els") & (st.epsilon == 1) & (st.budget == 8000)].iloc[0]
    assert row["mean"] == pytest.approx(one.test_loss.mean())


# ---------------------------------------------------------------- the figure registry

from pathlib import Path  # noqa: E402
import re  # noqa: E402

from userdp.config import validate_config  # noqa: E402
from userdp.plotting import registry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_every_registered_figure_has_a_caption_a_function_and_its_own_rule():
    assert len({f.rule for f in registry.FIGURES.values()}) == len(registry.FIGURES)
    for fig in registry.FIGURES.values():
        assert (REPO / fig.caption).is_file(), fig.caption
        assert callable(fig.plot_function()), fig.function
        assert registry.figure_of_rule(fig.rule) is fig
    # Every caption file of a figure is registered (the front page is the workflow's).
    # (audit_table captions the audit's HTML table, a report item of rule audit_summary, not a figure)
    # (metrics_table captions the summary table, a report item of rule aggregate)
    # (findings_table captions the findings table, a report item of rule findings)
    # (groups_table captions the cost-of-privacy table, a report item of rule groups)
    # (options_table captions the options' summary, a report item of rule aggregate_options)
    captions = {p.stem for p in (REPO / registry.CAPTION_DIR).glob("*.rst")} - {"workflow", "audit_table",
                                                                                "metrics_table", "findings_table",
                                                                                "groups_table", "options_table"}
    assert "options_table.rst" in (REPO / "workflow/rules/evaluate.smk").read_text()
    assert "groups_table.rst" in (REPO / "workflow/rules/evaluate.smk").read_text()
    assert "findings_table.rst" in (REPO / "workflow/rules/findings.smk").read_text()
    assert "audit_table.rst" in (REPO / "workflow/rules/audit.smk").read_text()
    assert "metrics_table.rst" in (REPO / "workflow/rules/evaluate.smk").read_text()
    assert captions == set(registry.FIGURES)


def _figure_rules() -> dict[str, str]:
    """figures.smk's rules: name -> the rule's text (a written-out rule or a `use rule ... as name with:`)."""
    text = (REPO / "workflow/rules/figures.smk").read_text()
    heads = list(re.finditer(r"^(?:rule (\w+):|use rule \w+ as (\w+) with:)$", text, flags=re.M))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h[1] or h[2]: text[h.start():end] for h, end in zip(heads, ends)}


def test_each_registered_figure_has_its_rule_with_its_paths_and_caption():
    """The figure rules are written out in figures.smk: each registered figure's rule spells its outputs (the
    paths figure_targets asks for), log and benchmark, and captions it with its own file."""
    rules = _figure_rules()
    assert set(rules) == {f.rule for f in registry.FIGURES.values()}
    for fig in registry.FIGURES.values():
        text = rules[fig.rule]
        stem = fig.path("png")[len(registry.FIGURE_DIR) + 1:-len(".png")]
        for needed in (f'"{fig.path("png")}"', f'"{fig.path("pdf")}"', f'"results/logs/figures/{stem}.log"',
                       f'"results/benchmarks/figures/{stem}.tsv"', f'"{fig.name}"'):
            assert needed in text, (fig.rule, needed)
        # no other figure's files in this rule (a copy-paste slip would draw one figure twice)
        others = [o for o in registry.FIGURES.values() if o is not fig and f'"{o.path("png")}"' in text]
        assert not others, (fig.rule, [o.name for o in others])
    # the G-sweep figure is told the sweep's point, the groups figure the per-user-points choice
    assert 'epsilon=SWEEP_POINT["epsilon"]' in rules["plot_lm_loss_vs_group_size"]
    assert 'budget=SWEEP_POINT["budget"]' in rules["plot_lm_loss_vs_group_size"]
    assert "points=per_user_points(config)" in rules["plot_groups_gap_vs_examples"]


def test_figure_targets_and_paths():
    c = validate_config({
        "datasets": {"a": {"source": "synthetic"}, "b": {"source": "synthetic"}},
        "grid": {"datasets": ["a"], "epsilons": [0.5, 8], "budgets": [{"compute": 100, "steps": 5}]},
    })
    out = registry.figure_targets(c)
    stems = {"contributions_a", "contributions_b", "noise_vs_group_size", "lm_loss_vs_epsilon_a",
             "lm_loss_vs_budget_a", "lm_uls_minus_els_a", "lm_loss_vs_group_size_a", "training_curves_a", "groups_cost_a", "groups_gap_vs_examples_a", "mean_estimation_vs_epsilon",
             "mean_estimation_vs_diversity", "mean_estimation_vs_budget", "mean_estimation_vs_group_size"}
    assert sorted(out) == sorted(f"results/figures/{s}.{e}" for s in stems for e in ("png", "pdf"))
    assert registry.figure_targets(c, family="lm") == [p for p in out if "lm_" in p or "training_curves" in p]
    fig = registry.FIGURES["lm_loss_vs_group_size"]
    assert fig.path("png") == "results/figures/lm_loss_vs_group_size_{dataset}.png"
    assert fig.path("pdf", "a") == "results/figures/lm_loss_vs_group_size_a.pdf"
    assert registry.FIGURES["noise_vs_group_size"].path("pdf") == "results/figures/noise_vs_group_size.pdf"
    assert registry.per_user_points(c) == {"a": True}  # groups.per_user_points "synthetic", a synthetic dataset
    c["groups"]["per_user_points"] = "never"
    assert registry.per_user_points(c) == {"a": False}
    with pytest.raises(ValueError, match="unknown figure family"):
        registry.figure_targets(c, family="nope")
    with pytest.raises(ValueError, match="draws no registered figure"):
        registry.figure_of_rule("plot_nope")


def test_registered_lm_figure_draws_from_its_inputs(tmp_path):
    summary, pre = tmp_path / "metrics.parquet", tmp_path / "pretrained.json"
    fake_summary().to_parquet(summary)
    pre.write_text('{"test_loss": 4.9}')
    png, pdf = tmp_path / "e.png", tmp_path / "e.pdf"
    registry.FIGURES["lm_loss_vs_epsilon"].draw({"summary": str(summary), "pretrained": str(pre)}, png, pdf,
                                                 dataset="synth")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pdf.read_bytes()[:4] == b"%PDF"


def test_lm_figures_say_which_epsilon_they_show():
    """The footnote names the released model's guarantee, or the per-run target with the released factor."""
    import pandas as pd

    from userdp.plotting.lm import epsilon_note

    released = pd.DataFrame({"epsilon": [1.0, math.inf], "ledger_epsilon": [0.999, math.inf],
                             "ledger_epsilon_meaning": ["released model: the 3 learning-rate runs composed (target met by "
                                                 "the selection)", "x"],
                             "plan_epsilon_target_of": ["released model", "released model"]})
    assert epsilon_note(released).startswith("ε = the released model's guarantee: the 3 learning-rate runs")
    per_run = released.assign(ledger_epsilon=[1.77, math.inf], plan_epsilon_target_of=["each learning-rate run"] * 2)
    note = epsilon_note(per_run)
    assert "each learning-rate run's target" in note and "1.77-1.77x larger" in note
    assert epsilon_note(released.drop(columns=["ledger_epsilon_meaning"])) == ""


def test_contributions_figure_with_dp_statistics_draws_only_the_release(tmp_path):
    """privacy.contribution_stats.private: the figure shows the DP histogram, no exact statistic of the counts
    (its PDF text is scanned as tests/test_privacy_no_exact_stats.py scans a run); the default mode's figure,
    drawn from the same counts, is flagged by the same scan."""
    import json

    import numpy as np
    import pyarrow as pa

    from leak_scan import exact_statistics, file_values, leaks_in
    from userdp.data.prepare import contribution_stats, public_view
    from userdp.plotting.contributions import plot_contributions
    from userdp.privacy import contribution_stats as CS

    rng = np.random.default_rng(0)
    counts = np.clip(np.rint(np.exp(rng.normal(np.log(150), 0.5, 45))), 1, 437).astype(int)
    counts[0] = 437
    users = pa.table({"user_id": [f"u{i}" for i in range(counts.size)], "split": ["train"] * counts.size,
                      "n_examples": counts})
    stats = contribution_stats(users, {}, {}, int(counts.sum()))
    targets = exact_statistics(counts, [counts.size], [])
    (tmp_path / "exact.json").write_text(json.dumps(stats))
    (tmp_path / "public.json").write_text(json.dumps(public_view({**stats, "dataset": "d"})))
    (tmp_path / "release.json").write_text(json.dumps(CS.release(counts, 0.5, 20, 1, dataset="d", source="t")))
    plot_contributions(tmp_path / "public.json", tmp_path / "dp.png", tmp_path / "dp.pdf", dataset="d",
                       release=tmp_path / "release.json")
    plot_contributions(tmp_path / "exact.json", tmp_path / "ex.png", tmp_path / "ex.pdf", dataset="d")
    assert (tmp_path / "dp.png").stat().st_size > 10_000
    shown = file_values(tmp_path / "dp.pdf")
    assert float(counts.size) in {v for v, _ in shown.numbers}  # the title names N (public)
    assert leaks_in(shown, targets) == []
    assert any("total examples" in h for h in leaks_in(file_values(tmp_path / "ex.pdf"), targets))


def test_noise_vs_group_size_shows_both_group_privacy_baselines(tmp_path):
    import pandas as pd

    from userdp.plotting.accounting import noise_vs_group_size_figure
    from userdp.privacy.comparison import ACCOUNTANT_LABELS

    rows = []
    for eps in (1.0, 4.0):
        for g in (1, 4, 16):
            for kind, factor in (("els", 1.0), ("group", 1.05), ("group_rdp", 1.2), ("uls", None)):
                sigma = float("nan") if (kind == "group" and g == 16) else (1.0 if factor is None else factor * g)
                rows.append(dict(accountant=kind, epsilon=eps, group_size=g, noise_multiplier=sigma,
                                 sampling_rate=0.01, steps=1000, delta=1e-6))
    fig = noise_vs_group_size_figure(pd.DataFrame(rows))
    words = texts(fig)
    for kind in ("els", "group", "group_rdp", "uls"):
        assert ACCOUNTANT_LABELS[kind] in words
    assert f"{ACCOUNTANT_LABELS['group']}: infeasible" in words
    ratio_axes = fig.axes[2:4]
    for rax in ratio_axes:  # one ratio line per baseline, each at its factor
        ys = sorted(round(float(line.get_ydata()[0]), 6) for line in rax.get_lines() if line.get_color() != "gray")
        assert ys == [1.05, 1.2]
    saved(fig, tmp_path, "noise_vs_group_size")


def test_footnotes_overlap_no_legend_title_or_axes():
    """The notes (which epsilon, derived seeds) sit outside everything else the figure draws."""
    from matplotlib.transforms import Bbox

    from userdp.plotting.lm import DERIVED_SEEDS_NOTE, footnote

    summary = fake_summary(epsilons=(1, 8), budgets=((1000, 50), (4000, 50)), seeds=(0, 1, 2))
    for make in (lm.loss_vs_budget, lm.loss_vs_epsilon, lm.uls_minus_els):
        fig = make(summary=summary, pretrained=PRE, dataset="a")
        footnote(fig, "ε = the released model's guarantee")
        footnote(fig, DERIVED_SEEDS_NOTE)
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        notes = [t for t in fig.texts if t.get_text() in ("ε = the released model's guarantee", DERIVED_SEEDS_NOTE)]
        assert len(notes) == 2
        others = [a.get_tightbbox(r) for a in fig.axes] + [leg.get_window_extent(r) for leg in fig.legends]
        if fig._suptitle is not None:
            others.append(fig._suptitle.get_window_extent(r))
        boxes = [t.get_window_extent(r) for t in notes]
        assert not Bbox.intersection(boxes[0], boxes[1]) or Bbox.intersection(boxes[0], boxes[1]).height <= 0
        for b in boxes:
            for o in others:
                inter = Bbox.intersection(b, o)
                assert inter is None or inter.width <= 0 or inter.height <= 0, (make.__name__, o)
