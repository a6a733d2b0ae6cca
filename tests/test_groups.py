"""Who pays for privacy: per-user scores, group labels, the cost per group with its intervals, claims 11-14.

Small tables with known answers (userdp.evaluation.groups); the labels of the synthetic and local sources
(userdp.data.synthetic.user_labels, userdp.data.local.user_labels); the per-user artifact from run folders.
The real pipeline with a local group column: tests/test_groups_pipeline.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from userdp.data.local import LocalSource
from userdp.data.synthetic import SyntheticSource
from userdp.errors import ConfigError, DataError
from userdp.evaluation import findings, groups
from userdp.evaluation.metrics import per_user_scores, summarise
from userdp.io import write_parquet

SETTINGS = groups.Settings(size_edges=None, min_users=5, bootstrap=2000, seed=0)


def user_table(costs: dict, n_users: int = 20, seeds=(0,), ref_loss=None, counts=None, topic=None,
               noise: float = 0.0) -> pd.DataFrame:
    """A per-user table (groups.USER_COLUMNS): `costs` maps (method, eps) -> per-user cost array (or a number);
    the references (eps inf) have loss `ref_loss` (default 2.0); the pretrained rows loss 3.0."""
    rng = np.random.default_rng(1)
    users = [f"u{i:03d}" for i in range(n_users)]
    counts = np.arange(1, n_users + 1) if counts is None else np.asarray(counts)
    ref = np.full(n_users, 2.0) if ref_loss is None else np.asarray(ref_loss, dtype=float)
    rows = []

    def add(model, method, eps, seed, loss):
        for u, n, l_ in zip(users, counts, loss):
            rows.append({"dataset": "d", "model": model, "method": method, "epsilon": eps, "budget": 100,
                         "seed": seed, "group_size": 8 if method == "els" else 4, "is_group_sweep": False,
                         "user_id": u, "nll": l_ * 10 * n, "n_tokens": 10 * n, "n_examples": int(n), "loss": l_})

    add("pretrained", "pretrained", math.nan, None, np.full(n_users, 3.0))
    for seed in seeds:
        for method in sorted({m for m, _ in costs}):
            add("fine-tuned", method, math.inf, seed, ref)
        for (method, eps), c in costs.items():
            c = np.broadcast_to(np.asarray(c, dtype=float), (n_users,))
            add("fine-tuned", method, float(eps), seed, ref + c + noise * rng.standard_normal(n_users))
    df = pd.DataFrame(rows)
    df["pretrained"] = None
    df = df.drop(columns="pretrained")
    label = dict(zip(users, topic)) if topic is not None else {}
    edges = groups.size_edges(counts, 8)
    names = groups.size_labels(edges, 8)
    size = dict(zip(users, groups.size_group(counts, edges, names)))
    df["contribution_group"] = df["user_id"].map(size)
    df["topic_group"] = df["user_id"].map(label) if label else None
    df["label_group"] = None
    return df[groups.USER_COLUMNS]


# ------------------------------------------------------------------ per-user scores
def test_per_user_scores_sum_each_users_rows_and_give_the_macro_average():
    nll, n = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1, 2, 3, 0])
    scores = per_user_scores(nll, n, ["b", "a", "b", "c"])
    assert list(scores["user_id"]) == ["a", "b", "c"]
    assert list(scores["n_examples"]) == [1, 2, 1]
    assert list(scores["n_tokens"]) == [2, 4, 0]
    assert scores["loss"].iloc[:2].tolist() == [1.0, 1.0] and math.isnan(scores["loss"].iloc[2])
    summary = summarise(nll, np.zeros(4, int), n, ["b", "a", "b", "c"])
    assert summary["loss_user_macro"] == 1.0
    # the metrics a cell reports (select.REPORTED) are named from targets.METRIC_NAMES: every metric, in order
    from userdp.evaluation.targets import METRIC_NAMES

    assert tuple(summary) == METRIC_NAMES


# ------------------------------------------------------------------ buckets
def test_size_buckets_use_one_the_median_and_g():
    edges = groups.size_edges([1, 2, 3, 8, 9, 40], group_size=16)
    assert edges == [1, 5, 16]  # median of the counts is 5.5 -> 5
    names = groups.size_labels(edges, 16)
    assert names == ["1 example", "2-5 examples", "6-16 examples", ">16 examples (above G)"]
    assert groups.size_group([1, 2, 5, 6, 16, 17], edges, names) == [names[0], names[1], names[1], names[2],
                                                                       names[2], names[3]]
    assert groups.size_edges([1, 2, 3], group_size=None, edges=[10, 2]) == [2, 10]


# ------------------------------------------------------------------ costs with known answers
def test_group_costs_disparity_and_uls_minus_els_have_the_known_values():
    topic = ["rare"] * 10 + ["common"] * 10
    costs = {("els", 1): np.r_[np.full(10, 0.5), np.full(10, 0.1)],
             ("uls", 1): np.r_[np.full(10, 0.3), np.full(10, 0.2)]}
    users = user_table(costs, topic=topic)
    model = groups.CostModel(users, SETTINGS, "d")
    table = groups.group_table(model, "d", {"topic": ["common", "rare"]})
    assert {"group_kind", "group", "method", "epsilon", "budget", "n_users", "cost", "cost_low",
            "cost_high"} <= set(table.columns)
    t = table[(table.group_kind == "topic")].set_index(["measure", "method", "group"])
    for method, group, want in (("els", "rare", 0.5), ("els", "common", 0.1), ("uls", "rare", 0.3),
                                ("uls", "common", 0.2)):
        row = t.loc[("cost", method, group)]
        assert row.cost == pytest.approx(want) and row.n_users == 10
        assert row.cost_low == pytest.approx(want) and row.cost_high == pytest.approx(want)  # no spread
        assert row.loss == pytest.approx(2.0 + want) and row.reference_loss == pytest.approx(2.0)
    assert t.loc[("uls - els", "uls - els", "rare")].cost == pytest.approx(-0.2)
    disp = table[(table.group_kind == "topic") & (table.measure == "disparity")].set_index("method")
    assert disp.loc["els"].cost == pytest.approx(0.4) and disp.loc["uls"].cost == pytest.approx(0.1)
    assert disp.loc["els"].group == "disparity: rare - common"
    assert list(t.loc["cost"].reset_index().query("method == 'els'")["group"]) == ["common", "rare"]


def test_cost_interval_is_about_the_t_interval_over_users():
    rng = np.random.default_rng(5)
    c = rng.normal(0.2, 0.1, size=200)
    users = user_table({("els", 1): c}, n_users=200)
    model = groups.CostModel(users, groups.Settings(None, 5, 4000, 0), "d")
    point, draws = model.cost("els", 1.0, 100, np.ones(200, bool))
    lo, hi = groups.interval(draws)
    half = 1.96 * c.std(ddof=1) / math.sqrt(200)
    assert point == pytest.approx(c.mean())
    assert lo < point < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)


def test_seeds_are_resampled_too():
    """Two seeds whose costs differ by a constant for every user: the user bootstrap alone gives a zero-width
    interval, resampling seeds gives a wide one."""
    users = user_table({("els", 1): 0.1}, n_users=20, seeds=(0, 1))
    shift = (users.seed == 1) & (users.method == "els") & (users.epsilon == 1.0)
    users.loc[shift, "loss"] += 0.2
    model = groups.CostModel(users, SETTINGS, "d")
    point, draws = model.cost("els", 1.0, 100, np.ones(20, bool))
    lo, hi = groups.interval(draws)
    assert point == pytest.approx(0.2)
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.3)


def test_small_groups_get_no_interval_and_stay_out_of_the_disparity():
    topic = ["rare"] * 3 + ["common"] * 17
    users = user_table({("els", 1): np.r_[np.full(3, 0.9), np.full(17, 0.1)]}, topic=topic)
    table = groups.group_table(groups.CostModel(users, SETTINGS, "d"), "d")
    rare = table[(table.group == "rare") & (table.measure == "cost")].iloc[0]
    assert rare.cost == pytest.approx(0.9) and math.isnan(rare.cost_low) and math.isnan(rare.cost_high)
    assert table[(table.group_kind == "topic") & (table.measure == "disparity")].empty


def test_no_reference_no_cost_rows():
    users = user_table({("els", 1): 0.1})
    users = users[~((users.model == "fine-tuned") & np.isinf(users.epsilon))]
    table = groups.group_table(groups.CostModel(users, SETTINGS, "d"), "d")
    assert table.empty and list(table.columns) == groups.GROUP_TABLE_COLUMNS


# ------------------------------------------------------------------ claims 11-14
def _claims_table(noise=0.02):
    n = 40
    topic = ["rare"] * 20 + ["common"] * 20
    counts = np.r_[np.arange(1, 21), np.arange(1, 21)]
    heavy = counts > 8
    costs = {
        ("els", 1): np.where(np.array(topic) == "rare", 0.5, 0.1) + 0.3 * heavy,
        ("els", 8): np.full(n, 0.05),
        ("uls", 1): np.where(np.array(topic) == "rare", 0.25, 0.2),
        ("uls", 8): np.full(n, 0.3),
    }
    return user_table(costs, n_users=n, counts=counts, topic=topic, noise=noise)


def test_group_claims_verdicts_follow_the_numbers():
    out = findings.group_findings({"d": _claims_table()}, {"size_edges": None, "min_users": 5, "bootstrap": 2000},
                                  seed=0)
    by = {(f.claim_id, f.measured_at.split(",")[0]): f for f in out}
    # F1: rare - common: ELS 0.4 (reproduced), ULS 0.05 (reproduced: small noise)
    assert by[(11, "ELS")].verdict == findings.REPRODUCED and by[(11, "ELS")].effect == pytest.approx(0.4, abs=0.03)
    # F2: cost(eps 1) - cost(eps 8): ELS positive (reproduced), ULS negative (not reproduced)
    assert by[(12, "ELS")].verdict == findings.REPRODUCED
    assert by[(12, "ULS")].verdict == findings.NOT_REPRODUCED
    # F3: heavy users (n > G = 8): ELS cost - ULS cost > 0
    f3 = [f for f in out if f.claim_id == 13]
    assert len(f3) == 1 and f3[0].verdict == findings.REPRODUCED
    # F4: ULS disparity smaller than ELS's (both kinds)
    f4 = [f for f in out if f.claim_id == 14]
    assert {f.measured_at.split(" ")[0] for f in f4} == {"contribution", "topic"}
    assert all(f.verdict == findings.REPRODUCED and f.effect < 0 for f in f4)
    for f in out:
        assert f.ci_low <= f.effect <= f.ci_high and f.domain == findings.GROUPS


def test_group_claims_not_measured_without_rare_topics_or_references():
    users = _claims_table()
    users["topic_group"] = None
    out = findings.group_findings({"d": users}, {"size_edges": None, "min_users": 5, "bootstrap": 500}, seed=0)
    f1 = [f for f in out if f.claim_id == 11]
    assert len(f1) == 1 and f1[0].verdict == findings.NOT_MEASURED and "rare" in f1[0].detail
    no_ref = users[~((users.model == "fine-tuned") & np.isinf(users.epsilon))]
    out = findings.group_findings({"d": no_ref}, {"size_edges": None, "min_users": 5, "bootstrap": 500}, seed=0)
    assert {f.verdict for f in out} == {findings.NOT_MEASURED}
    assert {f.claim_id for f in out} == set(findings.GROUP_CLAIMS)


def test_findings_table_has_the_group_block():
    result = findings.build({}, {}, {}, {"epsilon": 1, "budget": 100}, None, None, 0.01, 0.1, "t",
                            groups=({"d": _claims_table()}, {"size_edges": None, "min_users": 5,
                                                              "bootstrap": 500}, 0))
    ids = [f["claim_id"] for f in result["findings"]]
    assert set(findings.GROUP_CLAIMS) <= set(ids)
    assert set(findings.table(result)["domain"]) >= {findings.GROUPS}


# ------------------------------------------------------------------ the per-user artifact from run folders
def test_build_users_one_row_per_test_user_and_model(tmp_path):
    root = tmp_path / "results/runs/d"
    scores = per_user_scores(np.array([4.0, 6.0, 2.0]), np.array([2, 3, 1]), ["a", "b", "a"])
    write_parquet(root / "pretrained/users.parquet", scores)
    cells = []
    for cell in ("method~els/eps~1/budget~100/seed~0", "method~els/eps~inf/budget~100/seed~0",
                 "method~uls/eps~1/budget~100/seed~0", "method~uls/eps~inf/budget~100/seed~0"):
        write_parquet(root / cell / "users.parquet", scores)
        cells.append(str(root / cell / "users.parquet"))
    summary = pd.DataFrame({"method": ["els", "uls"], "epsilon": [1.0, 1.0], "is_group_sweep": [False, False],
                            "group_size": [2, 5], "run_dir": [str(root / "method~els/eps~1/budget~100/seed~0"),
                                                              str(root / "method~uls/eps~1/budget~100/seed~0")]})
    labels = pd.DataFrame({"user_id": ["a", "b"], "kind": ["topic", "topic"], "label": ["rare", "common"]})
    users, info = groups.build_users("d", cells, str(root / "pretrained/users.parquet"), labels, summary, SETTINGS)
    assert len(users) == 2 * (len(cells) + 1)
    assert users.groupby(["model", "method", "epsilon"], dropna=False).size().eq(2).all()
    assert list(users.columns) == groups.USER_COLUMNS
    assert info["group_size"] == 2 and info["edges"] == [1, 2]
    a = users[users.user_id == "a"].iloc[0]
    assert a.n_examples == 2 and a.n_tokens == 3 and a.loss == pytest.approx(2.0) and a.topic_group == "rare"
    assert a.contribution_group == "2 examples"
    els = users[(users.method == "els") & (users.epsilon == 1.0)]
    assert set(els["group_size"]) == {2}
    # a cell scored on other users is refused, naming the file
    write_parquet(root / cells[0].split("/d/")[1], per_user_scores(np.array([1.0]), np.array([1]), ["z"]))
    with pytest.raises(DataError, match="test users differ"):
        groups.build_users("d", cells, str(root / "pretrained/users.parquet"), labels, summary, SETTINGS)


# ------------------------------------------------------------------ labels: synthetic and local
def test_synthetic_topic_weights_make_rare_topic_users_and_null_changes_nothing():
    spec = {"source": "synthetic", "synthetic": {"n_users": 4000, "n_topics": 4}}
    base = SyntheticSource("s", spec, ".", 0)
    same = SyntheticSource("s", {"source": "synthetic", "synthetic": {"n_users": 4000, "n_topics": 4,
                                                                      "topic_weights": None}}, ".", 0)
    assert np.array_equal(base.theta, same.theta)
    assert set(base.user_labels().column("label").to_pylist()) == {"common"}
    weighted = SyntheticSource("s", {"source": "synthetic", "synthetic": {
        "n_users": 4000, "n_topics": 4, "topic_weights": [1, 1, 1, 0.2]}}, ".", 0)
    assert weighted.params.rare_topics() == [3]
    labels = weighted.user_labels().column("label").to_pylist()
    share = labels.count("rare") / len(labels)
    assert 0.04 < share < 0.09  # 0.2 / 3.2 = 0.0625
    main = np.argmax(weighted.theta, axis=1)
    assert all((lab == "rare") == (k == 3) for lab, k in zip(labels, main))


@pytest.mark.parametrize("weights", [[1, 1, 1], [1, 1, 1, 0], [1, 1, 1, True], "x"])
def test_bad_topic_weights_are_refused(weights):
    with pytest.raises(ConfigError, match="topic_weights"):
        SyntheticSource("s", {"source": "synthetic", "synthetic": {"n_topics": 4, "topic_weights": weights}}, ".", 0)


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        write_parquet(path, pd.DataFrame(rows))


def _labelled(tmp_path, fmt: str, second_b_region: str | None):
    """A local file of users a, b (b's second row in `second_b_region`, None: a's second row) and its source."""
    rows = [{"user_id": "a", "text": "x y", "region": "north"}, {"user_id": "b", "text": "z", "region": "south"},
            {"user_id": "a", "text": "w", "region": "north"} if second_b_region is None
            else {"user_id": "b", "text": "w", "region": second_b_region}]
    path = tmp_path / f"d.{fmt}"
    _write(path, rows, fmt)
    return path, LocalSource("loc", {"source": "local", "path": str(path), "group_column": "region"}, tmp_path)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_local_group_column_gives_each_users_label(tmp_path, fmt):
    path, src = _labelled(tmp_path, fmt, None)
    t = src.user_labels()
    assert t.column("user_id").to_pylist() == ["a", "b"]
    assert t.column("label").to_pylist() == ["north", "south"]
    assert set(t.column("kind").to_pylist()) == {"label"}
    assert LocalSource("loc", {"source": "local", "path": str(path)}, tmp_path).user_labels() is None


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_group_column_varying_within_a_user_is_refused_naming_user_and_file(tmp_path, fmt):
    path, src = _labelled(tmp_path, fmt, "east")
    with pytest.raises(DataError) as err:
        src.user_labels()
    msg = str(err.value)
    assert str(path) in msg and "'b'" in msg and "east" in msg and "south" in msg and "group_column" in msg


def test_a_missing_label_or_group_column_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, [{"user_id": "a", "text": "x", "region": "n"}, {"user_id": "b", "text": "z"}], "jsonl")
    src = LocalSource("loc", {"source": "local", "path": str(path), "group_column": "region"}, tmp_path)
    with pytest.raises(DataError, match="'b' has a row without a label"):
        src.user_labels()
    src = LocalSource("loc", {"source": "local", "path": str(path), "group_column": "lang"}, tmp_path)
    with pytest.raises(DataError, match="lang"):
        src.user_labels()


# ------------------------------------------------------------------ figures
def test_group_figures_draw_from_small_tables(tmp_path):
    from userdp.plotting import registry

    users = _claims_table()
    table = groups.group_table(groups.CostModel(users, SETTINGS, "d"), "d")
    summary = pd.DataFrame({"method": ["els"], "epsilon": [1.0], "is_group_sweep": [False], "group_size": [8],
                            "seeds_mode": ["derived"]})
    paths = {"groups": tmp_path / "groups.parquet", "users": tmp_path / "users.parquet",
             "summary": tmp_path / "summary.parquet"}
    write_parquet(paths["groups"], table)
    write_parquet(paths["users"], users)
    write_parquet(paths["summary"], summary)
    registry.FIGURES["groups_cost"].draw({"groups": str(paths["groups"]), "summary": str(paths["summary"])},
                                         tmp_path / "c.png", tmp_path / "c.pdf", dataset="d")
    registry.FIGURES["groups_gap_vs_examples"].draw({"users": str(paths["users"]), "summary": str(paths["summary"])},
                                                    tmp_path / "g.png", tmp_path / "g.pdf", dataset="d",
                                                    points={"d": True})
    for name in ("c.png", "c.pdf", "g.png", "g.pdf"):
        assert (tmp_path / name).stat().st_size > 0


def test_cost_figure_shows_each_group_and_method_with_its_interval():
    from userdp.plotting.groups import cost_by_group, gap_vs_examples

    users = _claims_table()
    table = groups.group_table(groups.CostModel(users, SETTINGS, "d"), "d")
    summary = pd.DataFrame({"method": ["els"], "epsilon": [1.0]})
    fig = cost_by_group(table, summary, "d")
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.patches]
    assert len(axes) == 2 * 2  # kinds contribution, topic x epsilons 1, 8
    topic_eps1 = next(ax for ax in axes if ax.get_title().startswith("topic") and "ε = 1" in ax.get_title())
    heights = sorted(round(p.get_height(), 2) for p in topic_eps1.patches)
    want = table[(table.measure == "cost") & (table.group_kind == "topic") & (table.epsilon == 1.0)]["cost"]
    assert np.allclose(heights, sorted(want.round(2)), atol=0.011)  # ELS rare 0.5 + 0.3 x 12/20 heavy users
    assert np.allclose(sorted(want), [0.2, 0.25, 0.28, 0.68], atol=0.03)
    assert "nats/token" in topic_eps1.get_ylabel() or "nats/token" in axes[0].get_ylabel()
    assert any("rare" in t.get_text() for t in topic_eps1.get_xticklabels())
    withheld = gap_vs_examples(users, summary, "d", points={"d": False})
    assert not any(ax.collections for ax in withheld.axes)  # no per-user points
    shown = gap_vs_examples(users, summary, "d", points={"d": True})
    assert sum(len(c.get_offsets()) for ax in shown.axes for c in ax.collections) == 40 * 2 * 2
    import matplotlib.pyplot as plt

    plt.close("all")
