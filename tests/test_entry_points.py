"""The console commands: pyproject.toml's ``[project.scripts]`` names a ``main`` of the lab for each command of
scripts/ that the README shows, the script runs that same function, each answers ``--help``, and the offline default
they share reaches the hub libraries that were imported before it."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_attnorm.lab.cli import OFFLINE_VARIABLES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML reader pytest itself depends on there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

#: script of scripts/ -> its console command
COMMANDS = {
    "pretrain": "hf-attnorm-pretrain",
    "finetune": "hf-attnorm-finetune",
    "evaluate": "hf-attnorm-evaluate",
    "convert": "hf-attnorm-convert",
    "convert_study": "hf-attnorm-convert-study",
    "compare": "hf-attnorm-compare",
}
#: console commands of the plugin itself (no script of scripts/, no lab extra): command -> its ``main``
PLUGIN_COMMANDS = {"hf-attnorm-serve": "hf_attnorm.serve:main"}
#: scripts the README names that have no console command: the scale analysis, and a checkout's benchmarks, document
#: generator and GPU check
WITHOUT_COMMAND = {"scale_analysis", "bench_kernels", "render_readme", "gpu_check"}


def declared() -> dict[str, str]:
    """pyproject.toml's ``[project.scripts]``: command -> ``module:function``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"].get("scripts", {})


def target(command: str) -> Callable[..., int]:
    """The function a console command calls."""
    module, _, function = declared()[command].partition(":")
    return getattr(importlib.import_module(module), function)


def load_script(name: str):
    """scripts/<name>.py as a module (its preamble runs; its ``__main__`` block does not)."""
    spec = importlib.util.spec_from_file_location(f"entry_point_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pyproject_declares_one_command_per_script():
    scripts = declared()
    assert set(scripts) == set(COMMANDS.values()) | set(PLUGIN_COMMANDS)
    for command, spec in scripts.items():
        if command in PLUGIN_COMMANDS:
            assert spec == PLUGIN_COMMANDS[command]
        else:
            assert re.fullmatch(r"hf_attnorm\.lab(\.\w+)+:\w*main", spec), (command, spec)


def test_the_serve_command_is_python_m_hf_attnorm_serve_and_answers_help(capsys):
    import hf_attnorm.__main__ as cli

    assert target("hf-attnorm-serve") is cli.serve.main
    assert cli.main(["serve", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m hf_attnorm serve PATH")


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_the_script_and_its_command_run_the_same_function(script):
    function = target(COMMANDS[script])
    assert callable(function)
    assert load_script(script).main is function


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_every_command_answers_help(script, capsys):
    with pytest.raises(SystemExit) as stopped:
        target(COMMANDS[script])(["--help"])
    assert stopped.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--output_dir" in out


def test_every_script_the_readme_runs_is_a_command_by_the_readmes_rule():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"scripts/([a-z_]+)\.(?:py|sh)\b", readme))
    assert named - WITHOUT_COMMAND == set(COMMANDS), "a script the README names needs a console command (or a reason)"
    assert re.search(r"`python scripts/X\.py` .* command `hf-attnorm-X` \(`_` → `-`\)", readme)
    for script, command in COMMANDS.items():
        assert command == "hf-attnorm-" + script.replace("_", "-")


def test_the_installed_command_answers_help():
    beside_python = Path(sys.executable).parent
    executable = shutil.which("hf-attnorm-compare", path=os.pathsep.join([str(beside_python),
                                                                          os.environ.get("PATH", "")]))
    if executable is None:
        pytest.skip("the console commands are not installed in this environment (`pip install -e .` installs them)")
    proc = subprocess.run([executable, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ") and "--budget" in proc.stdout, proc.stderr


OFFLINE_CHECK = """
import json, os
import datasets.config
import huggingface_hub.constants as hub
from hf_attnorm.lab import training
from hf_attnorm.lab.cli import OFFLINE_VARIABLES, offline_by_default

def state():
    return {"hub": hub.HF_HUB_OFFLINE,
            "datasets": [datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE],
            "env": {v: os.environ.get(v) for v in OFFLINE_VARIABLES}}

before = state()
with offline_by_default() as set_now:
    inside = state()
after = state()
during_main = []
training._run = lambda kind, argv: during_main.append(state())  # what a command's run sees
code = training.main("pretrain", [])
print(json.dumps({"before": before, "set": set_now, "inside": inside, "after": after, "main": during_main,
                  "after_main": state(), "code": code}))
"""


@pytest.mark.parametrize("user", [{}, {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}], ids=["unset", "online"])
def test_the_offline_default_reaches_libraries_imported_before_it_for_the_run_only(user):
    """A console command imports huggingface_hub and datasets (with hf_attnorm) before its main sets the variables:
    they are offline inside the run unless the user said otherwise; a main called from Python (a notebook) leaves
    the variables and the libraries' copies of them as they were."""
    pytest.importorskip("datasets")
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARIABLES}
    env.update(user, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", OFFLINE_CHECK], capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["before"]["hub"] is False and seen["before"]["datasets"] == [False, False]
    offline = not user
    assert seen["set"] == [v for v in OFFLINE_VARIABLES if v not in user]
    for run in (seen["inside"], *seen["main"]):
        assert run["hub"] is offline and run["datasets"] == [offline, offline]
    assert len(seen["main"]) == 1 and seen["code"] == 0
    assert seen["after"] == seen["before"] and seen["after_main"] == seen["before"]
