"""Serving: ``python -m hf_attnorm serve PATH`` runs transformers' OpenAI-compatible server (``transformers serve``)
with the checkpoint's hf_attnorm implementation, on continuous batching's packed route where the implementation is
exact there and on the sequential path where it is refused; plain transformers (no ``import hf_attnorm``) warns when
it loads such a checkpoint with its own attention. The end-to-end tests start the real server as a child process
on 127.0.0.1 and talk to it with the ``openai`` client and plain HTTP: answers equal greedy ``generate``, malformed
requests get a 4xx naming the field while the server keeps answering, clients that leave stop their generations, and
SIGINT during a long generation exits 0 after the grace period (the guard itself: tests/test_serve_guard.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from hf_attnorm import serve
from hf_attnorm.hf import compat, continuous_batching
from hf_attnorm.hf.continuous_batching import continuous_batching_support
from hf_attnorm.hf.persistence import marker_key
from hf_attnorm.registry import PRESETS
from hf_attnorm.settings import resolve_settings

ROOT = Path(__file__).resolve().parents[1]
needs_serving = pytest.mark.skipif(
    bool(compat.serve_missing()) or not compat.serve_extra_installed(),
    reason=f"transformers {transformers.__version__} lacks {compat.serve_missing()} (serve is refused)"
    if compat.serve_missing() else "the serving extra is not installed (pip install 'hf_attnorm[serve]': fastapi, "
                                   "uvicorn, pydantic, openai, rich)")
needs_continuous_batching = pytest.mark.skipif(
    bool(continuous_batching.CONTINUOUS_BATCHING_MISSING),
    reason=f"continuous batching is refused for hf_attnorm on transformers {transformers.__version__}")

#: the tokenizer's words (Metaspace: "▁" marks a word's start, so that a streamed answer joins into the decoded one):
#: roles and separators of the chat template, then plain words (61 = the model's vocabulary)
WORDS = ["<unk>"] + ["▁" + w for w in ("system", "user", "assistant", ":", ";", *(f"w{i}" for i in range(55)))]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
#: prompts of different lengths (more of them than the server's batch, see CB_OPTIONS)
PROMPTS = ["w1 w2 w3", "w7", "w10 w11 w12 w13 w14 w15 w16 w17", "w5 w4", "w30 w31 w32 w33"]
NEW_TOKENS = 6
#: small continuous-batching sizes for the CPU: requests wait for pages and long prompts are split
CB_OPTIONS = ["--continuous-batching", "--cb-block-size", "8", "--cb-num-blocks", "32", "--cb-max-batch-tokens", "16"]
REFUSED = [n for n in PRESETS if continuous_batching_support(resolve_settings(n))[0] == "refused"]


def save_checkpoint(path: Path, implementation: str, positions: int = 256) -> Path:
    """A tiny random-init Llama (2 layers, GQA, vocabulary 61, untied and wide so that greedy tokens depend on
    attention, ``positions`` maximum positions) saved with hf_attnorm, and a word-level tokenizer with a chat template
    built locally (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=positions, tie_word_embeddings=False, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def expected_answers(path: Path, prompts: list[str], chat: bool = True) -> list[str]:
    """Greedy ``model.generate`` on the same checkpoint (loaded with hf_attnorm), decoded as the server decodes."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    out = []
    for prompt in prompts:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_dict=True, return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


# --------------------------------------------------------------------------------------- the command line, no server


def test_refusals_name_what_is_wrong_and_what_is_allowed(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours = save_checkpoint(tmp_path / "ours", "symax")
    cases = [
        ([], r"^python -m hf_attnorm serve: the first argument must be PATH"),
        (["--port", "1"], r"^python -m hf_attnorm serve: the first argument must be PATH"),
        ([str(tmp_path / "absent")], r"^python -m hf_attnorm serve: PATH .* is not a folder; allowed: "),
        ([str(tmp_path)], r"^python -m hf_attnorm serve: .* has no config.json; allowed: "),
        ([str(plain)], r"^python -m hf_attnorm serve: .* holds no hf_attnorm settings .*allowed here: "),
        ([str(ours), "--attn-implementation", "sdpa"],
         r"^python -m hf_attnorm serve: --attn-implementation 'sdpa' is not the checkpoint's implementation "
         r"'symax'; allowed: leave the option out"),
        ([str(ours), "--attn-implementation"], r"--attn-implementation needs a value"),
    ]
    for argv, message in cases:
        with pytest.raises(serve.ServeError, match=message):
            serve.plan(argv)
    assert serve.main([str(ours), "--attn-implementation=ssmax"]) == 2  # (the command prints it and exits 2)


@needs_continuous_batching
def test_the_plan_keeps_the_checkpoints_implementation_and_its_continuous_batching_route(tmp_path, capsys):
    path = save_checkpoint(tmp_path / "symax", "symax")
    args, settings, route = serve.plan([str(path), "--port", "9", "--attn-implementation", "symax"])
    assert args == [str(path), "--port", "9"] and settings.implementation == "symax" and route == "sequential"
    args, _, route = serve.plan([str(path), *CB_OPTIONS])
    assert args == [str(path), *CB_OPTIONS]
    assert route == ("packed" if not continuous_batching.CONTINUOUS_BATCHING_MISSING else "sequential")
    _, _, route = serve.plan([str(path), "--continuous-batching", "--no-continuous-batching"])
    assert route == "sequential"


@pytest.mark.parametrize("impl", REFUSED)
def test_continuous_batching_falls_back_to_the_sequential_path_where_refused(impl, tmp_path, capsys):
    path = save_checkpoint(tmp_path / impl, impl)
    capsys.readouterr()
    args, _, route = serve.plan([str(path), *CB_OPTIONS])
    said = capsys.readouterr().err
    assert route == "sequential" and args[-1] == "--no-continuous-batching"
    assert not serve.continuous_batching_requested(args)
    assert said.startswith(f"hf_attnorm serve: WARNING: continuous batching cannot run {impl!r} exactly: ")
    assert "sequential path" in said


def test_help_lists_this_commands_rules_and_transformers_serves_options(capsys):
    assert serve.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hf_attnorm serve PATH")
    assert "--continuous-batching" in out and "--port" in out


@needs_serving
def test_an_option_transformers_serve_lacks_is_a_usage_error_before_anything_loads(tmp_path, capsys):
    path = save_checkpoint(tmp_path / "m", "symax")
    capsys.readouterr()
    assert serve.main([str(path), "--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert "No such option" in err and "--no-such-option" in err
    assert "ran 0 attention calls" in err


def test_generate_with_the_tokenizer_keyword_the_sequential_path_passes(tmp_path):
    """transformers serve's sequential path calls ``model.generate(..., tokenizer=processor)``; generate's sampling
    loop hands that keyword down to the attention function, which ignores it (text, not attention)."""
    path = save_checkpoint(tmp_path / "m", "symax")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer("w1 w2 w3", return_tensors="pt")["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, tokenizer=tokenizer)
        b = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


PLAIN_LOAD = """
import sys
import transformers
from transformers.cli.serving.model_manager import ModelManager

path = sys.argv[1]
try:
    transformers.AutoModelForCausalLM.from_pretrained(path)
    print("UNSET LOADED")
except Exception as e:
    print("UNSET REFUSED", str(e).splitlines()[0])
for impl in ("sdpa", None):  # what `transformers serve PATH [--attn-implementation sdpa]` loads with
    manager = ModelManager(device="cpu", attn_implementation=impl, force_model=path)
    model = next(iter(manager.loaded_models.values())).model
    print("SERVE LOADED", impl, model.config._attn_implementation, flush=True)
    manager.shutdown()
assert not any(m.startswith("hf_attnorm") for m in sys.modules), "hf_attnorm was imported"
"""


@needs_serving
def test_plain_transformers_serve_warns_when_it_loads_an_hf_attnorm_checkpoint_with_its_own_attention(tmp_path):
    """Without ``import hf_attnorm`` transformers serve loads the checkpoint with its own attention (it passes
    ``attn_implementation`` explicitly, ``None`` by default, which overrides config.json's): the marker tensor makes
    its load report name what is not run, as a warning, for each load; a plain ``from_pretrained`` still refuses."""
    path = save_checkpoint(tmp_path / "m", "symax")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="200")
    proc = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(path)], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNSET REFUSED" in proc.stdout and "run import hf_attnorm first" in proc.stdout, proc.stdout
    assert "SERVE LOADED sdpa sdpa" in proc.stdout and "SERVE LOADED None sdpa" in proc.stdout, proc.stdout
    reports = [block for block in proc.stderr.split("LOAD REPORT")[1:]]
    assert len(reports) == 2, proc.stderr[-3000:]
    for block in reports:
        line = next(ln for ln in block.splitlines() if marker_key("symax") in ln)
        assert "UNEXPECTED" in line


# ------------------------------------------------------------------------------------------------ the real server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m hf_attnorm serve`` as a child process leading its own process group, its output in a file."""

    def __init__(self, path: Path, log: Path, *options: str) -> None:
        self.port, self.log_path = free_port(), log
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = open(log, "w")
        # a child of a background job inherits SIGINT ignored: give it the default disposition
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hf_attnorm", "serve", str(path), "--host", "127.0.0.1", "--port", str(self.port),
             "--device", "cpu", "--log-level", "warning", *options],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 420) -> None:  # (a first build of the C++ kernels runs before /health)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server did not answer /health within {timeout} s:\n{self.output()[-4000:]}")

    def post(self, route: str, body: bytes) -> tuple[int, str]:
        req = urllib.request.Request(self.url + route, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self, sig: int, timeout: float = 120) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def cpu_seconds(self) -> float:
        """CPU time the server process has used (user + system, all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_bytes(self) -> int:
        """The server process's peak resident memory so far (VmHWM)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1]) * 1024

    def error(self, route: str, body: object) -> tuple[int, dict]:
        """POST ``body`` (bytes as they are, anything else as JSON); the status and the decoded error body."""
        status, text = self.post(route, body if isinstance(body, bytes) else json.dumps(body).encode())
        return status, json.loads(text)

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()

    def group_is_gone(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return True
        return False


def exercise(server: Server, path: Path) -> None:
    """Concurrent chat requests, a streamed one, a legacy completion, malformed requests, then one more: each answer
    equals greedy ``generate`` on the same checkpoint."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=180, max_retries=0)
    want = expected_answers(path, PROMPTS)

    def chat(prompt: str) -> str:
        r = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": prompt}],
                                           max_tokens=NEW_TOKENS, temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        got = list(pool.map(chat, PROMPTS, timeout=600))
    assert got == want, (got, want)
    stream = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=NEW_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want[0]
    done = client.completions.create(model=str(path), prompt=PROMPTS[2], max_tokens=NEW_TOKENS, temperature=0)
    assert done.choices[0].text == expected_answers(path, [PROMPTS[2]], chat=False)[0]
    for body in (b"not json", json.dumps({"messages": [{"role": "user", "content": "w1"}], "max_tokenz": 2}).encode()):
        status, text = server.post("/v1/chat/completions", body)
        assert 400 <= status < 500, (status, text)
    assert chat(PROMPTS[1]) == want[1]  # (still serving)


def run_server(tmp_path: Path, impl: str, options: list[str], sig: int) -> str:
    path = save_checkpoint(tmp_path / impl, impl)
    server = Server(path, tmp_path / "server.log", *options)
    try:
        server.wait_ready()
        exercise(server, path)
        code = server.stop(sig)
    finally:
        server.close()
    out = server.output()
    assert code == 0, out[-4000:]
    assert server.group_is_gone()
    return out


def _summary(out: str) -> tuple[int, int]:
    line = next(ln for ln in out.splitlines() if ln.startswith("hf_attnorm serve: stopped;"))
    words = line.split(" ran ", 1)[1].split()
    return int(words[0]), int(words[3].lstrip("("))


@needs_serving
@needs_continuous_batching
@pytest.mark.slow
def test_served_with_continuous_batching_equals_generate(tmp_path):
    out = run_server(tmp_path, "symax", CB_OPTIONS, signal.SIGINT)
    assert "with attention implementation 'symax'" in out and "route: continuous batching, packed" in out
    assert "CB: True" in out  # (transformers serve's log line of each request)
    calls, packed = _summary(out)
    assert calls > 0 and packed > 0, out[-2000:]


@needs_serving
@pytest.mark.parametrize("impl", REFUSED[:1])
def test_served_on_the_sequential_path_where_continuous_batching_is_refused(impl, tmp_path):
    """The default run's end-to-end test (about 15 s on 2 cores: the server's start is most of it)."""
    out = run_server(tmp_path, impl, CB_OPTIONS, signal.SIGTERM)
    assert f"continuous batching cannot run {impl!r} exactly" in out and "route: sequential" in out
    assert "CB: False" in out and "CB: True" not in out
    calls, packed = _summary(out)
    assert calls > 0 and packed == 0, out[-2000:]


def test_a_transformers_without_serve_is_refused_by_name(monkeypatch, capsys, tmp_path):
    """On a transformers whose ``transformers serve`` lacks what the command relies on (before 5.17: no
    cli/serving/), the command says which names are missing and what is needed, before loading anything."""
    save_checkpoint(tmp_path, "symax")
    monkeypatch.setattr(compat, "SERVE_PACKAGE", "transformers.cli.no_such_server_package")
    capsys.readouterr()  # (what saving printed)
    assert serve.main([str(tmp_path)]) == 2
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert f"transformers {transformers.__version__} lacks " in first and "5.17 or later" in first
    assert "transformers.cli.no_such_server_package" in first


# ------------------------------------------------------------------------------------------ what clients cannot break


def _sse_error_or_end(stream) -> str:
    """Read a streamed answer to its end; what ended it ("end", or the error the client raised)."""
    try:
        for _ in stream:
            pass
    except Exception as e:  # (an error event, or the connection closed)
        return type(e).__name__
    return "end"


@needs_serving
@needs_continuous_batching
def test_malformed_requests_get_a_4xx_naming_the_field_and_the_server_keeps_answering(tmp_path):
    """Continuous batching with the command's bounded cache on a CPU (no --cb-num-blocks): every malformed request of
    tests/test_serve_guard.py, the ones refused at the prompt's length, an unknown field, invalid JSON and fuzzed
    bodies get a 4xx in OpenAI's error shape, and the server keeps answering: /health stays 200 (a completion without
    prompt used to end continuous batching's worker), answers still equal greedy ``generate``, and the server stays
    small."""
    import openai
    from test_serve_guard import MALFORMED, NOT_OBJECTS, fuzzed_bodies

    path = save_checkpoint(tmp_path / "m", "symax")
    server = Server(path, tmp_path / "server.log", "--continuous-batching", "--max-new-tokens-cap", "8")
    try:
        server.wait_ready()
        out = server.output()
        assert "continuous batching's KV cache on the CPU: 4 blocks of 256 tokens (1,024 tokens" in out, out[-3000:]
        assert out.index("attention kernels ready in ") < out.index("Uvicorn running on"), out[-3000:]
        sweep = [(route, body, field) for route, body, field in MALFORMED if body.get("model") != "another"]
        sweep += [("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "model": "another"},
                   "model"),
                  ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),  # (no token: the worker's end)
                  ("/v1/completions", {"prompt": "w1 " * 300, "max_tokens": 2}, "prompt"),
                  ("/v1/completions", {"prompt": "w1 w2", "max_tokens": 10_000_000}, "max_tokens"),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 9},
                   "max_tokens")]
        for route, body, field in sweep:
            status, answer = server.error(route, body)
            error = answer.get("error", {})
            assert status == 400 and set(error) == {"message", "type", "param", "code"}, (body, status, answer)
            assert error["message"].startswith(f"{field}: ") and "allowed: " in error["message"], (body, answer)
            assert server.health() == 200, (body, server.output()[-3000:])
        for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            assert server.error(route, b"{not json")[0] == 400
            for body in NOT_OBJECTS:
                status, answer = server.error(route, body)
                assert status == 400 and answer["error"]["message"].startswith("the request body is "), answer
        status, answer = server.error("/v1/completions", {"prompt": "w1", "max_tokens": 2, "max_tokenz": 2})
        assert status == 422 and answer["error"]["param"] == "max_tokenz", answer
        assert "Unexpected fields" in answer["error"]["message"] and "allowed: " in answer["error"]["message"]
        statuses = [server.error(route, body)[0] for route, body in fuzzed_bodies(1, 60)]
        assert all(s == 200 or 400 <= s < 500 for s in statuses), statuses
        assert statuses.count(200) < len(statuses) and server.health() == 200

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=180, max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"Error code: 400 - max_tokens: the number -5; allowed: "):
            client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": "w1"}],
                                           max_tokens=-5)
        capped = client.completions.create(model=str(path), prompt="w1 w2", temperature=0)  # (no max_tokens)
        assert capped.usage.completion_tokens == 8 and capped.choices[0].finish_reason == "length"
        r = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": PROMPTS[0]}],
                                           max_tokens=NEW_TOKENS, temperature=0)
        assert r.choices[0].message.content == expected_answers(path, PROMPTS[:1])[0]
        assert server.peak_rss_bytes() < 2 * 1024**3
        code = server.stop(signal.SIGTERM)
    finally:
        server.close()
    out = server.output()
    assert code == 0, out[-4000:]
    assert "continuous batching's worker died" not in out and "Traceback" not in out, out[-4000:]
    refused = int(out.split("requests: ", 1)[1].split(" refused", 1)[0])
    assert refused >= len(sweep) + 3 + 3 * len(NOT_OBJECTS) + 2, out[-2000:]


#: seconds the server is watched while no request is in flight, and the CPU time it may use meanwhile (idle, its
#: loops wait: a few hundredths; a generation left running takes most of a core)
IDLE_S, IDLE_CPU_S = 4.0, 0.5


#: the attention calls of one of disconnect_then_stop's 4000-token generations run to its end (2 layers)
ABANDONED_CALLS = 4000 * 2


def disconnect_then_stop(tmp_path: Path, options: list[str]) -> tuple[int, float, str, str, float]:
    """On a model with 4096 positions: a streamed and a whole generation of 4000 tokens whose clients leave early,
    a short request that must be answered next, ``IDLE_S`` seconds without requests, then a long streamed generation
    stopped by SIGINT. Returns the exit status, the seconds SIGINT took, the server's output, what the long stream's
    client saw, and the CPU seconds the server used while no request was in flight."""
    import openai

    path = save_checkpoint(tmp_path / "m", "symax", positions=4096)
    server = Server(path, tmp_path / "server.log", "--grace-period", "2", *options)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=180, max_retries=0)
        stream = client.completions.create(model=str(path), prompt="w1 w2", max_tokens=4000, temperature=0,
                                           stream=True)
        chunks = [next(iter(stream)) for _ in range(2)]
        stream.close()  # the client leaves after two chunks
        assert chunks[0].choices[0].text
        with pytest.raises(openai.APITimeoutError):  # the client leaves before the answer
            client.with_options(timeout=1.5).completions.create(model=str(path), prompt="w3 w4", max_tokens=4000,
                                                                 temperature=0)
        r = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": PROMPTS[1]}],
                                           max_tokens=NEW_TOKENS, temperature=0)
        assert r.choices[0].message.content == expected_answers(path, PROMPTS[1:2])[0]
        before = server.cpu_seconds()
        time.sleep(IDLE_S)
        idle_cpu = server.cpu_seconds() - before
        long = client.completions.create(model=str(path), prompt="w5", max_tokens=4000, temperature=0, stream=True)
        next(iter(long))  # (generating)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        seen = _sse_error_or_end(long)
        code = server.proc.wait(timeout=120)
        took = time.monotonic() - start
    finally:
        server.close()
    return code, took, server.output(), seen, idle_cpu


@needs_serving
def test_a_client_that_leaves_stops_its_generation_and_sigint_stops_within_the_grace_period(tmp_path):
    """The sequential path runs one ``model.generate`` at a time: the short request is answered only once the
    generations whose clients left stopped (the guard counts both as stopped at their disconnect), the attention
    calls at the end are fewer than those two generations alone would have made run to their end (4000 tokens x 2
    layers each: the long one adds at most one such generation's calls, however fast the machine, so the bound holds
    on any machine), and the server idles afterwards; SIGINT during a long streamed generation exits 0 once the
    grace period is over."""
    code, took, out, seen, idle_cpu = disconnect_then_stop(tmp_path, [])
    assert idle_cpu < IDLE_CPU_S, (idle_cpu, out[-3000:])
    assert code == 0, out[-4000:]
    assert took < 2 + 30, (took, out[-3000:])  # (the grace period, then the stop: seconds on a busy machine)
    assert seen != "end", seen  # the long stream was cut, not finished
    assert "the grace period of 2 s ended: stopped 1 request still in flight" in out, out[-3000:]
    calls, _ = _summary(out)
    assert calls < 2 * ABANDONED_CALLS, out[-2000:]
    assert "2 stopped when their client disconnected, 1 stopped at shutdown" in out, out[-2000:]


@needs_serving
@needs_continuous_batching
@pytest.mark.slow
def test_with_continuous_batching_a_client_that_leaves_stops_its_generation_and_sigint_stops_in_time(tmp_path):
    """The same on continuous batching's packed route (a small cache: 64 blocks of 128 tokens). The requests share
    its batches, so the short request is answered either way: the server idling once it is (no generation left in
    the batch) shows the abandoned generations were cancelled."""
    code, took, out, seen, idle_cpu = disconnect_then_stop(tmp_path, ["--continuous-batching", "--cb-block-size",
                                                                      "128", "--cb-num-blocks", "64"])
    assert code == 0, out[-4000:]
    assert idle_cpu < IDLE_CPU_S, (idle_cpu, out[-3000:])
    assert took < 2 + 30 and seen != "end", (took, seen, out[-3000:])
    assert "the grace period of 2 s ended: stopped 1 request still in flight" in out, out[-3000:]
    calls, packed = _summary(out)
    assert packed > 0 and calls < 2 * ABANDONED_CALLS, out[-2000:]
    assert "2 stopped when their client disconnected, 1 stopped at shutdown" in out, out[-2000:]


@needs_serving
def test_a_second_signal_exits_at_once(tmp_path):
    """With a long grace period, SIGINT starts the graceful stop while a long generation runs on; SIGTERM then exits at
    once, with status 128 + its number, after the summary line."""
    import openai

    path = save_checkpoint(tmp_path / "m", "symax", positions=4096)
    server = Server(path, tmp_path / "server.log", "--grace-period", "600")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=180, max_retries=0)
        long = client.completions.create(model=str(path), prompt="w5", max_tokens=4000, temperature=0, stream=True)
        next(iter(long))
        server.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while "SIGINT: stopping" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.poll() is None, server.output()[-3000:]  # (waiting for the generation in flight)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=120)
        took = time.monotonic() - start
    finally:
        server.close()
    out = server.output()
    assert code == 128 + signal.SIGTERM and took < 30, (code, took, out[-3000:])
    assert "SIGTERM again: exiting now, without waiting for the requests in flight" in out
    assert out.rstrip().splitlines()[-1].startswith("hf_attnorm serve: stopped; "), out[-2000:]
