"""Configuration: the GPUCleanup traits, their defaults, validation, config files and %config."""

from __future__ import annotations

import pytest
from traitlets import TraitError
from traitlets.config import Config

import gpucleanup
import gpucleanup._native
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.in_kernel import config, extension
from shell_stand_ins import StandInEndpoint, StandInNative, shell  # noqa: F401  (fixture)


@pytest.fixture
def stand_in(monkeypatch):
    native = StandInNative()
    monkeypatch.setattr(gpucleanup, "_native", native)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
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
        ("settle_timeout", float("inf"), ["'settle_timeout' trait", "86400"]),
        ("settle_timeout", float("nan"), ["'settle_timeout' trait", "finite"]),
        ("history_size", 10**20, ["'history_size' trait", "100000"]),
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


def test_percent_config_sets_and_refuses(shell, stand_in, caplog, capsys):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 2.5")
    assert ext.settle_timeout == 2.5
    capsys.readouterr()
    shell.run_line_magic("config", "GPUCleanup.gc = 'sometimes'")
    # one sentence on stderr, the allowed values, no log record (which would print "ERROR:root:" before it)
    out, err = capsys.readouterr()
    assert (out, err) == ("", "GPUCleanup.gc = 'sometimes' refused: gc must be one of 'auto', 'always', 'never'. "
                              "Nothing changed; %config GPUCleanup lists every option.\n")
    assert caplog.messages == []
    assert (ext.gc, ext.settle_timeout) == ("auto", 2.5)


@pytest.mark.parametrize(
    "statement, allowed",
    [
        ("GPUCleanup.gc = 'sometimes'", "gc must be one of 'auto', 'always', 'never'"),
        ("GPUCleanup.history_size = 10**20", "history_size must be a whole number from 1 to 100,000"),
        ("GPUCleanup.settle_timeout = -1", "settle_timeout must be a finite number from 0 to 86,400"),
        ("GPUCleanup.show = 3", "show must be one of 'auto', 'always', 'never'"),
        ("GPUCleanup.pinned = 'yes'", "pinned must be True or False"),
    ],
)
def test_refused_value_leaves_the_extension_working_and_reloadable(shell, stand_in, caplog, capsys, statement, allowed):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    before = extension.get_extension(shell)
    values = {name: getattr(before, name) for name in before.trait_names(config=True)}
    capsys.readouterr()
    shell.run_line_magic("config", statement)
    out, err = capsys.readouterr()
    assert out == "" and caplog.messages == []
    assert len(err.splitlines()) == 1 and allowed in err and "Nothing changed" in err
    assert {name: getattr(before, name) for name in values} == values
    assert before.history.size == 100
    # the shell did not keep the refused value: a reload meets nothing to ignore
    assert statement.split("=")[0].strip().split(".")[1] not in shell.config.GPUCleanup
    shell.run_line_magic("reload_ext", "gpucleanup")
    after = extension.get_extension(shell)
    assert after is not before and {name: getattr(after, name) for name in values} == values
    assert "ignored" not in capsys.readouterr().out
    shell.run_line_magic("gpumem", "")  # the magic is still there and answers


def test_bad_value_in_the_config_file_loads_with_defaults_and_says_which(shell, stand_in, capsys):  # noqa: F811
    cfg = Config()
    cfg.GPUCleanup.gc = "sometimes"
    cfg.GPUCleanup.history_size = 10**20
    cfg.GPUCleanup.show = "never"  # a good value beside the bad ones is used
    shell.config.merge(cfg)
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    assert (ext.gc, ext.history_size, ext.show) == ("auto", 100, "never")
    assert sorted(capsys.readouterr().out.splitlines()) == [
        "gpucleanup · ignored GPUCleanup.gc = 'sometimes' from the configuration: "
        "gc must be one of 'auto', 'always', 'never'; using the default",
        "gpucleanup · ignored GPUCleanup.history_size = 100000000000000000000 from the configuration: "
        "history_size must be a whole number from 1 to 100,000; using the default",
    ]
    shell.run_line_magic("config", "GPUCleanup.gc = 'never'")  # %config still works
    assert ext.gc == "never"


def test_a_bad_config_value_reaches_the_terminal_as_one_line_with_its_control_characters_escaped(shell, stand_in,  # noqa: F811
                                                                                                     capsys):
    class Evil:  # a value whose repr carries a terminal title sequence and a line of its own
        def __repr__(self):
            return "\x1b]0;owned\x07\ngpucleanup · all clear"

    cfg = Config()
    cfg.GPUCleanup.gc = Evil()
    shell.config.merge(cfg)
    shell.run_line_magic("load_ext", "gpucleanup")
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert out.splitlines() == ["gpucleanup · ignored GPUCleanup.gc = \\x1b]0;owned\\x07\\ngpucleanup · all clear from "
                                "the configuration: gc must be one of 'auto', 'always', 'never'; using the default"]


def test_history_size_change_resizes_the_history(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    for i in range(5):
        ext.history.append({"cell": i})
    ext.history_size = 2
    assert [r["cell"] for r in ext.history.last()] == [3, 4]
