"""The versions hf_attnorm supports and the environments CI runs, in one module that imports nothing: .ci/run reads
the pins from it (``python3 hf_attnorm/supported.py requirements <environment>``), scripts/gpu_setup.py reads the
floors before torch exists, and the README's "Supported" line is generated from it. tests/test_versions.py fails
when pyproject.toml, .ci/run or the docs drift from it.

Floors are measured, not inherited: ``MIN_TORCH`` is the lowest torch on which the package installs without
touching the torch already there and its torch-dependent tests pass (CI's ``floor`` environment, with
``MIN_TRANSFORMERS``).
"""

from __future__ import annotations

import re
import sys

#: the lowest torch the package installs on and its torch-dependent tests pass on (CI's floor environment); also
#: the lowest newer transformers run on (5.24 disables torch below 2.6), so nothing lower was tried. Features that
#: need a newer torch are declared in hf_attnorm/torch_compat.py (TORCH_FEATURES)
MIN_TORCH = "2.6.0"
#: the triton torch MIN_TORCH pins: the lowest the Triton kernels and their interpreted tests run on (pyproject.toml's
#: dev extra asks for it)
MIN_TRITON = "3.2.0"
#: the lowest transformers version hf_attnorm supports (CI's floor environment)
MIN_TRANSFORMERS = "5.4.0"
#: the newest transformers the whole suite ran on (CI's main environment); newer ones are allowed, not yet tested
TESTED_NEWEST = "5.24.0"
#: the torch of the README's recipe (a CPU build on disk here): CI's main environment runs the whole suite on it
MAIN_TORCH = "2.13.0"
#: the triton pip picked for the main environment when the suite last ran (the CPU build of torch pins none)
TESTED_TRITON = "3.9.0"
#: the first triton whose interpreter runs beside numpy >= 2.4 (older ones call int() on a one-element array, which
#: numpy 2.4 refuses; triton-lang/triton#9171): only Triton's CPU interpreter (the tests) is affected
TRITON_INTERPRETER_NUMPY24 = "3.7.0"

#: CI's environments beside the main one, in the order .ci/run runs them: name -> (pins, what it is, the groups of
#: tests it runs: CI_GROUPS). Environments with the same torch share one virtual environment (torch, a CUDA build of
#: several GB that runs on the CPU, is installed once), so they must pin the same triton and numpy
#: (tests/test_versions.py checks it): the next one only swaps transformers. The package goes in over torch without
#: touching it. triton is the version that torch pins; numpy < 2.4 where that triton's interpreter needs it.
CI_ENVIRONMENTS: dict[str, tuple[dict[str, str], str, tuple[str, ...]]] = {
    "gpu-image": ({"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "numpy": "<2.4"},
                  "the GPU machine's software, the package installed offline, with the GPU check's dry run",
                  ("torch",)),
    "floor": ({"torch": MIN_TORCH, "triton": MIN_TRITON, "transformers": MIN_TRANSFORMERS, "numpy": "<2.4"},
              "the lowest supported torch and transformers", ("torch", "transformers")),
    "newest-torch": ({"torch": "2.14.1", "triton": "3.8.0", "transformers": TESTED_NEWEST},
                     "the newest torch pip installs here", ("torch", "transformers")),
}
#: the groups of tests an environment can run (.ci/run holds the files of each), in words (the README's Supported
#: line): "torch" = the tests that depend on torch; "transformers" = the ones that read transformers' internals
CI_GROUPS = {"torch": "the torch-dependent tests (kernels against the reference, C++ build, compile, export, "
                      "interpreted Triton kernels)",
             "transformers": "the transformers contract, training stacks and cache-bound decoding"}
def release(version: str) -> tuple[int, int, int]:
    """``"5.4.0"`` -> (5, 4, 0); pre-releases and local tags count as their release (``"2.11.0+cu130"`` -> 2.11.0)."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(x or 0) for x in m.groups())  # type: ignore[return-value]


#: every torch CI runs, lowest first
CI_TORCH = tuple(sorted({MAIN_TORCH, *(pins["torch"] for pins, *_ in CI_ENVIRONMENTS.values())},
                        key=release))
#: every transformers CI runs: the newest release pip picks that day in the main environment (last:
#: TESTED_NEWEST) and the ones pinned in the other environments, lowest first
CI_VERSIONS = tuple(sorted({TESTED_NEWEST, *(pins["transformers"] for pins, *_ in CI_ENVIRONMENTS.values())},
                           key=release))


def torch_problem(version: str) -> str | None:
    """None when torch ``version`` is supported, else why not (one line, with what is allowed)."""
    if release(version) < release(MIN_TORCH):
        return f"hf_attnorm needs torch >= {MIN_TORCH} (CI runs {', '.join(CI_TORCH)}); this is torch {version}"
    return None


def _environment(environment: str) -> dict[str, str]:
    if environment not in CI_ENVIRONMENTS:
        raise SystemExit(f"unknown CI environment {environment!r}; known: {', '.join(CI_ENVIRONMENTS)}")
    return CI_ENVIRONMENTS[environment][0]


def requirements(environment: str) -> list[str]:
    """pip requirement specifiers of a CI environment: ``["torch==2.6.0", "triton==3.2.0", ...]``."""
    return [f"{name}{v if v[0] in '<>=!~' else '==' + v}" for name, v in _environment(environment).items()]


def base_requirements(environment: str) -> list[str]:
    """The specifiers its virtual environment is created with: all but transformers (swapped per environment)."""
    return [r for r in requirements(environment) if not r.startswith("transformers")]


def venv(environment: str) -> str:
    """The virtual environment's directory, one per torch: ``.venv-torch-2.11.0``."""
    return f".venv-torch-{_environment(environment)['torch']}"


def runs(environment: str) -> list[str]:
    """The groups of tests the environment runs (keys of CI_GROUPS)."""
    _environment(environment)
    return list(CI_ENVIRONMENTS[environment][2])


_COMMANDS = {"requirements": requirements, "base-requirements": base_requirements, "venv": lambda e: [venv(e)],
             "runs": runs}


if __name__ == "__main__":  # for .ci/run: `names`, or `<command> <environment>` (commands: _COMMANDS)
    if sys.argv[1:] == ["names"]:
        print(" ".join(CI_ENVIRONMENTS))
    elif len(sys.argv) == 3 and sys.argv[1] in _COMMANDS:
        print(" ".join(_COMMANDS[sys.argv[1]](sys.argv[2])))
    else:
        raise SystemExit(f"usage: python3 hf_attnorm/supported.py names | {{{'|'.join(_COMMANDS)}}} <environment>")
