"""The lab: converting, training, evaluating and comparing attention implementations, and the checks of their speed.

Not needed to use an attention implementation; these modules need the ``[train]``/``[eval]`` extras
(``pip install "hf_attnorm[all]"``). Nothing in the plugin core imports from here. By purpose:

* ``convert/``: converting a pretrained model (recipes, calibration, attention transfer, distillation, the study);
* ``training/``: pretraining and fine-tuning (arguments, the loop, checkpoints, trackers);
* ``evaluation/``: perplexity, the swap evaluation, lm-evaluation-harness, probes, ``evaluate`` metrics;
* ``compare/``: the main job (sweep, report, verdicts, statistics);
* ``analysis/``: what the learned scales and attention maps look like;
* ``speed/``: the speed goals, the GPU check and its anchors, the ahead-of-time PTX checks;
* shared by them: ``assets`` (the packaged model and texts), ``data``, ``cli``, ``tiny``, ``model_zoo``, ``cards``,
  ``plots``, ``diagnostics``, ``distributed``, ``observe`` (watching a model's attention calls).

The modules' earlier flat names (``hf_attnorm.lab.calibration``, ``hf_attnorm.lab.gpu_check`` ...) still import, with
a DeprecationWarning naming the new one, until the next minor release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: the lab's earlier flat module names -> where each lives now
MOVED = {
    "convert_args": "convert.args", "transfer": "convert.transfer", "distill": "convert.distill",
    "calibration": "convert.calibration", "continuation": "convert.continuation", "recipes": "convert.recipes",
    "conversion_study": "convert.study", "conversion_study_cli": "convert.study_cli",
    "swap_evaluation": "evaluation.swap", "lm_eval": "evaluation.lm_eval", "probes": "evaluation.probes",
    "metrics": "evaluation.metrics",
    "speed_goals": "speed.goals", "gpu_check": "speed.gpu_check", "gpu_anchors": "speed.gpu_anchors",
    "triton_ptx": "speed.triton_ptx",
    "compare_job": "compare.job", "sweep": "compare.sweep", "verdicts": "compare.verdicts",
    "report": "compare.report", "stats": "compare.stats", "charlm": "compare.charlm",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``hf_attnorm.lab.<old name>`` as the module it moved to (the same module object), with a warning."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old name goes in the next minor "
                      "release)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when it was imported under its new name."""


if not any(isinstance(f, _MovedModule) for f in sys.meta_path):
    sys.meta_path.append(_MovedModule())
