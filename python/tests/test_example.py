"""python/examples/quickstart.py (the README's example) runs and checks its bytes."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_readme_example_runs():
    path = os.path.join(HERE, "..", "examples", "quickstart.py")
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "README example OK 4" in out.stdout
