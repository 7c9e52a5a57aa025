"""Every benchmark program loads and answers --help on the CPU.

Most of benchmarks/ needs a GPU to measure anything, so this is what the suite can check of
each program: its imports resolve (the shared harness and workload modules, the packages it
names at the top) and its command line parses. Each program runs as `python
benchmarks/NAME.py --help` in its own process, as the device machine runs it; the modules the
programs share (no `__main__` block) are imported the same way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
FILES = sorted(BENCHMARKS.glob("*.py"))
PROGRAMS = [path.name for path in FILES if 'if __name__ == "__main__":' in path.read_text()]
MODULES = [path.stem for path in FILES if path.name not in PROGRAMS]


def test_the_programs_were_found():
    assert {"offline_throughput.py", "h200_table.py", "kernel_bench.py"} <= set(PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS)
def test_program_answers_help(program):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / program), "--help"],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout.lower(), done.stdout[:500]


def test_the_shared_modules_import():
    assert {"harness", "workload", "decode_profile", "server_process"} <= set(MODULES)
    code = f"import {', '.join(MODULES)}, fleetsim.fleet, fleetsim.plot"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
