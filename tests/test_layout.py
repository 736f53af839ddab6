"""The package's shape: a one-way import chain in the plugin core, and a core that needs only torch, transformers and
safetensors (the lab's dependencies are extras)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hf_attnorm"

#: layer of each core module (a module may import only from lower or equal layers; equal = inside a package)
LAYERS = {
    "version": 0, "supported": 0, "fileio": 0, "registry": 0, "torch_compat": 0,
    "settings": 1,
    "masks": 2, "normalizers": 2, "scales": 2,
    "kernels": 3,
    "attention": 4,
    "hf": 5,
    "__init__": 6, "__main__": 6, "serve": 6, "serve_guard": 6,
    "lab": 7,
}
#: numpy is a hard dependency of transformers; triton is optional (imported under a guard)
CORE_THIRD_PARTY = {"torch", "transformers", "safetensors", "numpy", "triton"}


def _module_of(path: Path) -> str:
    return path.relative_to(PKG).parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, with relative imports resolved to ``hf_attnorm.<top-level module>``, line) per import."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG).with_suffix("").parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[: len(rel) - node.level])
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target[0]] if target else [a.name for a in node.names]
                out += [("hf_attnorm." + n, node.lineno) for n in names]
            elif node.module:
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return out


def _function_level_imports(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines += [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))
                      and (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("hf_attnorm")))]
    return lines


CORE_FILES = [p for p in sorted(PKG.rglob("*.py")) if _module_of(p) != "lab"]
#: the lab's metric script is run by ``evaluate`` from a copy, where its own package import must stay guarded
LAB_FILES = [p for p in sorted((PKG / "lab").rglob("*.py")) if "attnorm_perplexity" not in p.parts]


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_core_imports_flow_one_way(path: Path) -> None:
    layer = LAYERS[_module_of(path)]
    for target, line in _imports(path):
        if target.startswith("hf_attnorm."):
            dep = target.split(".")[1]
            assert LAYERS[dep] <= layer, f"{path.name}:{line} imports {target} (layer {LAYERS[dep]} > {layer})"


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_core_has_no_function_level_package_imports(path: Path) -> None:
    # a lazy import of our own modules inside a function is how a cycle hides
    assert _function_level_imports(path) == [], f"{path}: package imports inside functions"


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_core_needs_only_the_plugin_dependencies(path: Path) -> None:
    stdlib = set(sys.stdlib_module_names)
    for target, line in _imports(path):
        top = target.split(".")[0]
        assert top in stdlib or top in CORE_THIRD_PARTY or top == "hf_attnorm", (
            f"{path.relative_to(PKG)}:{line} imports {target}: the plugin core may use only torch, transformers, "
            "safetensors (and triton, optional) — the lab's dependencies are extras")


def test_import_loads_no_lab_module() -> None:
    code = "import sys, hf_attnorm; print(sorted(m for m in sys.modules if m.startswith('hf_attnorm.lab')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("path", LAB_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_lab_has_no_function_level_package_imports(path: Path) -> None:
    # the lab imports its own modules at the top (only optional third-party packages are imported lazily)
    assert _function_level_imports(path) == [], f"{path}: package imports inside functions"


KERNELS = PKG / "kernels"
#: the kernel folders whose modules the others may use: ``fused`` holds the Triton helpers the other Triton kernels
#: share
SHARED_FAMILY = "fused"


def _kernel_imports(path: Path) -> list[tuple[tuple[str, ...], int]]:
    """The modules of hf_attnorm.kernels that ``path`` imports, as parts below ``kernels`` (``("fused", "cpu")``)."""
    rel = path.relative_to(PKG).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = [*rel[: len(rel) - node.level], *(node.module.split(".") if node.module else [])]
            else:
                target = (node.module or "").split(".")[1:]
            if target[:1] != ["kernels"]:
                continue
            for alias in node.names:  # `from ..fused import cpu` imports the module fused.cpu
                full = (*target[1:], alias.name)
                out.append((full if (KERNELS.joinpath(*full[:-1], full[-1] + ".py").exists()
                                     or KERNELS.joinpath(*full).is_dir()) else tuple(target[1:]), node.lineno))
    return out


KERNEL_FILES = sorted(KERNELS.rglob("*.py"))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_a_call_walks_down_the_kernel_layer(path: Path) -> None:
    """kernels/variants.py (what is around a call) uses kernels/dispatch.py (the paths and the rule), which uses
    no path: the paths register themselves with it. Only variants.py reads what is around a call (``around``)."""
    rel = path.relative_to(KERNELS).as_posix()
    imported = {parts[0] for parts, _ in _kernel_imports(path) if parts}
    if rel not in ("__init__.py", "variants.py"):
        assert "variants" not in imported, f"kernels/{rel} imports kernels.variants: only the package entry does"
    if rel == "dispatch.py":
        assert imported <= {"base", "reference"}, f"kernels/dispatch.py imports {sorted(imported)}"
    reads = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "around"]
    assert rel == "variants.py" or not reads, f"kernels/{rel}:{reads[0] if reads else 0} reads a call's around"


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_kernel_families_stay_apart(path: Path) -> None:
    """kernels/ holds the generic paths at its top and one folder per family of kernels: the generic modules import
    no family; a family imports the generic modules, its own folder and the shared one, never another family."""
    rel = path.relative_to(KERNELS).parts
    family = rel[0] if len(rel) > 1 else None
    for parts, line in _kernel_imports(path):
        target_family = parts[0] if parts and KERNELS.joinpath(parts[0]).is_dir() else None
        if target_family is None or target_family == family:
            continue
        assert family is not None and family != SHARED_FAMILY and target_family == SHARED_FAMILY, (
            f"kernels/{'/'.join(rel)}:{line} imports kernels.{'.'.join(parts)}: "
            + ("a generic module imports no family folder" if family is None else
               f"family {family!r} may import only its own folder, the generic modules and {SHARED_FAMILY!r}"))


def test_every_kernel_family_is_a_package_with_its_sources_beside_it() -> None:
    """Each family folder is a package that imports its paths (so they register) and holds its own C++ source;
    the kernels folder's top holds no C++ source, only the header they share."""
    families = [d for d in KERNELS.iterdir() if d.is_dir() and d.name != "__pycache__"]
    assert {d.name for d in families} >= {"fused", "selective", "stickbreaking", "linear"}
    for d in families:
        assert (d / "__init__.py").exists(), d
    assert not list(KERNELS.glob("*.cpp")) and list(KERNELS.glob("*.h")) == [KERNELS / "cpu_common.h"]
    from hf_attnorm.kernels.native import EXTENSIONS

    assert set(EXTENSIONS) == {"fused", "stick-breaking", "selective"}
    for family, ext in EXTENSIONS.items():
        for source in ext.sources:  # one extension per family, built from the family's own folder
            assert source.exists() and source.parent.parent == KERNELS, (family, source)
            assert len({ext.sources[0].parent, source.parent}) == 1, (family, ext.sources)


_PRIVATE = re.compile(r"^_[A-Za-z]\w*$")
#: private names that are not another library's internals: ours, set on foreign objects (``_hf_attnorm_*``), and
#: ``os._exit`` (documented public API of the standard library despite its underscore)
_NOT_INTERNALS = ("_hf_attnorm", "_exit")
#: the modules whose private string constants name transformers' internals they hook or read (hook tables, compat)
_NAMING_MODULES = ("hf/compat.py", "hf/integration.py")


def _private(name: str) -> bool:
    return bool(_PRIVATE.match(name)) and not name.endswith("__") and not name.startswith(_NOT_INTERNALS)


def private_names_read() -> dict[str, list[str]]:
    """The private names the package reads of objects it does not define, name -> where (file:line): attributes
    ``x._name`` (not on ``self``/``cls``, and not a name the package defines anywhere), private names imported from
    other packages, private names passed as strings to ``getattr``/``hasattr``/``setattr``/``delattr``/
    ``getattr_static``/``hook``, and the private string constants of the modules that name what they hook."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}
    defined: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                defined.add(node.attr)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                defined.add(node.asname)
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        rel = str(path.relative_to(PKG))
        # (the literal parts of f-strings are text, not names)
        text = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name)
                                                        and node.value.id in ("self", "cls")):
                names = [node.attr] if node.attr not in defined else []
            elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith(
                    "hf_attnorm"):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in ("getattr", "hasattr", "setattr", "delattr", "getattr_static", "hook"):
                    names = [node.args[1].value] if isinstance(node.args[1].value, str) else []
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and rel in _NAMING_MODULES
                  and id(node) not in text):
                names = [node.value]
            for name in names:
                if _private(name):
                    found.setdefault(name, []).append(f"{rel}:{node.lineno}")
    return found


def test_every_private_name_the_package_reads_is_documented() -> None:
    """docs/internals.md lists every private name of another library the package relies on, with its guard: a name
    read in the source and missing from the page fails here, naming where it is read."""
    documented = set()
    for span in re.findall(r"`([^`]+)`", (PKG.parent / "docs" / "internals.md").read_text()):
        documented.update(re.findall(r"(?<![\w])_[A-Za-z]\w*", span))
    read = private_names_read()
    assert {"_global_mapping", "_forward_pre_hooks_with_kwargs", "_get_build_directory", "_thread"} <= set(read)
    missing = {name: where[:3] for name, where in sorted(read.items()) if name not in documented}
    assert not missing, f"private names read but not listed in docs/internals.md: {missing}"


#: what a conversion recipe talks about (lab/convert/recipes.py), which a normalizer's or scale's own file does not
CONVERSION_WORDS = re.compile(r"conver(t|sion|ted)|calibrat|teacher|stage[- ]1|recipe|transfer_learning_rate",
                              re.IGNORECASE)


@pytest.mark.parametrize("path", sorted([*(PKG / "normalizers").glob("*.py"), *(PKG / "scales").glob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_normalizer_and_scale_files_say_what_attention_computes_not_how_a_model_is_converted(path: Path) -> None:
    found = [(i, line.strip()) for i, line in enumerate(path.read_text().splitlines(), 1)
             if CONVERSION_WORDS.search(line)]
    assert not found, f"{path.name} speaks of conversion (it belongs in lab/convert/recipes.py): {found[:3]}"


#: the lab's sub-packages by purpose, and the modules they share (nothing else sits at the lab's top)
LAB_PACKAGES = {"convert", "training", "evaluation", "compare", "analysis", "speed"}
LAB_SHARED = {"assets", "data", "cli", "tiny", "model_zoo", "cards", "plots", "diagnostics", "distributed",
              "observe"}


def test_the_lab_is_grouped_by_purpose() -> None:
    lab = PKG / "lab"
    packages = {d.name for d in lab.iterdir() if d.is_dir() and d.name != "__pycache__"}
    modules = {p.stem for p in lab.glob("*.py")} - {"__init__"}
    assert packages == LAB_PACKAGES and modules == LAB_SHARED, (packages ^ LAB_PACKAGES, modules ^ LAB_SHARED)
    for d in packages:
        assert (lab / d / "__init__.py").exists(), d


def test_the_labs_earlier_module_names_import_the_moved_module_with_a_warning() -> None:
    # a fresh process: nothing imported under an old name yet
    code = """
import importlib, json, warnings
from hf_attnorm import lab
out = {}
for old, new in lab.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module("hf_attnorm.lab." + old)
    out[old] = [mod is importlib.import_module("hf_attnorm.lab." + new),
                [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]]
print(json.dumps(out))
"""
    import json

    from hf_attnorm import lab

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) == set(lab.MOVED) and len(out) >= 20
    for old, (same, messages) in out.items():
        assert not (PKG / "lab" / f"{old}.py").exists() and not (PKG / "lab" / old).is_dir(), old
        assert same, f"hf_attnorm.lab.{old} is not the module hf_attnorm.lab.{lab.MOVED[old]}"
        assert any(f"hf_attnorm.lab.{old} moved to hf_attnorm.lab.{lab.MOVED[old]}" in m for m in messages), messages
