"""Configuration: the GPUCleanup traits, their defaults, validation, config files and %config."""

from __future__ import annotations

import pytest
from traitlets import TraitError
from traitlets.config import Config

from gpucleanup import config, extension
from test_extension import StandInEndpoint, StandInNative, shell  # noqa: F401  (fixture)


@pytest.fixture
def stand_in(monkeypatch):
    native = StandInNative()
    monkeypatch.setitem(extension.DEFAULTS, "native", native)
    monkeypatch.setitem(extension.DEFAULTS, "adapters", lambda: [])
    monkeypatch.setitem(extension.DEFAULTS, "status_endpoint", lambda: StandInEndpoint())
    return native


def test_defaults_free_everything_after_every_cell():
    opts = config.GPUCleanupOptions()
    assert (opts.enabled, opts.frameworks, opts.pinned, opts.driver_pools, opts.gc, opts.settle_timeout, opts.show, opts.history_size, opts.status_server) == (
        True, {}, True, True, "auto", 30.0, "auto", 100, True,
    )


@pytest.mark.parametrize(
    "trait, value, words",
    [
        ("gc", "sometimes", ["'gc' trait", "'auto', 'always', 'never'"]),
        ("show", "maybe", ["'show' trait"]),
        ("settle_timeout", -1.0, ["'settle_timeout' trait", "0.0"]),
        ("settle_timeout", float("inf"), ["'settle_timeout' trait", "finite"]),
        ("settle_timeout", "soon", ["'settle_timeout' trait"]),
        ("history_size", 0, ["'history_size' trait"]),
        ("enabled", "yes", ["'enabled' trait"]),
        ("frameworks", {"cupy": "on"}, ["'frameworks' trait"]),
        ("frameworks", {1: True}, ["'frameworks' trait"]),
    ],
)
def test_invalid_values_are_refused_naming_the_trait(trait, value, words):
    opts = config.GPUCleanupOptions()
    before = getattr(opts, trait)
    with pytest.raises(TraitError) as err:
        setattr(opts, trait, value)
    for word in words:
        assert word in str(err.value)
    assert getattr(opts, trait) == before


def test_unknown_framework_name_is_refused_when_the_adapters_are_known(monkeypatch):
    monkeypatch.setattr(config, "known_frameworks", lambda: ["cupy", "jax", "torch"])
    opts = config.GPUCleanupOptions()
    with pytest.raises(TraitError) as err:
        opts.frameworks = {"tensorflw": False}
    assert str(err.value) == "The 'frameworks' trait got unknown framework name(s) 'tensorflw'; known: cupy, jax, torch."
    opts.frameworks = {"jax": False}
    assert opts.framework_enabled("cupy") and not opts.framework_enabled("jax")


def test_settle_timeout_accepts_zero_and_ints():
    opts = config.GPUCleanupOptions()
    opts.settle_timeout = 0
    assert opts.settle_timeout == 0.0


def test_config_file_section_is_read_at_load(shell, stand_in):  # noqa: F811
    cfg = Config()
    cfg.GPUCleanup.gc = "always"
    cfg.GPUCleanup.show = "never"
    cfg.GPUCleanup.frameworks = {"cupy": False}
    cfg.GPUCleanup.history_size = 7
    shell.config.merge(cfg)
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    assert (ext.gc, ext.show, ext.frameworks, ext.history_size, ext.history.size) == ("always", "never", {"cupy": False}, 7, 7)


def test_percent_config_lists_the_class_and_its_help(shell, stand_in, capsys):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "")
    assert "    GPUCleanup" in capsys.readouterr().out.splitlines()
    shell.run_line_magic("config", "GPUCleanup")
    text = capsys.readouterr().out
    for trait in ("enabled", "frameworks", "pinned", "driver_pools", "gc", "settle_timeout", "show", "history_size", "status_server"):
        assert f"GPUCleanup.{trait}=" in text


def test_percent_config_sets_and_refuses(shell, stand_in, caplog):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 2.5")
    assert ext.settle_timeout == 2.5
    shell.run_line_magic("config", "GPUCleanup.gc = 'sometimes'")
    # %config logs the refusal (IPython's own way), naming the trait
    assert "The 'gc' trait of a GPUCleanup instance expected any of ['auto', 'always', 'never'], not the str 'sometimes'." in caplog.text
    assert ext.gc == "auto"


def test_history_size_change_resizes_the_history(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    for i in range(5):
        ext.history.append({"cell": i})
    ext.history_size = 2
    assert [r["cell"] for r in ext.history.last()] == [3, 4]
