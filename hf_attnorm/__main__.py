"""``python -m hf_attnorm``: list the registered implementations, normalizers, scales and options (Markdown)."""

from __future__ import annotations

import argparse

import hf_attnorm
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES
from hf_attnorm.settings import GLOBAL_OPTIONS, OPTIONS, resolve_settings


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def markdown_tables() -> str:
    lines = ["| attn_implementation | normalizer | scale | description |", "|---|---|---|---|"]
    for name, preset in PRESETS.items():
        s = resolve_settings(name)
        lines.append(f"| `{name}` | {s.normalizer} | {s.scale} | {_cell(preset.description)} |")
    lines += ["", "| option | used by | default | meaning |", "|---|---|---|---|"]
    for name, opt in OPTIONS.items():
        users = [n for n, obj in (*NORMALIZERS.items(), *SCALES.items()) if name in obj.options]
        users = users or (["every normalizer"] if name in GLOBAL_OPTIONS else [])
        lines.append(f"| `{name}` | {', '.join(users)} | `{opt.default!r}` | {_cell(opt.help)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_attnorm", description=__doc__)
    parser.add_argument("what", nargs="?", default="all",
                        choices=["all", "implementations", "normalizers", "scales", "options"],
                        help="what to list (default: the Markdown tables of implementations and options)")
    args = parser.parse_args(argv)
    if args.what == "all":
        print(markdown_tables())
        return
    for name, desc in hf_attnorm.available(args.what).items():
        print(f"{name:24s} {desc}")


if __name__ == "__main__":
    main()
