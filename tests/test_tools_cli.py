"""`jpa tools` / `python -m jpa.tools`: one entry point over the deviceless compile and traffic tools and the
mutation check; an unknown command is refused with the list (exit 2), and a command's own flags reach it."""

import subprocess
import sys

import pytest

from jpa.cli import main as jpa_main
from jpa.tools import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
    assert jpa_main.main(["--help"]) == 0 and "  tools " in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["bogus"], ["gpu_compile_check.py"]])
def test_an_unknown_command_is_refused_with_the_list(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"unknown command {argv[0]!r}" in err and "compile-offload" in err


def test_python_m_jpa_tools_runs_a_command_with_its_flags():
    """The command's own parser answers (its usage names `jpa tools compile-sinks`); a bad target exits 2."""
    proc = subprocess.run([sys.executable, "-m", "jpa.tools", "compile-sinks", "z900", "mosaic"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "usage: jpa tools compile-sinks" in proc.stderr and "invalid choice: 'z900'" in proc.stderr
