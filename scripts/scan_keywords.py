"""Scan the installed transformers for every attention module that calls the attention interface, and classify each
keyword it passes by name to the attention function the way hf_attnorm does at load time
(``hf_attnorm.hf.families.keyword_role``): implemented, ignored with a reason, passed through as transformers declares
it, or refused. Writes ``keywords.json`` and ``keywords.md`` into the output directory.

Run it after a transformers release: a new refused keyword names the families whose attention it would change.

    python scripts/scan_keywords.py --out-dir bench/families
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import pkgutil
import runpy
import sys
import warnings
from pathlib import Path

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py"))  # offline; checkout

import torch  # noqa: E402
import transformers  # noqa: E402
import transformers.models  # noqa: E402

from hf_attnorm.hf.families import _INTERFACE_MARKERS, _forward_source, interface_keywords, keyword_role  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True, help="directory for keywords.json and keywords.md")
    p.add_argument("--only", nargs="*", default=None,
                   help="model folders of transformers.models to scan (default: all of them)")
    return p.parse_args(argv)


def attention_classes(folders: list[str] | None) -> tuple[dict[str, list[type]], list[str]]:
    """{model folder: attention module classes whose forward calls the interface}, and folders that failed to
    import (with why)."""
    found: dict[str, list[type]] = {}
    failed: list[str] = []
    names = folders or sorted(m.name for m in pkgutil.iter_modules(transformers.models.__path__) if m.ispkg)
    for folder in names:
        pkg = f"transformers.models.{folder}"
        try:
            subs = [m.name for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__)
                    if m.name.startswith("modeling_") and not m.name.startswith(("modeling_tf_", "modeling_flax_"))]
        except Exception as exc:  # noqa: BLE001 (a folder that does not import is reported, not fatal)
            failed.append(f"{folder}: {type(exc).__name__}")
            continue
        for sub in subs:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mod = importlib.import_module(f"{pkg}.{sub}")
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{folder}.{sub}: {type(exc).__name__}")
                continue
            for _, cls in inspect.getmembers(mod, inspect.isclass):
                if cls.__module__ != mod.__name__ or not issubclass(cls, torch.nn.Module):
                    continue
                src = _forward_source(cls)
                if any(m in src for m in _INTERFACE_MARKERS):
                    found.setdefault(folder, []).append(cls)
    return found, failed


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    found, failed = attention_classes(args.only)
    rows = []
    for folder, classes in found.items():
        for cls in classes:
            kws = sorted(interface_keywords(cls))
            roles = {k: keyword_role(k) for k in kws}
            rows.append({"folder": folder, "class": cls.__name__, "keywords": {k: r.kind for k, r in roles.items()},
                         "refused": {k: r.why for k, r in roles.items() if not r.accepted}})
    refused = [r for r in rows if r["refused"]]
    result = {"transformers": transformers.__version__, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "command": "python scripts/scan_keywords.py " + " ".join(sys.argv[1:]),
              "attention_classes": len(rows), "folders": len(found), "refused_classes": len(refused),
              "import_failures": failed, "classes": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "keywords.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Attention keywords of transformers {transformers.__version__}", "",
             f"`{result['command']}` ({result['date']}): {len(rows)} attention classes in {len(found)} model "
             "folders call the attention "
             f"interface; {len(refused)} pass a keyword hf_attnorm refuses (their families are refused at load "
             f"with the keyword named). {len(failed)} modeling files did not import here.", "",
             "| folder | class | refused keyword | why |", "|---|---|---|---|"]
    for r in refused:
        for k, why in r["refused"].items():
            lines.append(f"| {r['folder']} | {r['class']} | `{k}` | {why} |")
    (args.out_dir / "keywords.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))


if __name__ == "__main__":
    main()
