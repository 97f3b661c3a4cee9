"""The GPU check's command; the check itself is the ``gpu_check`` package
beside this file, whose docstring says what it checks and how to run it::

    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu-report
"""

import sys

from gpu_check.cli import main  # the package, not this file: a script's folder is first on sys.path

if __name__ == "__main__":
    sys.exit(main())
