"""Checkpoints that come back exactly, and that fail loudly when they cannot.

``model.save_pretrained(dir)`` (with ``import hf_attnorm``) on a model using one of our implementations writes, on
top of what transformers writes:

* ``config.json``: ``attnorm`` (the full settings + ``hf_attnorm_version``) and ``"attn_implementation":
  "hf_attnorm:<name> -- to load this model, run import hf_attnorm first (...)"`` (``registry.saved_name``).
  transformers reads that key back, so a reload needs no ``attn_implementation=``; without ``import hf_attnorm`` it
  fails with ``attn_implementation="hf_attnorm:<name> -- to load this model, run import hf_attnorm first ..." is not
  supported`` (the value quoted in the first line says what to do) instead of silently running sdpa.
* the safetensors header metadata of every weight file: ``hf_attnorm`` (the settings as a JSON string) and
  ``hf_attnorm_version`` (the header is rewritten in place; tensor bytes are untouched).
* a one-byte tensor under ``hf_attnorm.<name>.NOT_RUN_without_import_hf_attnorm__softmax_runs_instead``
  (``marker_key``) in the first weight file (and the shard index): no model has that parameter, so transformers
  without ``import hf_attnorm`` lists it as UNEXPECTED in the load report it logs as a warning. That is the one
  signal a checkpoint can give when the implementation is passed explicitly (``from_pretrained(dir,
  attn_implementation="sdpa")``, or ``None``, as ``transformers serve`` passes it): transformers then ignores the
  config.json value above and runs softmax; it runs no code of the checkpoint's without ``trust_remote_code``, so
  it cannot be made to refuse (docs/clients.md). With ``import hf_attnorm`` the key is ignored
  (``MARKER_PATTERN``).
* ``attnorm_checksums.json``: sha256 of every weight file (safetensors has no checksum of its own).

The learned per-head values are ordinary tensors in the weights (``...self_attn.attnorm.ssmax_s``).

``from_pretrained(dir)`` verifies a local checkpoint BEFORE transformers reads it: settings in config.json valid
and known to this version, every weight file's sha256 (when the checksum file exists) and header, config.json and
the safetensors metadata in agreement. Each problem raises ``CheckpointError`` naming the file and what is wrong.
After loading, every learned per-head value the checkpoint was saved with must have been filled from it
(transformers' own key renaming is followed). Set ``HF_ATTNORM_VERIFY=0`` to skip every check, before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ..fileio import atomic_write
from ..kernels.memory import MEM_KV_HEADS, NUM_MEM_KV
from ..registry import AttnormError, canonical, is_ours, saved_name
from ..settings import AttnormSettings, settings_core
from ..version import __version__
from .state import AttnormState

#: safetensors header metadata keys
METADATA_KEY = "hf_attnorm"
VERSION_KEY = "hf_attnorm_version"
CHECKSUM_FILE = "attnorm_checksums.json"
#: what follows ``hf_attnorm.<name>.`` in the marker tensor's key: transformers prints the key in its load report
MARKER_SUFFIX = "NOT_RUN_without_import_hf_attnorm__softmax_runs_instead"
#: the marker keys (as a regular expression searched in a checkpoint key, transformers' ``_keys_to_ignore_on_load_*``
#: convention)
MARKER_PATTERN = rf"(^|\.)hf_attnorm\.[^.]+\.{MARKER_SUFFIX}$"
#: the shard index transformers writes beside sharded weight files
INDEX_FILE = "model.safetensors.index.json"


def marker_key(implementation: str) -> str:
    """The key of the marker tensor of a checkpoint saved with ``implementation`` (see the module docstring)."""
    return f"hf_attnorm.{implementation}.{MARKER_SUFFIX}"


def is_marker(key: str) -> bool:
    """Whether a checkpoint key is the marker tensor (not a weight of any model)."""
    return re.search(MARKER_PATTERN, key) is not None


class CheckpointError(AttnormError):
    """A checkpoint that is corrupted, truncated or inconsistent."""


# ------------------------------------------------------------------------------------------- safetensors headers


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor index + ``__metadata__``), checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{path}: corrupted or truncated safetensors header (header length {n}, file "
                                  f"size {size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupted safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError):
            raise CheckpointError(f"{path}: corrupted safetensors header entry {name!r}") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: truncated or padded safetensors file: header promises {8 + n + end} bytes, "
                              f"file has {size}")
    return header


def write_safetensors_metadata(path: Path, extra: Mapping[str, str], marker: str | None = None) -> None:
    """Add ``extra`` to the header metadata of a safetensors file, copying the tensor bytes unchanged (atomic).
    ``marker``: also append a one-byte uint8 tensor of shape [1] under that key (after every other tensor's bytes;
    kept when the file has it already)."""
    header = read_safetensors_header(path)
    meta = dict(header.get("__metadata__") or {})
    meta.update({str(k): str(v) for k, v in extra.items()})
    header["__metadata__"] = meta
    tail = b""
    if marker is not None and marker not in header:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        header[marker] = {"dtype": "U8", "shape": [1], "data_offsets": [end, end + 1]}
        tail = b"\x00"
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # keep the data section 8-byte aligned, as safetensors writes it
    with open(path, "rb") as src:
        (old_n,) = struct.unpack("<Q", src.read(8))
        src.seek(8 + old_n)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as dst:
                dst.write(struct.pack("<Q", len(blob)))
                dst.write(blob)
                shutil.copyfileobj(src, dst, length=16 << 20)
                dst.write(tail)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


# -------------------------------------------------------------------------------------------------------- saving


def finalize_saved(model: nn.Module, save_directory: Any, kwargs: Mapping[str, Any]) -> None:
    """After transformers' ``save_pretrained``: settings into config.json and the safetensors headers, checksums."""
    if not kwargs.get("is_main_process", True):
        return
    config = getattr(model, "config", None)
    impl = canonical(getattr(config, "_attn_implementation", None))
    if config is None or not is_ours(impl):
        return
    directory = Path(save_directory)
    settings = AttnormSettings.from_dict(config.attnorm).to_dict()
    saved = {**settings, "hf_attnorm_version": __version__}
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["attnorm"] = saved
    cfg["attn_implementation"] = saved_name(impl)
    atomic_write(cfg_path, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    files = weight_files(directory)
    if not files:
        raise CheckpointError(f"{directory}: save_pretrained wrote no .safetensors file; hf_attnorm checkpoints need "
                              "safetensors (safe_serialization=True)")
    meta = {METADATA_KEY: json.dumps(settings, sort_keys=True), VERSION_KEY: __version__}
    marker = marker_key(impl)
    for i, f in enumerate(files):
        write_safetensors_metadata(f, meta, marker=marker if i == 0 else None)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index.setdefault("weight_map", {})[marker] = files[0].name
        atomic_write(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
    sums = {f.name: sha256_file(f) for f in files}
    atomic_write(directory / CHECKSUM_FILE, json.dumps({"sha256": sums}, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------------------------- loading



def _with_defaults(saved: dict | None) -> dict | None:
    """Settings saved by an older version, with the options added since at their defaults (what loading them
    resolves to), so that only a real difference counts; as saved when they no longer resolve."""
    if not saved or "implementation" not in saved:
        return saved
    try:
        return settings_core(AttnormSettings.from_dict(saved).to_dict())
    except AttnormError:
        return saved

def verify_checkpoint(directory: str | os.PathLike, overrides: Mapping[str, Any] | None = None
                      ) -> AttnormSettings | None:
    """Check a local checkpoint folder; returns its settings (None for a plain checkpoint). Raises CheckpointError.
    overrides: the settings the model will be built with when they are not the saved ones (``from_pretrained(
    attnorm=...)``), read by the shape checks."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    raw = cfg.get("attnorm")
    settings = None
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise CheckpointError(f"{cfg_path}: 'attnorm' must be a dict of settings, got {type(raw).__name__}")
        try:
            settings = AttnormSettings.from_dict(raw)
        except AttnormError as e:
            raise CheckpointError(f"{cfg_path}: invalid hf_attnorm settings (saved by hf_attnorm "
                                  f"{raw.get('hf_attnorm_version', '?')}, this is {__version__}): {e}") from None
    sums_path = directory / CHECKSUM_FILE
    expected: dict[str, str] = {}
    if sums_path.is_file():
        try:
            expected = dict(json.loads(sums_path.read_text())["sha256"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{sums_path}: unreadable checksum file ({e})") from None
        for name, digest in expected.items():
            f = directory / name
            if not f.is_file():
                raise CheckpointError(f"{f}: weight file listed in {CHECKSUM_FILE} is missing")
            got = sha256_file(f)
            if got != digest:
                raise CheckpointError(f"{f}: sha256 mismatch (expected {digest[:16]}..., got {got[:16]}...): the "
                                      "file was modified, truncated or corrupted after saving")
    for f in weight_files(directory):
        header = read_safetensors_header(f)
        meta = header.get("__metadata__") or {}
        if METADATA_KEY in meta:
            try:
                saved = json.loads(meta[METADATA_KEY])
            except json.JSONDecodeError:
                raise CheckpointError(f"{f}: corrupted '{METADATA_KEY}' metadata in the safetensors header") from None
            if settings is None:
                raise CheckpointError(f"{f}: the safetensors metadata holds hf_attnorm settings "
                                      f"({saved.get('implementation')!r}) but {cfg_path} has none: the files disagree")
            a, b = _with_defaults(settings_core(saved)), settings_core(settings.to_dict())
            if a != b:
                diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                raise CheckpointError(
                    f"{cfg_path} and {f} disagree on the hf_attnorm settings: "
                    + ", ".join(f"{k}: config.json={b.get(k)!r} vs safetensors={a.get(k)!r}" for k in diff)
                )
        elif settings is not None and expected:
            raise CheckpointError(f"{f}: no '{METADATA_KEY}' metadata although {cfg_path} holds hf_attnorm settings "
                                  "and the folder has checksums: the weight file was replaced")
        if settings is not None:
            _check_memory_shape(cfg, settings, overrides, header, f)
    return settings


def _check_memory_shape(cfg: Mapping[str, Any], settings: AttnormSettings, overrides: Mapping[str, Any] | None,
                        header: Mapping[str, Any], f: Path) -> None:
    """Learned memory key/values are per key/value head ([Hkv, M, D]); a GQA checkpoint saved with one memory per
    query head ([H, M, D], the shape before) cannot be mapped onto that exactly: refused, naming the option that
    loads it unchanged (transformers' own size-mismatch error would not say why)."""
    mode = (settings.options if overrides is None else overrides).get(MEM_KV_HEADS, "kv")
    if settings.options.get(NUM_MEM_KV, 0) <= 0 or mode != "kv":
        return
    h, hkv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not (isinstance(h, int) and isinstance(hkv, int) and h != hkv):
        return
    for name, info in header.items():
        if name.endswith(("attnorm.mem_k", "attnorm.mem_v")) and list(info.get("shape", []))[:1] == [h]:
            fix = {**{k: v for k, v in settings.to_dict().items() if k != "implementation"}, MEM_KV_HEADS: "query"}
            raise CheckpointError(
                f"{f}: {name} has shape {info['shape']}: one learned memory per query head (H={h}), saved before "
                f"memory key/values became per key/value head (Hkv={hkv}, as x-transformers). It cannot be mapped "
                f"onto [Hkv, M, D] exactly; load it unchanged with from_pretrained(..., attnorm={fix!r}), which "
                "keeps one memory per query head (k/v are then repeated to the query heads)")


def verify_before_load(path: Any, kwargs: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> None:
    """Called by the ``from_pretrained`` hook before transformers reads anything (local folders only); overrides:
    its ``attnorm=`` settings."""
    if os.environ.get("HF_ATTNORM_VERIFY", "1") == "0" or path is None:
        return
    directory = Path(path)
    if kwargs.get("subfolder"):
        directory = directory / kwargs["subfolder"]
    if overrides is None:  # Auto classes hand from_pretrained(attnorm=...) over as the config's attribute
        overrides = getattr(kwargs.get("config"), "attnorm", None)
    if directory.is_dir():
        verify_checkpoint(directory, overrides if isinstance(overrides, Mapping) else None)


def verify_loaded(model: nn.Module, path: Any, kwargs: Mapping[str, Any]) -> None:
    """After loading: a checkpoint saved with learned per-head values must have delivered all of them."""
    if os.environ.get("HF_ATTNORM_VERIFY", "1") == "0" or path is None or not Path(str(path)).is_dir():
        return
    directory = Path(str(path)) / kwargs.get("subfolder", "")
    files = weight_files(directory)
    if not files:
        return
    saved_keys: set[str] = set()
    saved_impl = None
    for f in files:
        header = read_safetensors_header(f)
        saved_keys |= {k for k in header if k != "__metadata__"}
        meta = header.get("__metadata__") or {}
        if METADATA_KEY in meta:
            saved_impl = json.loads(meta[METADATA_KEY]).get("implementation")
    if saved_impl is None:
        return
    for name, mod in model.named_modules():
        if isinstance(mod, AttnormState) and mod.settings.implementation == saved_impl:
            for pname in mod.learnable_names():
                full = f"{name}.{pname}"
                # transformers marks every parameter it filled from the checkpoint; that follows its key renaming
                # (ViT saves encoder.layer.N, the module is layers.N), which comparing names cannot
                if getattr(mod._parameters[pname], "_is_hf_initialized", False):
                    continue
                if not any(k == full or k.endswith("." + full) or full.endswith("." + k) for k in saved_keys):
                    raise CheckpointError(f"{files[0].parent}: the checkpoint was saved with {saved_impl!r} but its "
                                          f"weights lack the learned parameter {full!r}")
