"""attnorm_perplexity: perplexity for models with any hf_attnorm attention (an ``evaluate`` metric, offline).

Unlike the stock ``perplexity`` metric it takes the model object itself (or a checkpoint path plus the attention
implementation and attnorm settings, so a custom attention is not lost on reload), slides a window with a stride,
counts the scored tokens exactly, and handles masked LMs (BERT) with a fixed masking seed or pseudo-perplexity.
The computation is ``hf_attnorm.lab.evaluation`` (see its docstring for the exact conventions).
"""

from __future__ import annotations

from typing import Any

import datasets
import evaluate

try:
    from hf_attnorm.lab.evaluation import EvaluationError, load_model, model_kind, perplexity
except ImportError as e:  # evaluate runs a copy of this file from its module cache
    raise ImportError(
        "attnorm_perplexity needs the hf_attnorm package: `pip install -e <repo>` or `import hf_attnorm` before "
        f"evaluate.load(...) ({e})"
    ) from e

_DESCRIPTION = """Corpus perplexity exp(total NLL / total scored tokens) and per-text perplexity of a causal LM with
a sliding window (max_length, stride), or masked-LM perplexity (fixed seed) / pseudo-perplexity of a masked LM."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts to score.
    model: a loaded causal LM (e.g. LlamaForCausalLM) or masked LM (BertForMaskedLM); or None with model_id.
    model_id (str): local checkpoint folder to load when ``model`` is None.
    attn_implementation (str): attention implementation for model_id (default: what the checkpoint saved).
    attnorm (dict): hf_attnorm settings overriding the saved ones for model_id (e.g. {"train_length": 512}).
    tokenizer: tokenizer object or folder (default: model_id, or the model's name_or_path).
    max_length (int): window / chunk length in tokens (default: the model's position limit).
    stride (int): causal LM: step between window starts, 1..max_length (default max_length: no overlap).
    batch_size (int): sequences per forward pass (default 1).
    add_bos (bool): causal LM: prepend the tokenizer's BOS to each text so its first token is scored (default False).
    device (str): device to load model_id on (default "cpu"); a given model stays where it is.
    mlm_probability (float): masked LM: fraction of tokens masked (default 0.15).
    seed (int): masked LM: masking seed (default 0).
    pseudo_perplexity (bool): masked LM: pseudo-perplexity, every token masked alone (default False).
    progress (bool): show a progress bar (default False).
Returns:
    perplexity: corpus perplexity; mean_perplexity: mean of the per-text perplexities (the stock metric's value);
    perplexities: per text; mean_nll: nats per token; total_tokens: tokens scored; text_tokens: per text;
    windows: sequences run; mode: "causal", "masked" or "pseudo".
Examples:
    >>> ppl = evaluate.load(hf_attnorm.lab.evaluation.metrics.perplexity_module_path())
    >>> ppl.compute(predictions=texts, model=model, tokenizer=tok, max_length=256, stride=128)["perplexity"]
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class AttnormPerplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(
        self,
        predictions: list[str],
        model: Any = None,
        model_id: str | None = None,
        attn_implementation: str | None = None,
        attnorm: dict[str, Any] | None = None,
        tokenizer: Any = None,
        max_length: int | None = None,
        stride: int | None = None,
        batch_size: int = 1,
        add_bos: bool = False,
        device: str | None = None,
        mlm_probability: float | None = None,
        seed: int | None = None,
        pseudo_perplexity: bool | None = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        if (model is None) == (model_id is None):
            raise EvaluationError("give exactly one of model= (a loaded model) or model_id= (a checkpoint folder)")
        if model is not None and (attn_implementation is not None or attnorm is not None):
            raise EvaluationError("attn_implementation/attnorm apply when loading model_id; for a loaded model use "
                                  "model.set_attn_implementation(...) or hf_attnorm.apply(model, ...)")
        if model is None:
            model = load_model(model_id, attn_implementation, attnorm, device=device or "cpu")
        elif device is not None:
            raise EvaluationError("device= applies when loading model_id; move a loaded model with model.to(...)")
        if tokenizer is None:
            tokenizer = model_id or getattr(model, "name_or_path", None)
            if not tokenizer:
                raise EvaluationError("tokenizer= is required (the model has no name_or_path to load one from)")
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        kind = model_kind(model)
        if kind == "causal":
            if pseudo_perplexity is not None or mlm_probability is not None or seed is not None:
                raise EvaluationError("mlm_probability, seed and pseudo_perplexity apply to masked LMs only")
            kwargs = {"max_length": max_length, "stride": stride, "add_bos": add_bos}
        else:
            if stride is not None or add_bos:
                raise EvaluationError("stride and add_bos apply to causal LMs only")
            kwargs = {"max_length": max_length, "pseudo": bool(pseudo_perplexity),
                      "mlm_probability": 0.15 if mlm_probability is None else mlm_probability,
                      "seed": 0 if seed is None else seed}
        res = perplexity(model, tokenizer, list(predictions), batch_size=batch_size, progress=progress, **kwargs)
        return {
            "perplexity": res.perplexity,
            "mean_perplexity": sum(res.perplexities) / len(res.perplexities),
            "perplexities": res.perplexities,
            "mean_nll": res.mean_nll,
            "total_tokens": res.total_tokens,
            "text_tokens": res.text_tokens,
            "windows": res.windows,
            "mode": res.mode,
        }
