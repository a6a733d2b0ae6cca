"""The leak scanner itself (tests/leak_scan.py), on small files: it flags a maximum (and a total) of the counts
when they are not public values, and leaves a value out once it is public (a config cap, N, K, T)."""

import json

from leak_scan import exact_statistics, file_values, leaks_in

COUNTS = [1, 3, 7, 40, 120, 130, 133, 150, 212, 301]  # max 301 (no cap binds), total 1097


def _values(tmp_path, record):
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps(record))
    return file_values(path)


def test_the_scan_flags_a_maximum_and_a_total_that_are_not_public(tmp_path):
    targets = exact_statistics(COUNTS, public=[len(COUNTS)], budgets=[(64, 2)])
    hits = leaks_in(_values(tmp_path, {"largest": 301, "all": 1097, "n": 10}), targets)
    assert "max count = 301" in hits and "total examples of the train users = 1097" in hits
    assert not leaks_in(_values(tmp_path, {"largest": 300, "all": 1096}), targets)  # other numbers are no hit


def test_a_public_value_is_no_target(tmp_path):
    targets = exact_statistics(COUNTS, public=[len(COUNTS), 301], budgets=[(64, 2)])  # e.g. a cap of 301
    hits = leaks_in(_values(tmp_path, {"largest": 301, "all": 1097}), targets)
    assert not any(h.startswith("max count") for h in hits) and "total examples of the train users = 1097" in hits
