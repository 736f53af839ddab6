#!/usr/bin/env python
"""The main job: which attention normalizers keep working beyond the training length, with error bars.

The job is ``hf_attnorm.lab.compare.job`` (its docstring says what it trains, measures and writes); installed, the
same command is ``hf-attnorm-compare``. Every flag: `python scripts/compare.py --help`.
"""

from __future__ import annotations

import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

from hf_attnorm.lab.compare.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
