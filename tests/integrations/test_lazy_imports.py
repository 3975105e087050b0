"""`import fxamp` imports none of the libraries fxamp.integrations works with."""

import subprocess
import sys


def test_import_fxamp_imports_no_trainer_library():
    code = ("import sys, fxamp; print(sorted(m for m in ('accelerate', 'transformers', "
            "'torchtitan', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
