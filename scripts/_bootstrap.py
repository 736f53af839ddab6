"""What every script runs first (``runpy.run_path`` of this file, so that it works however the script is started or
loaded): nothing downloads from a model or dataset hub unless the user says otherwise (the ``*_OFFLINE`` variables,
where unset), and the checkout's package is importable without ``pip install -e .``."""

import importlib.util
import os
import sys
from pathlib import Path

for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(variable, "1")
if importlib.util.find_spec("hf_attnorm") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
