"""Character-level (or small-BPE) language modelling on the embedded Shakespeare corpus, sized for a CPU budget.

The GPT-2 vocabulary (50,257 tokens) made the old main job spend most of its parameters and time on the embedding;
a tokenizer trained on the corpus itself with the ``tokenizers`` library keeps the vocabulary at the size of the
model: ``vocab_size=0`` (the default) is pure character level (the 76 characters of the corpus plus ``<unk>``),
a larger value adds BPE merges up to that size. The tokenizer is saved as ``tokenizer.json`` (and with every model
as a ``PreTrainedTokenizerFast``), and losses are reported per character too (nats/char), so they compare with
nanoGPT's shakespeare-char baseline (validation loss ~1.47 with a 10.7M-parameter model) whatever the vocabulary.

Reference points computed on the same split: the unigram and bigram entropies of the validation tokens under
add-one-smoothed counts from the training split; a model below the bigram line is using context, which in a
transformer means attention.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..data import shakespeare_text
from ..diagnostics import diagnose
from ..evaluation.probes import train_seed
from ..tiny import ModelShape, TrainConfig, tiny_llama, train

UNK = "<unk>"
DATA_VERSION = 1


def train_tokenizer(text: str, vocab_size: int = 0):
    """A ``tokenizers.Tokenizer`` trained on ``text``: every character of it plus ``<unk>``, and BPE merges up to
    ``vocab_size`` tokens (0 = none: character level). Whitespace runs and non-space runs are pre-tokenized apart,
    so merges never cross a word boundary; decoding concatenates tokens (exact round trip for known characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = sorted(set(text))
    if vocab_size and vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be 0 (characters only) or >= {len(alphabet) + 1} (the corpus has "
                         f"{len(alphabet)} characters plus <unk>), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size or len(alphabet) + 1, special_tokens=[UNK],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], trainer)
    return tok


def ngram_entropies(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab: int) -> dict[str, float]:
    """Validation cross-entropy (nats/token) of add-one-smoothed unigram and bigram models counted on train_ids."""
    uni = torch.bincount(train_ids, minlength=vocab).double() + 1
    uni_nll = -(uni / uni.sum()).log()[val_ids].mean()
    pairs = torch.bincount(train_ids[:-1] * vocab + train_ids[1:], minlength=vocab * vocab).double().view(vocab, vocab)
    pairs += 1
    cond = pairs / pairs.sum(1, keepdim=True)
    bi_nll = -cond[val_ids[:-1], val_ids[1:]].log().mean()
    return {"unigram": float(uni_nll), "bigram": float(bi_nll)}


def data_folder(out_dir: Path, vocab_size: int = 0) -> Path:
    """Where ``prepare`` puts the tokenizer and token ids of ``vocab_size`` under ``out_dir``."""
    return Path(out_dir) / f"charlm-data-v{DATA_VERSION}-vocab{vocab_size}"


def prepare(out_dir: Path, vocab_size: int = 0) -> Path:
    """Train the tokenizer and tokenize both splits once per output directory (idempotent, atomic): returns the
    folder holding ``tokenizer.json``, ``data.pt`` (train/validation ids) and ``meta.json`` (vocabulary size,
    characters per token, n-gram baselines)."""

    folder = data_folder(out_dir, vocab_size)
    if (folder / "meta.json").is_file():
        return folder
    tmp = folder.with_name(f".tmp-{os.getpid()}-{folder.name}")
    tmp.mkdir(parents=True, exist_ok=True)
    train_text, val_text = shakespeare_text("train"), shakespeare_text("validation")
    tok = train_tokenizer(train_text, vocab_size)
    tok.save(str(tmp / "tokenizer.json"))
    ids = {split: torch.tensor(tok.encode(text).ids, dtype=torch.long)
           for split, text in (("train", train_text), ("validation", val_text))}
    torch.save(ids, tmp / "data.pt")
    vocab = tok.get_vocab_size()
    meta = {"vocab_size": vocab, "requested_vocab_size": vocab_size,
            "chars_per_token": {s: len(t) / len(ids[s]) for s, t in (("train", train_text), ("validation", val_text))},
            "tokens": {s: len(v) for s, v in ids.items()},
            "ngram_nats_per_token": ngram_entropies(ids["train"], ids["validation"], vocab)}
    cpt = meta["chars_per_token"]["validation"]
    meta["ngram_nats_per_char"] = {k: v / cpt for k, v in meta["ngram_nats_per_token"].items()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first: theirs is equivalent
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def eval_windows(val_ids: torch.Tensor, longest: int, tokens: int) -> torch.Tensor:
    """``tokens // longest`` chunks of ``longest`` tokens spread evenly over the validation ids: [N, longest]. The
    same chunks, cut into shorter windows, are scored at every context."""
    n = max(1, tokens // longest)
    if len(val_ids) < n * longest:
        raise ValueError(f"validation split has {len(val_ids)} tokens, fewer than {n} x {longest}")
    step = (len(val_ids) - longest) // max(1, n - 1) if n > 1 else 0
    return torch.stack([val_ids[i * step:i * step + longest] for i in range(n)])


def windows_loss(model, chunks: torch.Tensor, context: int, batch_size: int = 8) -> float:
    """Mean next-token loss (nats/token) of chunks [N, C*k] cut into non-overlapping windows of ``context``."""
    w = chunks.reshape(-1, context)
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(w), batch_size):
            x = w[i:i + batch_size]
            logits = model(input_ids=x, use_cache=False).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    return total / count


def run_lm(task: str, implementation: str, options: dict[str, Any], seed: int, settings: dict[str, Any],
           run_dir: Path | None = None) -> dict[str, Any]:
    """Train one char-level LM at context ``settings["length"]`` and score it at each of ``settings["factors"]``
    x length on the same validation tokens; inspect its attention (sink share, hidden-state kurtosis).

    settings: data_dir (from ``prepare``), length, factors, steps, batch_size, lr, warmup, eval_tokens,
    eval_every, shape (ModelShape fields)."""

    data_dir = Path(settings["data_dir"])
    if not (data_dir / "meta.json").is_file():  # normally prepared beforehand, while the probes train
        data_dir = prepare(data_dir.parent, int(settings.get("vocab", 0)))
    meta = json.loads((data_dir / "meta.json").read_text())
    ids = torch.load(data_dir / "data.pt")
    train_ids, val_ids = ids["train"], ids["validation"]
    cpt = meta["chars_per_token"]["validation"]
    L = int(settings["length"])
    shape = ModelShape(**settings.get("shape", {}))
    cfg = TrainConfig(steps=settings["steps"], batch_size=settings["batch_size"], lr=settings["lr"],
                      warmup=settings["warmup"])
    contexts = [int(round(f * L)) for f in settings["factors"]]
    chunks = eval_windows(val_ids, max(contexts), settings["eval_tokens"])
    quick = eval_windows(val_ids, L, min(settings["eval_tokens"], 16 * L))
    model = tiny_llama(implementation, options, meta["vocab_size"], shape, seed, train_length=L)
    span = len(train_ids) - L - 1

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(train_seed(seed, step))
        starts = torch.randint(0, span, (cfg.batch_size,), generator=g)
        x = torch.stack([train_ids[s:s + L] for s in starts.tolist()])
        y = torch.stack([train_ids[s + 1:s + L + 1] for s in starts.tolist()])
        return x, y

    log = train(model, batches, cfg, on_eval=lambda s: {"val_loss": windows_loss(model, quick, L)},
                eval_every=settings.get("eval_every") or max(1, cfg.steps // 5))
    t0 = time.perf_counter()
    losses = {str(c): windows_loss(model, chunks, c) for c in contexts}
    diag_ctx = min(max(contexts), 4 * L)
    diag = diagnose(model, chunks[:2].reshape(-1, diag_ctx)[:2], causal=True)
    heads = [h for layer in diag.layers for h in layer.summary()]
    sinks = [h["sink_share"] for h in heads if math.isfinite(h["sink_share"])]
    # sink rate as Gu et al. 2024 (arXiv:2410.10781) and the softpick paper count it: heads whose mean weight on
    # the first token exceeds 0.3
    sink_rate = sum(h["first_mass"] > 0.3 for h in heads) / len(heads) if heads else math.nan
    kurt = [h["kurtosis"] for h in diag.hidden[1:]]
    eval_seconds = time.perf_counter() - t0
    if run_dir is not None:
        save_with_tokenizer(model, data_dir, run_dir / "model")
    return {
        "val_loss": losses, "val_loss_per_char": {c: v / cpt for c, v in losses.items()},
        "perplexity": {c: math.exp(v) for c, v in losses.items()}, "contexts": contexts, "train_length": L,
        "eval_tokens": int(chunks.numel()), "chars_per_token": cpt, "vocab_size": meta["vocab_size"],
        "ngram_nats_per_char": meta["ngram_nats_per_char"],
        "sink_share": sum(sinks) / len(sinks) if sinks else math.nan,
        "sink_share_max_head": max(sinks) if sinks else math.nan, "sink_rate": sink_rate,
        "kurtosis_max_layer": max(kurt) if kurt else math.nan, "kurtosis_per_layer": kurt,
        "diagnostics_context": diag_ctx,
        "final_train_loss": sum(log["losses"][-20:]) / len(log["losses"][-20:]), "curve": log["evals"],
        "curve_by_step": {str(p["step"]): p["val_loss"] for p in log["evals"]},
        "train_seconds": log["train_seconds"], "eval_seconds": eval_seconds,
        "tokens_per_second": log["tokens_per_second"], "tokens": log["tokens"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "learned": {n: [round(float(v), 5) for v in p.detach().reshape(-1)]
                    for n, p in model.named_parameters() if ".attnorm." in n},
    }


def save_with_tokenizer(model, data_dir: Path, target: Path) -> None:
    """save_pretrained plus the corpus tokenizer as a PreTrainedTokenizerFast (reloads with AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(target)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(data_dir / "tokenizer.json"), unk_token=UNK)
    tok.save_pretrained(target)
