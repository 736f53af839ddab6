#!/usr/bin/env python
"""The conversion study: the real SmolLM2-135M converted to each normalizer with ``scripts/convert.py`` against
fine-tuning alone at the same number of steps, on held-out Shakespeare.

The study is ``hf_attnorm.lab.convert.study_cli`` (runs, cache, outputs) and ``hf_attnorm.lab.convert.study``
(plan and aggregation); installed, the same command is ``hf-attnorm-convert-study``. Every flag:
``python scripts/convert_study.py --help``.
"""

from __future__ import annotations

import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

from hf_attnorm.lab.convert.study_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
