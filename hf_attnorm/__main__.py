"""``python -m hf_attnorm``: list the registered implementations, normalizers, scales and options.

``python -m hf_attnorm`` prints the Markdown tables of implementations and options; ``--markdown SECTION`` prints one
generated README/docs section (``scripts/render_readme.py`` writes them between marker comments, and
``tests/test_readme.py`` fails when a document differs from this output). Everything is read from the registries.

``python -m hf_attnorm serve PATH [options of transformers serve]`` serves a checkpoint through transformers'
OpenAI-compatible server with the plugin loaded (``hf_attnorm.serve``; ``serve --help`` lists its options).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import hf_attnorm
from hf_attnorm import serve, supported
from hf_attnorm.attention import param_specs
from hf_attnorm.kernels import PATHS, paths_for
from hf_attnorm.registry import NORMALIZERS, PRESETS, SCALES
from hf_attnorm.settings import GLOBAL_OPTIONS, OPTIONS, resolve_settings
from hf_attnorm.torch_compat import TORCH_FEATURES

#: paths every normalizer has (pure PyTorch fallbacks), left out of the fast-path columns
FALLBACK_PATHS = ("chunked", "reference")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def _link_urls(text: str) -> str:
    """Markdown links for the URLs in a declared ``paper``: arXiv ones labelled ``arXiv:ID``, others by host/path."""

    def label(m: re.Match[str]) -> str:
        url = m.group(0)
        arxiv = re.match(r"https://arxiv\.org/abs/(\S+)", url)
        short = f"arXiv:{arxiv.group(1)}" if arxiv else url.split("://", 1)[1]
        return f"[{short}]({url})"

    return re.sub(r"https?://[^\s;,)]+", label, text)


def fast_paths(normalizer: str, device: str) -> list[str]:
    """The fast paths the automatic rule may pick for ``normalizer`` on a device type ("cpu" or "cuda")."""
    return [p for p in paths_for(normalizer) if p not in FALLBACK_PATHS and device not in PATHS[p].auto_exclude]


def learned_values(implementation: str) -> str:
    """Per-head values of an implementation's default settings: learned ones plain, constants marked."""
    s = resolve_settings(implementation)
    out = []
    for spec in param_specs(s):
        learned = spec.is_learnable(s)
        out.append(f"`{spec.name}`" if learned else f"`{spec.name}` (constant unless `{spec.learnable_option}`)")
    return ", ".join(out) or "—"


def implementations_table() -> str:
    """One row per attention implementation: formula, paper, fast paths by device, per-head values."""
    lines = ["| attn_implementation | formula | paper | CPU fast paths | GPU fast paths | per-head values |",
             "|---|---|---|---|---|---|"]
    for name, preset in PRESETS.items():
        s = resolve_settings(name)
        papers = [NORMALIZERS.get(s.normalizer).paper]
        if s.scale != "standard":
            papers.append(SCALES.get(s.scale).paper)
        papers = [p for i, p in enumerate(papers) if p and p not in papers[:i]]
        cpu = ", ".join(fast_paths(s.normalizer, "cpu")) or "—"
        gpu = ", ".join(fast_paths(s.normalizer, "cuda")) or "—"
        lines.append(f"| `{name}` | {_cell(preset.description)} | {_cell(_link_urls('; '.join(papers)))} | {cpu} "
                     f"| {gpu} | {learned_values(name)} |")
    return "\n".join(lines)


def options_table() -> str:
    lines = ["| option | used by | default | meaning |", "|---|---|---|---|"]
    for name, opt in OPTIONS.items():
        users = [n for n, obj in (*NORMALIZERS.items(), *SCALES.items()) if name in obj.options]
        users = users or (["every normalizer"] if name in GLOBAL_OPTIONS else [])
        lines.append(f"| `{name}` | {', '.join(users)} | `{opt.default!r}` | {_cell(opt.help)} |")
    return "\n".join(lines)


def markdown_tables() -> str:
    return implementations_table() + "\n\n" + options_table()


def learned_list() -> str:
    """Every per-head value any normalizer, scale or global option can create, with its owner and help (one line
    per owner and learnable option): what a checkpoint may hold under ``...attnorm.<name>``."""
    seen: set[str] = set()
    lines: dict[tuple[str, str], list[str]] = {}
    owners = [(f"normalizer `{n}`", obj.params) for n, obj in NORMALIZERS.items()]
    owners += [(f"scale `{n}`", obj.params) for n, obj in SCALES.items()]
    memory = resolve_settings("softmax", {"num_mem_kv": 1})
    owners.append(("option `num_mem_kv` > 0 (every normalizer)",
                   tuple(p for p in param_specs(memory) if p.name not in {q.name for q in NORMALIZERS.get(
                       "softmax").params})))
    for owner, specs in owners:
        for spec in specs:
            if spec.name not in seen:
                seen.add(spec.name)
                lines.setdefault((owner, spec.learnable_option), []).append(f"`{spec.name}`: {spec.help}")
    return "\n".join(f"* {owner}, learned when `{learnable}` is true (default `{OPTIONS.get(learnable).default!r}`): "
                     + "; ".join(entries) for (owner, learnable), entries in lines.items())


def versions_line() -> str:
    """The supported Python/torch/triton/transformers ranges and the versions CI runs, read from
    ``hf_attnorm.supported`` (the same data .ci/run installs)."""
    envs = "; ".join(f"torch {p['torch']} / triton {p['triton']} / transformers {p['transformers']} ({what}): "
                     f"{' and '.join(supported.CI_GROUPS[g] for g in groups)}"
                     for p, what, groups in supported.CI_ENVIRONMENTS.values())
    return (f"Supported: Python >= 3.10; torch >= {supported.MIN_TORCH}, no upper cap; triton: the version your "
            f"torch pins (the GPU kernels need it; nothing else does); transformers >= {supported.MIN_TRANSFORMERS}, "
            f"no upper cap. CI runs the whole suite on torch {supported.MAIN_TORCH} (CPU build) with triton "
            f"{supported.TESTED_TRITON} and the newest transformers (last: {supported.TESTED_NEWEST}), then, on "
            f"{envs}. {torch_features_sentence()}")


def torch_features_sentence() -> str:
    """One sentence naming each feature that needs a newer torch than the lowest supported one, with its version
    and, where an older torch gets one, the fallback (``hf_attnorm.torch_compat.TORCH_FEATURES``)."""
    items = [f"{f.name} needs torch >= {f.since}" + (" (older: the same results, slower or with more memory)"
                                                      if f.fallback else "")
             for f in sorted(TORCH_FEATURES, key=lambda f: supported.release(f.since))]
    return f"Features that need a newer torch than {supported.MIN_TORCH}: {'; '.join(items)} (docs/internals.md)."


def torch_features_table() -> str:
    """Each feature that needs a newer torch than the lowest supported one: the version, what an older torch does and
    what hf_attnorm does there (``hf_attnorm.torch_compat.TORCH_FEATURES``)."""
    lines = ["| feature | needs torch | on an older torch | there |", "|---|---|---|---|"]
    for f in sorted(TORCH_FEATURES, key=lambda f: supported.release(f.since)):
        instead = f"runs exactly all the same: {f.fallback}; one warning" if f.fallback else f"unsupported: {f.remedy}"
        lines.append(f"| {f.name} | >= {f.since} | {f.older} | {instead} |")
    return "\n".join(lines)


#: ``--markdown`` sections: name -> generator
SECTIONS = {
    "implementations": implementations_table,
    "options": options_table,
    "learned": learned_list,
    "versions": versions_line,
    "torch-features": torch_features_table,
}


def main(argv: Sequence[str] | None = None) -> int | None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        return serve.main(args[1:], exit_process=argv is None)
    parser = argparse.ArgumentParser(prog="python -m hf_attnorm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="all",
                        choices=["all", "implementations", "normalizers", "scales", "options", "serve"],
                        help="what to list as name and description (default: the Markdown tables of implementations "
                             "and options); serve: serve a checkpoint (python -m hf_attnorm serve --help)")
    parser.add_argument("--markdown", choices=sorted(SECTIONS), default=None,
                        help="print one generated Markdown section instead (the README and docs carry them verbatim)")
    ns = parser.parse_args(args)
    if ns.markdown:
        print(SECTIONS[ns.markdown]())
        return
    if ns.what == "all":
        print(markdown_tables())
        return
    for name, desc in hf_attnorm.available(ns.what).items():
        print(f"{name:24s} {desc}")


if __name__ == "__main__":
    sys.exit(main())
