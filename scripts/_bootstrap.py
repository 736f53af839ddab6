"""What every script runs first (``runpy.run_path`` of this file, so that it works however the script is started or
loaded): the checkout's package is importable without ``pip install -e .``, and nothing downloads from a model or
dataset hub unless the user says otherwise (``hf_attnorm.lab.cli.set_offline_defaults``, for the script's own process;
the console commands' mains are offline by default too)."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("hf_attnorm") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_attnorm.lab.cli import set_offline_defaults  # noqa: E402

set_offline_defaults()
