"""Exporters are registered like profiles: the built-ins with ``register_exporter`` in their modules,
a plugin's the same way; each declares the tracker options it owns, and ``grpolens export`` refuses
an option for a tracker that does not own it, naming the ones that do."""

from __future__ import annotations

import pytest

from grpolens.errors import UserError
from grpolens.export import EXPORTERS, TRACKERS, Exporter, exporter_class, exporters, register_exporter


def test_the_builtins_register_themselves_in_the_order_to_lists_them():
    reg = exporters()
    assert list(reg)[:len(TRACKERS)] == list(TRACKERS)
    assert {n: reg[n].owns for n in TRACKERS} == {
        "wandb": ("resume", "online"), "tensorboard": ("logdir",), "mlflow": ("tracking_uri",), "trackio": ()}
    assert all(reg[n].tracker == n for n in reg)


def test_a_plugin_exporter_is_found_and_owns_its_options(tmp_path, capsys):
    exporters()

    class Custom(Exporter):
        tracker = "tests-x"
        owns = ("logdir",)

    try:
        assert register_exporter(Custom) is Custom and register_exporter(Custom) is Custom  # imported again
        assert exporter_class("tests-x") is Custom
        from grpolens.cli import main

        with pytest.raises(SystemExit) as exc:
            main(["export", str(tmp_path), "--to", "wandb", "--logdir", str(tmp_path)])
        assert exc.value.code == 2
        assert "--logdir applies to --to tensorboard or tests-x only" in capsys.readouterr().err
    finally:
        del EXPORTERS["tests-x"]
    with pytest.raises(UserError, match=r"^--to: unknown tracker 'tests-x'; choose one of wandb, tensorboard, mlflow, trackio"):
        exporter_class("tests-x")


def test_registration_refuses_a_second_class_a_missing_name_and_an_unknown_option():
    exporters()

    class Again(Exporter):
        tracker = "wandb"

    class Nameless(Exporter):
        pass

    class Odd(Exporter):
        tracker = "tests-odd"
        owns = ("colour",)

    with pytest.raises(ValueError, match="^exporter wandb registered twice$"):
        register_exporter(Again)
    with pytest.raises(ValueError, match="^exporter Nameless: no tracker name$"):
        register_exporter(Nameless)
    with pytest.raises(ValueError, match=r"^exporter tests-odd: unknown options \['colour'\]$"):
        register_exporter(Odd)
    assert "tests-odd" not in EXPORTERS
