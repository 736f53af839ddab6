"""Converting a pretrained causal LM to another attention normalizer, in the order a run takes:

* ``args``: the command line (``scripts/convert.py``) and what a run records of it;
* ``recipes``: per normalizer and scale, the teacher statistics, calibrated starts, continuations, offset searches
  and stage-1 rates;
* ``calibration``: the calibrated start (the teacher's statistics, then each recipe's formula);
* ``continuation``: a declared path from softmax to the target, stepped during stage 1;
* ``transfer``: stage 1, attention transfer (the model's own softmax as the teacher of every layer);
* ``distill``: stage 2's teacher distributions (top-k of the original model);
* ``converter``: the run itself (loading, stage 1, stage 2, checkpoints, evaluation, ``conversion.json``);
* ``study`` and ``study_cli``: the conversion study (``scripts/convert_study.py``) and its published tables.

``from hf_attnorm.lab.convert import Converter, parse_args, main`` is the interface of a run.
"""

from .args import ConvertError, build_parser, parse_args
from .converter import CHECKPOINTS, SUMMARY_FILE, Converter, main, run
from .transfer import Transfer, install_observer, observing

__all__ = ["CHECKPOINTS", "SUMMARY_FILE", "ConvertError", "Converter", "Transfer", "build_parser", "install_observer",
           "main", "observing", "parse_args", "run"]
