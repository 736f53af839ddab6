"""``evaluate`` modules shipped with hf_attnorm (loadable offline from their folder).

    import evaluate, hf_attnorm.lab.evaluation.metrics
    ppl = evaluate.load(hf_attnorm.lab.evaluation.metrics.perplexity_module_path())
    ppl.compute(predictions=texts, model=model, tokenizer=tok, max_length=512, stride=256)

``evaluate.load`` copies the module into ``$HF_MODULES_CACHE`` (default under ``$HF_HOME``): that folder must be
writable (set ``HF_HOME`` to a temporary directory otherwise). No network access is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def perplexity_module_path() -> str:
    """Absolute path of the ``attnorm_perplexity`` evaluate module folder (pass it to ``evaluate.load``)."""
    return str(_HERE / "attnorm_perplexity")


def load_perplexity(**kwargs: Any):
    """``evaluate.load(perplexity_module_path(), **kwargs)``."""
    import evaluate  # the [eval] extra, imported only by the one function that needs it

    return evaluate.load(perplexity_module_path(), **kwargs)


__all__ = ["load_perplexity", "perplexity_module_path"]
