"""Evaluation: what a model's attention implementation costs it in quality.

* ``perplexity``: perplexity of causal and masked LMs, length extrapolation, the one model loader (its interface is
  re-exported here: ``from hf_attnorm.lab.evaluation import causal_lm_perplexity``);
* ``swap``: the swap evaluation (``scripts/evaluate.py``: one checkpoint, every implementation);
* ``lm_eval``: lm-evaluation-harness's command line with hf_attnorm registered
  (``python -m hf_attnorm.lab.evaluation.lm_eval``);
* ``probes``: synthetic probes where the normalizer matters (MQAR, passkey), trained at one length, tested at longer;
* ``metrics``: the ``evaluate`` modules shipped with the package.
"""

from .perplexity import (
    ContextResult,
    EvaluationError,
    ExtrapolationReport,
    PerplexityResult,
    causal_lm_perplexity,
    length_extrapolation,
    load_model,
    masked_lm_perplexity,
    model_kind,
    parse_variant,
    perplexity,
    position_limit,
    spread_chunks,
    tokenize_texts,
)

__all__ = ["ContextResult", "EvaluationError", "ExtrapolationReport", "PerplexityResult", "causal_lm_perplexity",
           "length_extrapolation", "load_model", "masked_lm_perplexity", "model_kind", "parse_variant", "perplexity",
           "position_limit", "spread_chunks", "tokenize_texts"]
