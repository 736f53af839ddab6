#!/usr/bin/env python
"""Swap attention normalizers / scales into a pretrained model without training and measure perplexity.

The evaluation is ``hf_attnorm.lab.evaluation.swap`` (its docstring gives the default variants and why); installed,
the same command is ``hf-attnorm-evaluate``. Example: ``python scripts/evaluate.py --max_tokens 4096``; every flag:
``python scripts/evaluate.py --help``.
"""

from __future__ import annotations

import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

from hf_attnorm.lab.evaluation.swap import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
