"""The exporter's token file (gpucleanup.outside.exporter): it never changes the mode of a directory it did not
make, and refuses a token file in a directory that others than the user and root may change."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from gpucleanup.outside import exporter as exporters  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _scrape(exporter) -> int:
    token = exporter.token_file.read_text().strip()
    request = urllib.request.Request(exporter.url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


@pytest.mark.parametrize("mode", [0o755, 0o711, 0o700, 0o750])
def test_a_token_file_in_an_existing_directory_leaves_its_mode_as_it_was(runtime, tmp_path, mode):
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(mode)
    exporter = exporters.start_exporter(0, runtime_dir=runtime, token_file=team / "exporter.token")
    try:
        assert _scrape(exporter) == 200
    finally:
        exporter.shutdown()
    assert _mode(team) == mode
    assert _mode(team / "exporter.token") == 0o600


def test_a_home_directory_keeps_its_mode(runtime, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    exporter = exporters.start_exporter(0, runtime_dir=runtime, token_file=Path("~/exporter.token").expanduser())
    exporter.shutdown()
    assert _mode(home) == 0o755
    assert (home / "exporter.token").is_file()


@pytest.mark.parametrize("mode, says", [
    (0o2775, "may be written by its group (mode 2775)"),
    (0o775, "may be written by its group (mode 775)"),
    (0o777, "may be written by every user (mode 777)"),
    (0o1777, "may be written by every user (mode 1777)"),  # sticky: others may still take the name first
])
def test_a_directory_others_may_write_is_refused_and_kept_as_it_is(runtime, tmp_path, mode, says):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(exporters.ExporterError) as refused:
        exporters.start_exporter(0, runtime_dir=runtime, token_file=shared / "exporter.token")
    assert str(refused.value) == (
        f"token file {shared / 'exporter.token'}: its directory {shared} {says}: another user could put a file of "
        "their own at that name or take yours away; keep the token file in a directory that only you (and root) "
        "may write (gpucleanup makes a missing one 0700) and give Prometheus's user a copy of the token")
    assert _mode(shared) == mode
    assert list(shared.iterdir()) == []  # no token written


def test_a_directory_above_that_others_may_write_is_refused_unless_sticky(runtime, tmp_path):
    above = tmp_path / "above"
    mine = above / "mine"
    mine.mkdir(parents=True)
    mine.chmod(0o700)
    above.chmod(0o2775)
    with pytest.raises(exporters.ExporterError, match=f"a directory above it, {above} may be written by its group"):
        exporters.start_exporter(0, runtime_dir=runtime, token_file=mine / "exporter.token")
    # sticky (as /tmp): others cannot rename or remove what is ours there
    above.chmod(0o1777)
    exporter = exporters.start_exporter(0, runtime_dir=runtime, token_file=mine / "exporter.token")
    exporter.shutdown()
    assert (_mode(above), _mode(mine)) == (0o1777, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another user needs root to make")
def test_a_directory_of_another_user_is_refused(runtime, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o755)
    os.chown(theirs, 2, 2)
    with pytest.raises(exporters.ExporterError, match=r"its directory .*theirs belongs to .*uid 2\), who may replace"):
        exporters.start_exporter(0, runtime_dir=runtime, token_file=theirs / "exporter.token")


def test_missing_directories_are_made_0700_and_existing_ones_are_left_alone(runtime, tmp_path):
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o755)
    token_file = team / "prometheus" / "scrape" / "exporter.token"
    exporter = exporters.start_exporter(0, runtime_dir=runtime, token_file=token_file)
    exporter.shutdown()
    assert (_mode(team), _mode(team / "prometheus"), _mode(team / "prometheus" / "scrape")) == (0o755, 0o700, 0o700)
    assert _mode(token_file) == 0o600


def test_the_command_says_why_and_exits_7_leaving_the_directory_as_it_was(runtime, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2775)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "ipython_ext"))
    done = subprocess.run([sys.executable, "-m", "gpucleanup", "exporter", "--port", "0", "--token-file",
                           str(shared / "exporter.token")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 7, done
    assert f"its directory {shared} may be written by its group (mode 2775)" in done.stderr
    assert "give Prometheus's user a copy of the token" in done.stderr
    assert _mode(shared) == 0o2775
