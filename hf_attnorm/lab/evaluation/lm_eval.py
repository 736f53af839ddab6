"""``python -m hf_attnorm.lab.evaluation.lm_eval ...``: lm-evaluation-harness's command line with hf_attnorm
registered.

The ``lm_eval`` / ``lm-eval`` command never imports hf_attnorm, so a model saved with one of its implementations
fails to load there ("attn_implementation=... is not supported"). This module imports hf_attnorm, then hands every
argument unchanged to lm-eval's own command line (``lm_eval.__main__.cli_evaluate``), so the flags, ``--help``
and the output files are lm-eval's::

    python -m hf_attnorm.lab.evaluation.lm_eval run --model hf --model_args pretrained=DIR --tasks wikitext
    python -m hf_attnorm.lab.evaluation.lm_eval --model hf \
        --model_args pretrained=DIR,attn_implementation=symax --tasks ...

A folder saved by hf_attnorm names its implementation in config.json, so ``pretrained=DIR`` alone loads it; an
``attn_implementation=`` in ``--model_args`` picks one for a plain checkpoint. In Python, ``import hf_attnorm``
before ``lm_eval.simple_evaluate(model="hf", ...)`` is all it takes.
"""

from __future__ import annotations

import sys

#: what to install when lm-eval is missing (the version the integration was checked with)
LM_EVAL_REQUIREMENT = "lm-eval==0.4.13"


def main(argv: list[str] | None = None) -> None:
    """Import hf_attnorm (registering every implementation), then run lm-eval's command line on ``argv`` (default:
    this process's arguments)."""
    import hf_attnorm  # noqa: F401  (registers every implementation with transformers)

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit(f"python -m hf_attnorm.lab.evaluation.lm_eval needs lm-evaluation-harness, which is not "
                         f"installed ({e}); install it with: pip install '{LM_EVAL_REQUIREMENT}'") from None
    # lm-eval's parser reads sys.argv (and inserts "run" when no subcommand is given)
    sys.argv = ["python -m hf_attnorm.lab.evaluation.lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
