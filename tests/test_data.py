"""hf_attnorm.lab.data: the embedded corpus as text, tokenizers, tokenised + packed datasets, masking, sampling."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hf_attnorm.lab import data

MARKDOWN = """# A Play

## ACT I

### SCENE I. A heath.

_Thunder. Enter two Witches,
with a cat_

**First Witch**$
When shall we meet again?$
_\\[Aside]_$
In thunder, or in rain?

*Exit, pursued
by a bear.*

**SECOND WITCH**$
No, no; he'll __\\[ ]_$
Seem to break\\-loose **then**.

[To ROBIN]_$
**First Witch**$
_Exeunt_
""".replace("$\n", "  \n")  # markdown line breaks: two trailing spaces


def test_play_to_text_keeps_speakers_and_lines_and_drops_markup() -> None:
    text = data.play_to_text(MARKDOWN)
    assert text == (
        "First Witch:\nWhen shall we meet again?\nIn thunder, or in rain?\n\n"
        "SECOND WITCH:\nNo, no; he'll\nSeem to break-loose then.\n\n"
    )


@pytest.fixture(scope="module")
def corpus() -> dict[str, str]:
    return {s: data.shakespeare_text(s) for s in ("train", "validation", "all")}


def test_shakespeare_splits_are_disjoint_plays_and_deterministic(corpus) -> None:
    train_ids = {pid for pid, _ in data.shakespeare_plays("train")}
    val_ids = {pid for pid, _ in data.shakespeare_plays("validation")}
    assert val_ids == set(data.VALIDATION_PLAYS)
    assert len(train_ids) == 36 and not train_ids & val_ids
    frac = len(corpus["validation"]) / len(corpus["all"])
    assert 0.03 < frac < 0.07, frac
    assert sorted(corpus["train"] + corpus["validation"]) == sorted(corpus["all"])  # same characters, reordered
    assert data.shakespeare_text("validation") == corpus["validation"]
    assert "DUKE ORSINO:\nIf music be the food of love, play on;" in corpus["validation"]
    assert "MACBETH:" in corpus["validation"] and "MACBETH:" not in corpus["train"]
    assert "HAMLET:\n" in corpus["train"]


def test_shakespeare_text_has_no_markdown(corpus) -> None:
    text = corpus["all"]
    for bad in ("**", "_", "#", "\\", "[", "]", "  \n"):
        assert bad not in text, bad
    # every speech: "NAME:" line then at least one spoken line, separated by blank lines
    speeches = text.split("\n\n")[:-1]
    assert len(speeches) > 25_000
    assert all(re.fullmatch(r"[^\n:]+:\n[^\n]+(\n[^\n]+)*", s) for s in speeches)


def test_documents_concatenate_to_the_text(corpus) -> None:
    docs = data.shakespeare_documents("validation")
    assert "".join(docs) == corpus["validation"]
    assert all(d.endswith("\n\n") for d in docs)


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(data.DataError, match="unknown split 'test'.*train, validation, all"):
        data.shakespeare_text("test")


def test_load_tokenizer_families() -> None:
    gpt2 = data.load_tokenizer("gpt2")
    assert len(gpt2) == 50257 and gpt2.eos_token == "<|endoftext|>"
    assert gpt2("Hello world")["input_ids"] == [15496, 995]  # GPT-2's real BPE ids
    assert data.load_tokenizer("llama").get_vocab() == gpt2.get_vocab()
    bert = data.load_tokenizer("bert")
    assert len(bert) == 30522 and bert.mask_token == "[MASK]"
    assert bert.convert_ids_to_tokens(bert("Hello world")["input_ids"]) == ["[CLS]", "hello", "world", "[SEP]"]
    with pytest.raises(data.DataError, match="unknown.*|no embedded tokenizer for model family 't5'"):
        data.load_tokenizer("t5")


@pytest.fixture(scope="module")
def gpt2_tok():
    return data.load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def bert_tok():
    return data.load_tokenizer("bert")


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_causal_blocks_from_text_files_and_cache(tmp_path, gpt2_tok) -> None:
    lines = [f"line number {i} of the training text, with some words." for i in range(200)]
    train = _write(tmp_path / "train.txt", "\n".join(lines))
    val = _write(tmp_path / "val.txt", "\n".join(lines[:40]))
    tr, va, col, desc = data.load_text_datasets(train_file=train, validation_file=val)
    assert col == "text" and len(tr) == 200 and desc == "train.txt, val.txt"
    cache = tmp_path / "cache"
    train_blocks, val_blocks = data.build_lm_datasets(tr, va, col, gpt2_tok, block_size=16, masked_lm=False,
                                                      cache_dir=cache)
    ids = gpt2_tok("".join(tr["text"]), add_special_tokens=False)["input_ids"]
    assert len(train_blocks) == len(ids) // 16
    assert train_blocks[0]["input_ids"].tolist() == ids[:16]  # packing keeps the token stream in order
    assert train_blocks[len(train_blocks) - 1]["input_ids"].shape == (16,)
    assert all(str(cache) in f["filename"] for f in train_blocks.cache_files)  # tokenised + packed on disk
    files = sorted(p.name for p in cache.iterdir())
    again, _ = data.build_lm_datasets(tr, va, col, gpt2_tok, block_size=16, masked_lm=False, cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == files  # reused, nothing new written
    assert again[:]["input_ids"].tolist() == train_blocks[:]["input_ids"].tolist()
    data.build_lm_datasets(tr, va, col, gpt2_tok, block_size=8, masked_lm=False, cache_dir=cache)
    assert len(list(cache.iterdir())) > len(files)  # another block size: new packing, same tokenisation


def test_masked_blocks_have_cls_sep_and_special_mask(tmp_path, bert_tok) -> None:
    tr, va, col, _ = data.load_text_datasets()  # embedded corpus
    small_tr, small_va = tr.select(range(300)), va.select(range(100))
    blocks, _ = data.build_lm_datasets(small_tr, small_va, col, bert_tok, block_size=32, masked_lm=True,
                                       cache_dir=tmp_path)
    row = blocks[0]
    assert row["input_ids"].shape == (32,)
    assert row["input_ids"][0] == bert_tok.cls_token_id and row["input_ids"][-1] == bert_tok.sep_token_id
    assert row["special_tokens_mask"].tolist() == [1] + [0] * 30 + [1]


def test_json_files_and_text_column(tmp_path) -> None:
    rows = [{"id": i, "body": f"document {i} says something."} for i in range(50)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tr, va, col, _ = data.load_text_datasets(train_file=str(path))
    assert col == "body"  # the only string column
    assert len(tr) + len(va) == 50 and len(va) == 2  # 5% held out
    with pytest.raises(data.DataError, match="no column 'text'.*'id', 'body'"):
        data.load_text_datasets(train_file=str(path), text_column_name="text")


@pytest.mark.parametrize("content,match", [(None, "does not exist"), ("", "is empty"), ("  \n\n ", "is empty")])
def test_missing_or_empty_files_fail(tmp_path, content, match) -> None:
    path = tmp_path / "train.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(data.DataError, match=f"--train_file .*{match}"):
        data.load_text_datasets(train_file=str(path))


def test_bad_source_combinations_fail(tmp_path) -> None:
    f = _write(tmp_path / "a.txt", "some text\n")
    with pytest.raises(data.DataError, match="either --dataset_name or --train_file"):
        data.load_text_datasets(dataset_name="wikitext", train_file=f)
    with pytest.raises(data.DataError, match="unsupported extension '.parquet'"):
        data.load_text_datasets(train_file=_write(tmp_path / "a.parquet", "x"))
    with pytest.raises(data.DataError, match="--validation_file needs --train_file"):
        data.load_text_datasets(validation_file=f)


def test_hub_name_fails_offline_with_a_clear_message(monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(data.DataError, match="could not load dataset 'nonexistent-org/no-such-dataset'.*--train_file"):
        data.load_text_datasets(dataset_name="nonexistent-org/no-such-dataset")


def test_too_little_text_for_one_block(tmp_path, gpt2_tok) -> None:
    f = _write(tmp_path / "t.txt", "a few words\nand a few more\n")
    tr, va, col, _ = data.load_text_datasets(train_file=f, validation_file=f)
    with pytest.raises(data.DataError, match="fewer than one block of 64"):
        data.build_lm_datasets(tr, va, col, gpt2_tok, block_size=64, masked_lm=False, cache_dir=tmp_path / "c")


def test_masker_masks_about_15_percent_of_non_special(bert_tok) -> None:
    ids = torch.randint(1000, 30000, (64, 128))
    ids[:, 0], ids[:, -1] = bert_tok.cls_token_id, bert_tok.sep_token_id
    special = torch.zeros_like(ids)
    special[:, 0] = special[:, -1] = 1
    masker = data.MaskedLMMasker(bert_tok, 0.15, seed=3)
    out = masker({"input_ids": ids, "special_tokens_mask": special})
    predicted = out["labels"] != -100
    assert not predicted[:, 0].any() and not predicted[:, -1].any()
    frac = predicted.float().mean().item() * 128 / 126
    assert 0.13 < frac < 0.17, frac
    assert torch.equal(out["labels"][predicted], ids[predicted])
    masked = out["input_ids"] == bert_tok.mask_token_id
    assert 0.75 < (masked & predicted).sum() / predicted.sum() < 0.85
    assert torch.equal(out["input_ids"][~predicted], ids[~predicted])
    again = data.MaskedLMMasker(bert_tok, 0.15, seed=3)({"input_ids": ids, "special_tokens_mask": special})
    assert torch.equal(again["input_ids"], out["input_ids"])  # own generator: deterministic
    with pytest.raises(data.DataError, match="mlm_probability"):
        data.MaskedLMMasker(bert_tok, 1.5)


def test_epoch_sampler_is_a_seeded_permutation_independent_of_global_rng() -> None:
    s = data.EpochShuffleSampler(100, seed=7)
    torch.manual_seed(0)
    a = list(s)
    torch.manual_seed(123)
    assert list(s) == a and sorted(a) == list(range(100))
    s.set_epoch(1)
    b = list(s)
    assert b != a and sorted(b) == list(range(100))
    state = torch.get_rng_state()
    list(data.EpochShuffleSampler(100, seed=7))
    assert torch.equal(torch.get_rng_state(), state)  # never touches the global RNG (exact resume)


def test_evenly_spaced() -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"x": list(range(100))})
    assert data.evenly_spaced(ds, 5)["x"] == [0, 25, 50, 74, 99]
    assert len(data.evenly_spaced(ds, None)) == 100 and len(data.evenly_spaced(ds, 1000)) == 100
