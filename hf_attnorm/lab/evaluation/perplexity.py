"""Perplexity of causal and masked language models, with a sliding window, and length extrapolation.

Causal LMs (``causal_lm_perplexity``) follow transformers' perplexity guide ("Perplexity of fixed-length models"):
each text is tokenized once (optionally with a BOS token in front) and scored in windows of ``max_length`` tokens
that start every ``stride`` tokens; every token is predicted exactly once, in the first window that reaches it,
with as much left context as the window holds. The tokens that are counted are exactly those scored:

* token 0 of a text (the BOS when ``add_bos``) is never predicted; with ``stride < max_length`` every other token
  is, so a text of T tokens contributes T - 1 predictions;
* with ``stride == max_length`` (non-overlapping windows) the first token of each window has no context inside
  its window and is not scored either (T - number of windows predictions). The guide's code counts it in its
  ``trg_len`` but the loss ignores it; its newer version subtracts the batch size, which is right only without
  overlap. Here the count comes from the labels that actually enter the loss.

Corpus perplexity = exp(total NLL / total predicted tokens) (natural log). Per-text perplexity uses the same sums
per text. Windows are batched only with windows of the same length, so nothing is ever padded: the result does not
depend on how a normalizer treats padding, and it does not depend on ``batch_size`` (up to float rounding).

Masked LMs (``masked_lm_perplexity``): each text is cut into chunks of ``max_length - 2`` tokens wrapped in
[CLS] ... [SEP]; a fixed fraction of the ordinary tokens (``mlm_probability``, at least one per chunk) is replaced by
[MASK], drawn from a generator seeded with ``seed`` chunk by chunk in text order (so the draw does not depend on the
batch size), and the perplexity is exp(mean NLL of the original tokens at the masked positions). With
``pseudo=True`` it is the pseudo-perplexity of Salazar et al. (2020): every ordinary token is masked alone, one
copy of the chunk per token, and exp(mean NLL) over all of them (cost: one sequence per token).

Length extrapolation (``length_extrapolation``): a model trained at context L is evaluated on the SAME tokens cut
into non-overlapping windows of L, 2L, 4L, 8L ...; it reports perplexity per context and per position bucket
(targets at positions [0, L), [L, 2L), ... of their window), so "does the loss at positions beyond L go up?" is
answered directly. Positions: a model with learned absolute position embeddings (GPT-2's ``wpe``, BERT) cannot be
run past its table (``n_positions``): those contexts are reported as skipped with the reason; positions between
the training length and the table size exist but were never trained (flagged in the report). RoPE models (Llama)
compute positions on the fly and run at any length; ``max_position_embeddings`` is not a limit for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from ... import available
from ...hf.families import CAUSAL_LM, lm_task, model_task
from ...registry import is_ours
from ...settings import OptionError, parse_option_pairs, resolve_settings

__all__ = [
    "ContextResult",
    "EvaluationError",
    "ExtrapolationReport",
    "PerplexityResult",
    "causal_lm_perplexity",
    "length_extrapolation",
    "load_model",
    "masked_lm_perplexity",
    "model_kind",
    "parse_variant",
    "perplexity",
    "position_limit",
    "spread_chunks",
    "tokenize_texts",
]


class EvaluationError(ValueError):
    """Bad input to an evaluation function; the message names the argument and what is allowed."""


# ------------------------------------------------------------------------------------------------------ models

#: transformers' own implementations accepted where an attention variant is named
NATIVE_IMPLEMENTATIONS = ("sdpa", "eager")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """An attention variant ``name`` or ``name:key=value,key=value`` -> (name, attnorm options), validated.

    Values are typed by the declared option, with the grammar of every command line
    (``hf_attnorm.settings.parse_option_pairs``: ``512``, ``0.5``, ``true``/``yes``, ``null``). ``sdpa`` and
    ``eager`` (transformers' own) take no options.
    """
    name, _, rest = spec.partition(":")
    items = [item for item in rest.split(",") if item]
    if name in NATIVE_IMPLEMENTATIONS:
        if items:
            raise EvaluationError(f"variant {spec!r}: transformers' {name} takes no attnorm options")
        return name, {}
    if not is_ours(name):
        raise EvaluationError(f"unknown attention implementation {name!r} in {spec!r}; use "
                              f"{', '.join(NATIVE_IMPLEMENTATIONS)} or one of {', '.join(available())}")
    try:
        options = parse_option_pairs(items)
    except OptionError as exc:
        raise EvaluationError(f"variant {spec!r}: {exc}") from None
    resolve_settings(name, options)  # raises AttnormError naming the bad option and the allowed ones
    return name, options


def model_kind(model: nn.Module) -> str:
    """``"causal"`` or ``"masked"`` from the model class (``hf_attnorm.hf.families.model_task``)."""
    task = model_task(model)
    if task is None:
        raise EvaluationError(
            f"cannot evaluate a {type(model).__name__}: perplexity needs a causal LM (e.g. LlamaForCausalLM, "
            "GPT2LMHeadModel) or a masked LM (e.g. BertForMaskedLM) with its language-modelling head")
    return "causal" if task == CAUSAL_LM else "masked"


def load_model(
    path: str | Path,
    attn_implementation: str | None = None,
    attnorm: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    head: bool = True,
) -> nn.Module:
    """Load a checkpoint folder in eval mode: the one model loader of the lab (evaluation, scale analysis).

    ``head=True``: the causal or masked LM its config was built for (``hf_attnorm.hf.families.lm_task``);
    ``head=False``: the base model without a task head (attention analyses). ``attn_implementation=None`` keeps
    what the checkpoint saved (an hf_attnorm checkpoint restores its normalizer and settings); ``attnorm``
    overrides settings (e.g. ``{"train_length": 512}``) and needs an hf_attnorm implementation name (the saved one
    when ``attn_implementation`` is None).
    """
    if not (Path(path) / "config.json").is_file():
        raise EvaluationError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
    config = AutoConfig.from_pretrained(str(path))
    cls: Any = AutoModel
    if head:
        task = lm_task(config)
        if task is None:
            raise EvaluationError(
                f"{path}: architectures {list(config.architectures or [])} (model_type {config.model_type!r}) "
                "have no causal or masked language-modelling head to compute a perplexity with")
        cls = AutoModelForCausalLM if task == CAUSAL_LM else AutoModelForMaskedLM
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if attnorm is not None:
        if attn_implementation is None:
            saved = getattr(config, "attnorm", None)
            if not isinstance(saved, Mapping) or "implementation" not in saved:
                raise EvaluationError(f"attnorm={dict(attnorm)} given but {path} has no saved hf_attnorm "
                                      "implementation; pass attn_implementation= too")
            kwargs["attn_implementation"] = saved["implementation"]
        kwargs["attnorm"] = dict(attnorm)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = cls.from_pretrained(str(path), **kwargs)
    return model.to(device).eval()


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Evaluate without dropout, and give the model back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def position_limit(model: nn.Module) -> tuple[str, int | None]:
    """How the model encodes positions and the longest input it accepts.

    Returns ``("absolute", table_size)`` for learned absolute position embeddings (GPT-2 ``wpe``, BERT
    ``position_embeddings``), ``("rope", None)`` for rotary models (no limit), ``("none", None)`` otherwise.
    """
    rotary = False
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Embedding) and leaf in ("wpe", "position_embeddings", "embed_positions"):
            return "absolute", int(mod.num_embeddings)
        if leaf in ("rotary_emb", "rotary_embedding"):
            rotary = True
    return ("rope", None) if rotary else ("none", None)


# ------------------------------------------------------------------------------------------------------ results


@dataclasses.dataclass
class PerplexityResult:
    """Corpus and per-text perplexity.

    perplexity: exp(total_nll / total_tokens); mean_nll: total_nll / total_tokens (nats per token);
    perplexities / text_nll / text_tokens: per text, in input order; windows: forward sequences run;
    mode: "causal", "masked" or "pseudo"; options: the evaluation settings used.
    """

    perplexity: float
    mean_nll: float
    total_nll: float
    total_tokens: int
    perplexities: list[float]
    text_nll: list[float]
    text_tokens: list[int]
    windows: int
    mode: str
    options: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _result(nll: Sequence[float], count: Sequence[int], windows: int, mode: str,
            options: dict[str, Any]) -> PerplexityResult:
    total_nll = math.fsum(nll)
    total = int(sum(count))
    if total == 0:
        raise EvaluationError("no token was scored: the texts are too short for the settings "
                              f"({options}); give longer texts")
    return PerplexityResult(
        perplexity=math.exp(total_nll / total),
        mean_nll=total_nll / total,
        total_nll=total_nll,
        total_tokens=total,
        perplexities=[math.exp(s / c) for s, c in zip(nll, count)],
        text_nll=[s / c for s, c in zip(nll, count)],
        text_tokens=[int(c) for c in count],
        windows=windows,
        mode=mode,
        options=options,
    )


# ------------------------------------------------------------------------------------------------ tokenization


def tokenize_texts(tokenizer: Any, texts: Sequence[str], add_bos: bool = False) -> list[torch.Tensor]:
    """Token ids [T_i] of each text without special tokens, with ``tokenizer.bos_token_id`` in front if asked."""
    if isinstance(texts, str):
        raise EvaluationError("texts must be a list of strings, got a single string; wrap it in a list")
    bos = None
    if add_bos:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise EvaluationError(f"add_bos=True but the tokenizer ({type(tokenizer).__name__}) has no bos_token")
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise EvaluationError(f"texts[{i}] must be a string, got {type(text).__name__}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if bos is not None:
            ids = [bos, *ids]
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


# ---------------------------------------------------------------------------------------------------- causal LM


@dataclasses.dataclass(frozen=True)
class _Window:
    text: int  # index of the text
    begin: int  # tokens [begin, end) of the text
    end: int
    first: int  # first target index (absolute, within the text) scored in this window


def sliding_windows(length: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) of each window over a text of ``length`` tokens, as the perplexity guide:
    windows start every ``stride`` tokens, the last one ends at the text's end; target t is scored in the first
    window with end > t (and t > begin, so it has context)."""
    if max_length < 2:
        raise EvaluationError(f"max_length must be >= 2 (a window needs a context and a target), got {max_length}")
    if not 1 <= stride <= max_length:
        raise EvaluationError(f"stride must be between 1 and max_length={max_length}, got {stride}")
    out: list[tuple[int, int, int]] = []
    prev_end = 0
    for begin in range(0, length, stride):
        end = min(begin + max_length, length)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == length:
            break
    return out


def _batches(windows: list[Any], key, batch_size: int) -> Iterable[list[Any]]:
    """Windows grouped by ``key`` (their length) in batches of at most ``batch_size``, first-seen order."""
    groups: dict[Any, list[Any]] = {}
    for w in windows:
        groups.setdefault(key(w), []).append(w)
    for group in groups.values():
        for i in range(0, len(group), batch_size):
            yield group[i:i + batch_size]


def token_nll(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """NLL (nats, float32) of each next token: input_ids [B, L] -> [B, L - 1], entry j = -log p(x_{j+1} | x_<=j)."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    rows = []
    for b in range(input_ids.shape[0]):  # per sequence: a [L, V] fp32 copy at a time
        rows.append(F.cross_entropy(logits[b, :-1].float(), input_ids[b, 1:], reduction="none"))
    return torch.stack(rows)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise EvaluationError(f"batch_size must be a positive integer, got {batch_size!r}")


def causal_lm_perplexity(
    model: nn.Module,
    tokenizer: Any = None,
    texts: Sequence[str] | None = None,
    *,
    input_ids: Sequence[torch.Tensor] | None = None,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    add_bos: bool = False,
    progress: bool = False,
) -> PerplexityResult:
    """Sliding-window perplexity of a causal LM.

    texts (with tokenizer) or input_ids: a list of 1-D token tensors [T_i] (already holding any BOS). max_length:
    window size (default: the model's position limit, else max_position_embeddings); stride: step between window
    starts (default max_length: no overlap), 1 <= stride <= max_length. add_bos: put tokenizer.bos_token_id in
    front of each text (then the first real token is scored too).
    """
    _check_batch_size(batch_size)
    if model_kind(model) != "causal":
        raise EvaluationError(f"{type(model).__name__} is a masked LM; use masked_lm_perplexity")
    if (texts is None) == (input_ids is None):
        raise EvaluationError("give exactly one of texts= (with tokenizer=) or input_ids=")
    if texts is not None:
        if tokenizer is None:
            raise EvaluationError("texts= needs tokenizer=")
        input_ids = tokenize_texts(tokenizer, texts, add_bos)
    assert input_ids is not None
    seqs = [torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in input_ids]
    kind, limit = position_limit(model)
    if max_length is None:
        max_length = limit or getattr(model.config, "max_position_embeddings", None)
        if max_length is None:
            raise EvaluationError("max_length is required: the model config has no max_position_embeddings")
    if limit is not None and max_length > limit:
        raise EvaluationError(f"max_length={max_length} exceeds the model's {limit} learned absolute positions")
    stride = max_length if stride is None else stride
    windows: list[_Window] = []
    for i, ids in enumerate(seqs):
        spans = sliding_windows(len(ids), max_length, stride)
        if not spans:
            raise EvaluationError(f"text {i} has {len(ids)} token(s): nothing to predict (a text needs >= 2 tokens, "
                                  "counting the BOS when add_bos=True); remove it or join short texts")
        windows.extend(_Window(i, b, e, f) for b, e, f in spans)
    device = _device(model)
    nll = [0.0] * len(seqs)
    count = [0] * len(seqs)
    bar = tqdm(total=len(windows), desc="perplexity", unit="win", disable=not progress, leave=False)
    with eval_mode(model), torch.inference_mode():
        for batch in _batches(windows, lambda w: w.end - w.begin, batch_size):
            x = torch.stack([seqs[w.text][w.begin:w.end] for w in batch]).to(device)
            losses = token_nll(model, x).double().cpu()  # [b, W - 1], entry j scores target begin + j + 1
            for w, row in zip(batch, losses):
                scored = row[w.first - w.begin - 1:]
                nll[w.text] += float(scored.sum())
                count[w.text] += scored.numel()
            bar.update(len(batch))
    bar.close()
    options = {"max_length": max_length, "stride": stride, "batch_size": batch_size, "add_bos": add_bos}
    return _result(nll, count, len(windows), "causal", options)


# ---------------------------------------------------------------------------------------------------- masked LM


def masked_lm_perplexity(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_length: int | None = None,
    mlm_probability: float = 0.15,
    seed: int = 0,
    pseudo: bool = False,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Masked-LM perplexity (fixed masking seed) or pseudo-perplexity (``pseudo=True``) of a masked LM.

    max_length: tokens per chunk including [CLS] and [SEP] (default: the model's position limit).
    mlm_probability: fraction of ordinary tokens masked (0 < p <= 1; ignored with pseudo).
    """
    _check_batch_size(batch_size)
    if model_kind(model) != "masked":
        raise EvaluationError(f"{type(model).__name__} is a causal LM; use causal_lm_perplexity")
    if not pseudo and not 0.0 < mlm_probability <= 1.0:
        raise EvaluationError(f"mlm_probability must be in (0, 1], got {mlm_probability}")
    cls_id, sep_id, mask_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id
    if None in (cls_id, sep_id, mask_id):
        raise EvaluationError(f"the tokenizer ({type(tokenizer).__name__}) needs cls, sep and mask tokens for "
                              "masked-LM perplexity")
    kind, limit = position_limit(model)
    max_length = max_length or limit or getattr(model.config, "max_position_embeddings", None)
    if max_length is None or max_length < 3:
        raise EvaluationError(f"max_length must be >= 3 ([CLS] token [SEP]), got {max_length}")
    if limit is not None and max_length > limit:
        raise EvaluationError(f"max_length={max_length} exceeds the model's {limit} learned absolute positions")
    ids = tokenize_texts(tokenizer, texts, add_bos=False)
    body = max_length - 2
    gen = torch.Generator().manual_seed(seed)
    # items: (text index, input ids [L], target positions [k]); targets are the original ids there
    items: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for i, seq in enumerate(ids):
        if len(seq) == 0:
            raise EvaluationError(f"text {i} has no token; remove it")
        for start in range(0, len(seq), body):
            chunk = torch.cat([torch.tensor([cls_id]), seq[start:start + body], torch.tensor([sep_id])])
            inner = torch.arange(1, len(chunk) - 1)
            if pseudo:
                for p in inner:
                    x = chunk.clone()
                    x[p] = mask_id
                    items.append((i, x, p.view(1), chunk[p].view(1)))
            else:
                pick = torch.rand(len(inner), generator=gen) < mlm_probability
                if not bool(pick.any()):  # at least one target per chunk
                    pick[torch.randint(len(inner), (1,), generator=gen)] = True
                pos = inner[pick]
                x = chunk.clone()
                x[pos] = mask_id
                items.append((i, x, pos, chunk[pos]))
    device = _device(model)
    nll = [0.0] * len(ids)
    count = [0] * len(ids)
    bar = tqdm(total=len(items), desc="pseudo-perplexity" if pseudo else "mlm perplexity", unit="seq",
               disable=not progress, leave=False)
    with eval_mode(model), torch.inference_mode():
        for batch in _batches(items, lambda it: len(it[1]), batch_size):
            x = torch.stack([it[1] for it in batch]).to(device)
            logits = model(input_ids=x).logits
            for b, (i, _, pos, tgt) in enumerate(batch):
                losses = F.cross_entropy(logits[b, pos.to(device)].float(), tgt.to(device), reduction="none")
                nll[i] += float(losses.double().sum())
                count[i] += len(pos)
            bar.update(len(batch))
    bar.close()
    options = {"max_length": max_length, "batch_size": batch_size, "seed": seed,
               "mlm_probability": None if pseudo else mlm_probability, "pseudo": pseudo}
    return _result(nll, count, len(items), "pseudo" if pseudo else "masked", options)


def perplexity(model: nn.Module, tokenizer: Any, texts: Sequence[str], **kwargs: Any) -> PerplexityResult:
    """Causal or masked-LM perplexity, whichever the model is (keyword arguments of the matching function)."""
    if model_kind(model) == "causal":
        allowed = {"max_length", "stride", "batch_size", "add_bos", "progress"}
        fn = causal_lm_perplexity
    else:
        allowed = {"max_length", "mlm_probability", "seed", "pseudo", "batch_size", "progress"}
        fn = masked_lm_perplexity
    bad = sorted(set(kwargs) - allowed)
    if bad:
        raise EvaluationError(f"option(s) {bad} do not apply to a {model_kind(model)} LM; allowed: {sorted(allowed)}")
    return fn(model, tokenizer, texts, **kwargs)


# ------------------------------------------------------------------------------------------ length extrapolation


def spread_chunks(ids: torch.Tensor, chunk: int, total: int) -> torch.Tensor:
    """``total // chunk`` chunks of ``chunk`` consecutive tokens, evenly spaced over the stream ids [N], concatenated
    [total // chunk * chunk]: an evaluation sample that covers the whole text instead of its beginning. Windows of
    a context dividing ``chunk`` never straddle two chunks."""
    ids = torch.as_tensor(ids).reshape(-1)
    count = min(total // chunk, len(ids) // chunk)
    if count < 1:
        raise EvaluationError(f"need at least one chunk of {chunk} tokens: total={total}, stream of {len(ids)}")
    last = len(ids) - chunk  # the last possible start
    starts = [round(i * last / max(1, count - 1)) for i in range(count)] if count > 1 else [0]
    return torch.cat([ids[s:s + chunk] for s in starts])


@dataclasses.dataclass
class ContextResult:
    """One evaluation context. status "ok" or "skipped" (reason says why); buckets: per position range of the
    targets within their window, ``{"start", "end", "tokens", "mean_nll", "perplexity"}``."""

    context: int
    factor: float
    status: str
    reason: str = ""
    perplexity: float | None = None
    mean_nll: float | None = None
    tokens: int = 0
    windows: int = 0
    buckets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    untrained_positions: bool = False


@dataclasses.dataclass
class ExtrapolationReport:
    """Perplexity of one model at several contexts on the same tokens (``tokens_used`` of them)."""

    train_length: int
    position_encoding: str
    position_limit: int | None
    tokens_used: int
    contexts: list[ContextResult]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def perplexity_at(self, context: int) -> float | None:
        for c in self.contexts:
            if c.context == context:
                return c.perplexity
        raise KeyError(f"context {context} was not evaluated; contexts: {[c.context for c in self.contexts]}")


def extrapolation_contexts(train_length: int, factors: Sequence[float]) -> list[tuple[int, float]]:
    """(context, factor) pairs, strictly increasing; each context = round(factor * train_length) >= 2."""
    if isinstance(train_length, bool) or not isinstance(train_length, int) or train_length < 2:
        raise EvaluationError(f"train_length must be an integer >= 2, got {train_length!r}")
    if not factors:
        raise EvaluationError("factors must name at least one multiple of the training length, e.g. (1, 2, 4, 8)")
    pairs = sorted({int(round(f * train_length)): float(f) for f in factors}.items())
    for ctx, f in pairs:
        if f <= 0 or ctx < 2:
            raise EvaluationError(f"factor {f} gives context {ctx}; factors must give contexts >= 2")
    return pairs


def length_extrapolation(
    model: nn.Module,
    input_ids: torch.Tensor,
    train_length: int,
    factors: Sequence[float] = (1, 2, 4, 8),
    *,
    max_tokens: int | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> ExtrapolationReport:
    """Evaluate a causal LM trained at context ``train_length`` at ``factor * train_length`` tokens.

    input_ids: one token stream [N] (e.g. a tokenized validation split). The same first ``tokens_used`` tokens are
    used at every context: the largest multiple of the longest runnable context that fits in N (and in
    ``max_tokens``). Each context cuts them into non-overlapping windows; targets are bucketed by their position
    in the window: [1, L), [L, 2L), ... (position 0 has no context and is never a target).
    """
    _check_batch_size(batch_size)
    if model_kind(model) != "causal":
        raise EvaluationError("length extrapolation is defined here for causal LMs")
    stream = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    pairs = extrapolation_contexts(train_length, factors)
    kind, limit = position_limit(model)
    runnable = [c for c, _ in pairs if limit is None or c <= limit]
    results: list[ContextResult] = []
    if not runnable:
        raise EvaluationError(f"no context of {[c for c, _ in pairs]} fits the model's {limit} learned positions")
    longest = max(runnable)
    budget = len(stream) if max_tokens is None else min(len(stream), int(max_tokens))
    used = (budget // longest) * longest
    if used == 0:
        raise EvaluationError(f"need at least {longest} tokens for context {longest}; got {budget} "
                              f"({len(stream)} in input_ids, max_tokens={max_tokens})")
    stream = stream[:used]
    device = _device(model)
    total_windows = sum(used // c for c in runnable)
    bar = tqdm(total=total_windows, desc="extrapolation", unit="win", disable=not progress, leave=False)
    for ctx, factor in pairs:
        if ctx not in runnable:
            results.append(ContextResult(ctx, factor, "skipped", reason=(
                f"learned absolute position embeddings: the model has {limit} positions, context {ctx} needs "
                f"{ctx}")))
            continue
        windows = stream.view(-1, ctx)
        pos_sum = torch.zeros(ctx - 1, dtype=torch.float64)
        with eval_mode(model), torch.inference_mode():
            for i in range(0, len(windows), batch_size):
                x = windows[i:i + batch_size].to(device)
                pos_sum += token_nll(model, x).double().sum(0).cpu()
                bar.update(len(x))
        pos_count = len(windows)  # every window scores every target position 1..ctx-1 once
        buckets = []
        for start in range(0, ctx, train_length):
            end = min(start + train_length, ctx)
            lo = max(start, 1)  # target positions [lo, end) -> entries [lo - 1, end - 1)
            s = float(pos_sum[lo - 1:end - 1].sum())
            n = (end - lo) * pos_count
            buckets.append({"start": start, "end": end, "tokens": n, "mean_nll": s / n,
                            "perplexity": math.exp(s / n)})
        total = float(pos_sum.sum())
        n_tok = (ctx - 1) * pos_count
        results.append(ContextResult(
            ctx, factor, "ok", perplexity=math.exp(total / n_tok), mean_nll=total / n_tok, tokens=n_tok,
            windows=len(windows), buckets=buckets,
            untrained_positions=kind == "absolute" and ctx > train_length,
            reason=("positions >= the training length exist in the embedding table but were never trained"
                    if kind == "absolute" and ctx > train_length else ""),
        ))
    bar.close()
    return ExtrapolationReport(train_length, kind, limit, used, results)
