"""The config schema's enums name exactly what the registries declare (sources, optimizers, schedules)."""

from pathlib import Path

import pytest
import yaml

from userdp.data.sources import SOURCES, has_public_part, source_keys

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def schema():
    return yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())


def test_schema_source_enum_is_the_source_registry(schema):
    assert schema["$defs"]["dataset"]["properties"]["source"]["enum"] == list(SOURCES)


def test_every_source_key_is_in_the_schema_and_every_loader_resolves(schema):
    import importlib

    properties = set(schema["$defs"]["dataset"]["properties"])
    for name, kind in SOURCES.items():
        assert source_keys(name) <= properties, name
        module, _, attr = kind.loader.rpartition(".")
        assert callable(getattr(importlib.import_module(f"userdp.data.{module}"), attr)), kind.loader


def test_public_parts_come_from_the_registry():
    assert [n for n in SOURCES if has_public_part({"source": n})] == ["synthetic", "fortunes"]
    assert has_public_part({"source": "local", "public": {"path": "x.txt"}})


def test_schema_optimizer_and_schedule_enums_are_the_registries(schema):
    from userdp.training.optim import OPTIMIZERS, SCHEDULES

    training = schema["properties"]["training"]["properties"]
    assert training["optimizer"]["enum"] == list(OPTIMIZERS)
    assert training["schedule"]["enum"] == list(SCHEDULES)
