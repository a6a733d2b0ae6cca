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


def test_loss_vs_budget_one_line_per_method_and_epsilon(tmp_path):
    s = fake_summary()
    fig = lm.loss_vs_budget(s, PRE, "synth")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len([l for l in labels if l.startswith(("ELS,", "ULS,"))]) == 2 * 5  # 4 private eps + inf
    assert "compute budget" in fig.axes[0].get_xlabel()
    saved(fig, tmp_path, "budget")


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
