"""The guard of ``python -m hf_attnorm serve`` without a server: request validation (every refusal names the field,
what it got and what is allowed), the length bounds, the command's own options and continuous batching's bounded
cache on a CPU, and the revival of a continuous-batching worker that died (transformers serve's own generation state
and manager, a real tiny model). tests/test_serve.py sends the same malformed requests to a real server."""

from __future__ import annotations

import asyncio
import json
import random
import warnings

import pytest
import transformers

from hf_attnorm import serve
from hf_attnorm.hf import compat, continuous_batching
from hf_attnorm.serve_guard import (
    CHAT,
    COMPLETIONS,
    CURRENT,
    RESPONSES,
    ROUTES,
    Guardian,
    ModelFacts,
    RequestError,
    RequestInfo,
    check_request,
)

USER = [{"role": "user", "content": "w1 w2"}]
FACTS = ModelFacts(max_positions=256, vocab_size=61, text_only=True, name="served")
#: malformed requests, each with the field its refusal names first (checked before the handler; no model needed):
#: (route, body, field)
MALFORMED = [
    (CHAT, {"max_tokens": 3}, "messages"),
    (CHAT, {"messages": "hi", "max_tokens": 3}, "messages"),
    (CHAT, {"messages": [], "max_tokens": 3}, "messages"),
    (CHAT, {"messages": [{"content": "w1"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, {"messages": USER, "max_tokens": -5}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": "10"}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 2.5}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": True}, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "temperature": -1}, "temperature"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": USER, "top_p": 2}, "top_p"),
    (CHAT, {"messages": USER, "seed": "x"}, "seed"),
    (CHAT, {"messages": USER, "seed": 2**70}, "seed"),
    (CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    (CHAT, {"messages": USER, "stop": 5}, "stop"),
    (CHAT, {"messages": USER, "stop": [""]}, "stop"),
    (CHAT, {"messages": USER, "n": 2}, "n"),
    (CHAT, {"messages": USER, "logprobs": True}, "logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": USER, "frequency_penalty": -1.5}, "frequency_penalty"),
    (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias['abc']"),
    (CHAT, {"messages": USER, "logit_bias": {"999999": 1}}, "logit_bias['999999']"),
    (CHAT, {"messages": USER, "logit_bias": {"1": 500}}, "logit_bias['1']"),
    (CHAT, {"messages": USER, "generation_config": "not json"}, "generation_config"),
    (CHAT, {"messages": USER, "generation_config": json.dumps({"max_new_tokens": -1})}, "generation_config"),
    (CHAT, {"messages": USER, "chat_template_kwargs": 5}, "chat_template_kwargs"),
    (CHAT, {"messages": USER, "tools": "x"}, "tools"),
    (CHAT, {"messages": USER, "model": "another"}, "model"),
    (CHAT, {"messages": USER, "model": 5}, "model"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": ["w1", "w2"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, "prompt"),
    (COMPLETIONS, {"prompt": "w1", "suffix": 5}, "suffix"),
    (COMPLETIONS, {"prompt": "w1", "max_tokens": -5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "w1", "logprobs": 5}, "logprobs"),
    (COMPLETIONS, {"prompt": "w1", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "w1", "best_of": 3}, "best_of"),
    (RESPONSES, {"max_output_tokens": 3}, "input"),
    (RESPONSES, {"input": 5}, "input"),
    (RESPONSES, {"input": []}, "input"),
    (RESPONSES, {"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    (RESPONSES, {"input": [{"role": "user", "content": "w1"}, {"type": "bogus"}]}, "input[1].type"),
    (RESPONSES, {"input": [{"role": "user", "content": "w1"}, {"type": "function_call", "call_id": "c"}]},
     "input[1].name"),
    (RESPONSES, {"input": "w1", "instructions": 5}, "instructions"),
    (RESPONSES, {"input": "w1", "max_output_tokens": 0}, "max_output_tokens"),
]
#: request bodies that are not an object
NOT_OBJECTS = [[1, 2], "text", None, 5, True]


@pytest.mark.parametrize("path, body, field", MALFORMED, ids=lambda x: x if isinstance(x, str) else None)
def test_a_malformed_request_is_refused_naming_the_field_and_what_is_allowed(path, body, field):
    with pytest.raises(RequestError) as caught:
        check_request(path, body, FACTS)
    e = caught.value
    assert e.status == 400 and e.message.startswith(f"{field}: ") and "; allowed: " in e.message, e.message
    assert e.param is not None and field.startswith(e.param), (e.param, field)
    shape = e.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"} and shape["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("body", NOT_OBJECTS, ids=repr)
def test_a_body_that_is_not_an_object_is_refused(path, body):
    with pytest.raises(RequestError, match=r"^the request body is .*; allowed: a JSON object"):
        check_request(path, body, FACTS)


VALID = [
    (CHAT, {"messages": USER, "max_tokens": 4, "temperature": 0, "stream": True, "seed": 3, "stop": ["w9"],
            "logit_bias": {"3": -100}, "frequency_penalty": 0.5, "top_p": 0.9, "n": 1, "model": "served",
            "logprobs": False, "presence_penalty": 0, "response_format": {"type": "text"}}),
    (CHAT, {"messages": [{"role": "system", "content": [{"type": "text", "text": "w1"}]}, *USER,
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                         {"role": "tool", "content": "w2", "tool_call_id": "c1"}]}),
    (COMPLETIONS, {"prompt": "", "max_tokens": 1, "suffix": "w2"}),
    (RESPONSES, {"input": "w1", "instructions": "w2", "max_output_tokens": 3}),
    (RESPONSES, {"input": [{"type": "input_text", "text": "w1"}]}),
    (RESPONSES, {"input": [{"role": "user", "content": "w1"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                               "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "c", "output": "w3"}]}),
]


@pytest.mark.parametrize("path, body", VALID)
def test_valid_requests_and_unknown_fields_pass(path, body):
    info = check_request(path, {**body, "an_unknown_field": [1]}, FACTS)
    assert info.path == path and info.prompt_field == ROUTES[path].prompt
    assert info.stream == body.get("stream", path == RESPONSES)


def test_the_field_that_set_the_new_tokens_is_remembered():
    assert check_request(CHAT, {"messages": USER}, FACTS).explicit is None
    assert check_request(CHAT, {"messages": USER, "max_tokens": 5}, FACTS).explicit == ("max_tokens", 5)
    both = {"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}
    assert check_request(CHAT, both, FACTS).explicit == ("max_completion_tokens", 7)  # (it wins, as in transformers)
    config = {"messages": USER, "generation_config": json.dumps({"max_length": 900})}
    assert check_request(CHAT, config, FACTS).explicit == ("generation_config.max_length", 900)


class Config:
    def __init__(self, max_new_tokens=None, max_length=20):
        self.max_new_tokens, self.max_length = max_new_tokens, max_length


def admit(guardian: Guardian, n: int, config: Config, info: RequestInfo | None) -> Config:
    token = CURRENT.set(info)
    try:
        guardian.admit(None, {"input_ids": list(range(n))}, config)
    finally:
        CURRENT.reset(token)
    return config


def test_new_tokens_are_bounded_by_the_positions_left_and_the_cap():
    guardian = Guardian()
    guardian.facts = FACTS
    asked = RequestInfo(COMPLETIONS, "prompt", explicit=("max_tokens", 10_000_000))
    with pytest.raises(RequestError, match=r"^max_tokens: 10000000 is more new tokens than this server generates "
                                           r"after this prompt: at most 246 \(the model's 256 positions minus the "
                                           r"prompt's 10 tokens\); allowed: an integer from 1 to 246$") as e:
        admit(guardian, 10, Config(10_000_000), asked)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    default = RequestInfo(COMPLETIONS, "prompt")
    assert admit(guardian, 10, Config(1024), default).max_new_tokens == 246  # transformers serve's default, capped
    assert guardian.counts["capped"] == 1
    assert admit(guardian, 10, Config(None, max_length=20), default).max_new_tokens == 10  # set from max_length
    assert admit(guardian, 10, Config(246), asked).max_new_tokens == 246
    with pytest.raises(RequestError, match=r"^prompt: it gives no tokens"):
        admit(guardian, 0, Config(5), default)
    with pytest.raises(RequestError, match=r"^messages: the prompt has 256 tokens, which leaves nothing to generate "
                                           r".*allowed: a prompt of at most 255 tokens$"):
        admit(guardian, 256, Config(5), RequestInfo(CHAT, "messages"))
    capped = Guardian(max_new_tokens_cap=7)
    capped.facts = FACTS
    with pytest.raises(RequestError, match=r"at most 7 \(the server's --max-new-tokens-cap 7\)"):
        admit(capped, 10, Config(8), asked)
    assert admit(capped, 10, Config(1024), default).max_new_tokens == 7
    unbounded = Guardian()
    assert admit(unbounded, 10, Config(10_000), default).max_new_tokens == 10_000  # (no bound known: left as asked)


# ------------------------------------------------------------------------------------------------ the command line


def test_the_commands_own_options_are_checked_and_taken_out():
    options, rest = serve.own_options(["DIR", "--max-new-tokens-cap", "64", "--grace-period=2.5", "--port", "9"])
    assert options == serve.Options(64, 2.5) and rest == ["DIR", "--port", "9"]
    assert serve.own_options(["DIR"])[0] == serve.Options(None, serve.GRACE_PERIOD_S)
    for argv, message in [(["DIR", "--max-new-tokens-cap", "0"], r"--max-new-tokens-cap '0'; allowed: an integer"),
                          (["DIR", "--max-new-tokens-cap", "x"], r"--max-new-tokens-cap 'x'; allowed: an integer"),
                          (["DIR", "--grace-period", "-1"], r"--grace-period '-1'; allowed: a number of seconds"),
                          (["DIR", "--grace-period", "nan"], r"--grace-period 'nan'; allowed: a number of seconds")]:
        with pytest.raises(serve.ServeError, match=r"^python -m hf_attnorm serve: " + message):
            serve.own_options(argv)
    assert serve.main(["DIR", "--grace-period", "soon"]) == 2


def test_continuous_batching_on_a_cpu_gets_a_bounded_cache_unless_told_otherwise(tmp_path):
    from test_serve import save_checkpoint

    path = str(save_checkpoint(tmp_path, "symax"))  # 2 layers, 2 KV heads of 8, float32, 256 positions
    plan = serve.cache_plan(path, [path, "--device", "cpu"])
    per_token = 2 * 2 * 2 * 8 * 4
    tokens = serve.CPU_CACHE_SEQUENCES * 256  # (far below CPU_CACHE_BYTES // per_token)
    blocks = -(-tokens // serve.CB_PAGE_DEFAULT)
    assert plan.added == ("--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", str(serve.CPU_BATCH_TOKENS))
    assert plan.tokens == blocks * serve.CB_PAGE_DEFAULT and tokens * per_token < serve.CPU_CACHE_BYTES
    assert plan.line.startswith(f"continuous batching's KV cache on the CPU: {blocks} blocks of 256 tokens")
    paged = serve.cache_plan(path, [path, "--device", "cpu", "--cb-block-size", "8", "--cb-max-batch-tokens", "32"])
    assert paged.added == ("--cb-num-blocks", str(tokens // 8)) and paged.tokens == tokens
    given = serve.cache_plan(path, [path, "--device", "cpu", "--cb-num-blocks", "5", "--cb-block-size", "16"])
    assert given.added == () and given.tokens == 80 and "--cb-num-blocks" in given.line
    by_memory = serve.cache_plan(path, [path, "--device", "cpu", "--cb-max-memory-percent", "0.1"])
    assert by_memory.added == () and by_memory.tokens is None
    on_gpu = serve.cache_plan(path, [path, "--device", "cuda:0"])
    assert on_gpu.added == () and "sized by transformers" in on_gpu.line
    big = transformers.LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   hidden_size=4096, max_position_embeddings=131072)
    assert serve._kv_bytes_per_token(big, "bfloat16") == 2 * 32 * 8 * 128 * 2  # then the memory bound decides


# ------------------------------------------------------------------------------------------------ the worker's revival

needs_serving_cb = pytest.mark.skipif(
    bool(compat.serve_missing()) or not compat.serve_extra_installed()
    or bool(continuous_batching.CONTINUOUS_BATCHING_MISSING),
    reason="needs transformers serve (5.17 or later, its serving extra) and continuous batching for hf_attnorm")


@needs_serving_cb
def test_a_dead_continuous_batching_worker_is_replaced_and_serves_again(tmp_path, capsys):
    """transformers serve's own ``GenerationState`` and ``CBGenerateManager`` on a tiny model: a request the guard
    would refuse (an empty prompt, sent past it) kills the worker, as it did through the server; ``revive`` says why
    and lets the next request start a new worker; the third death within the window is fatal."""
    from test_serve import save_checkpoint
    from transformers.cli.serving.utils import GenerationState

    path = save_checkpoint(tmp_path, "symax")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    cb_config = transformers.ContinuousBatchingConfig(page_size=8, num_blocks=16, max_batch_tokens=16)
    state = GenerationState(continuous_batching=True, cb_config=cb_config)
    guardian = Guardian()
    guardian.generation_state = state
    config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, use_cache=False)

    async def generate(ids: list[int]) -> list[int]:
        manager = state.get_manager("m", use_cb=True)
        manager.init_cb(model, config)
        _, _, generated = await asyncio.wait_for(
            manager.generate_non_streaming(model, tokenizer, {"input_ids": ids}, config, request_id=f"r{ids}"), 120)
        return list(generated)

    async def kill() -> None:
        with pytest.raises(RuntimeError, match=r"^CB (worker|generation failed)"):
            await generate([])
        for _ in range(100):  # (the worker records its fatal error as it ends)
            if not state.is_cb_alive():
                break
            await asyncio.sleep(0.1)
        assert not state.is_cb_alive()  # what /health answered with 503 until a restart

    async def scenario() -> None:  # (one event loop: the worker answers on the loop of the request)
        first = await generate([1, 2, 3])
        await kill()
        capsys.readouterr()
        guardian.revive()
        assert state.is_cb_alive() and guardian.counts["restarts"] == 1 and guardian.fatal is None
        said = capsys.readouterr().err
        assert said.startswith("hf_attnorm serve: WARNING: continuous batching's worker died (") and \
            "a new worker starts with the next request" in said, said
        assert await generate([1, 2, 3]) == first  # a new worker, the same greedy tokens
        for _ in range(2):
            await kill()
            guardian.revive()
        assert guardian.fatal is not None and guardian.fatal.startswith(
            "continuous batching's worker died 3 times within 300 s (last: ")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            asyncio.run(scenario())
    finally:
        state.shutdown()


def fuzzed_bodies(seed: int, count: int) -> list[tuple[str, object]]:
    """Random request bodies (seeded): known fields with values of random kinds, unknown fields, nesting; each
    asks for at most 2 new tokens where it asks validly."""
    rng = random.Random(seed)
    values = [None, True, -1, 0, 1, 2, 2.5, -1e9, float("inf"), "", "w1", "x" * 50, [], [1], ["w1"], {}, {"a": 1},
              [{"role": "user"}], [{"role": "user", "content": "w1"}], [{"type": "text", "text": "w2"}],
              {"role": "user", "content": [{"type": "text"}]}]
    fields = ["messages", "prompt", "input", "temperature", "top_p", "seed", "stop", "stream", "n", "logit_bias",
              "frequency_penalty", "generation_config", "tools", "suffix", "instructions", "chat_template_kwargs",
              "model", "max_completion_tokens", "max_output_tokens"]
    out = []
    for _ in range(count):
        path = rng.choice(list(ROUTES))
        body: dict = {"max_tokens": rng.choice([1, 2, 0, -3, "2", 2.5, True])}
        for name in rng.sample(fields, rng.randint(1, 6)):
            value = rng.choice(values)
            if value == float("inf"):
                value = 1e308
            body[name] = value
        if rng.random() < 0.3:
            body[f"unknown_{rng.randint(0, 9)}"] = rng.choice(values[:6])
        out.append((path, body if rng.random() < 0.9 else rng.choice(NOT_OBJECTS)))
    return out


def test_fuzzed_bodies_are_refused_by_name_or_pass():
    """Whatever a body holds, the check refuses it with a message naming what is wrong, or lets it through."""
    refused = 0
    for path, body in fuzzed_bodies(0, 400):
        try:
            check_request(path, body, FACTS)
        except RequestError as e:
            refused += 1
            assert "; allowed: " in e.message and e.status == 400, e.message
    assert 0 < refused < 400


def test_a_request_error_reaches_the_client_in_openais_shape():
    e = RequestError("max_tokens: the number -5; allowed: an integer >= 1", param="max_tokens")
    assert e.body() == {"error": {"message": "max_tokens: the number -5; allowed: an integer >= 1",
                                  "type": "invalid_request_error", "param": "max_tokens", "code": None}}


def test_continuous_batching_refuses_sampling_it_would_ignore():
    """Continuous batching runs every request with the first one's sampling (transformers serve passes it only the
    prompt and the bounds): a request asking for other sampling, or for stop strings, is refused instead of served
    with what it did not ask for."""
    from hf_attnorm.serve_guard import check_shared_sampling

    class Worker:
        generation_config = transformers.GenerationConfig(do_sample=False)

    same = transformers.GenerationConfig(do_sample=False, temperature=0.7)  # (greedy: the temperature is unused)
    check_shared_sampling(same, Worker())
    with pytest.raises(RequestError, match=r"^temperature: this request asks for sampling with temperature 0.7, but "
                                           r"continuous batching runs every request with the sampling of the first "
                                           r"one it served \(greedy\): .*allowed: the same settings, or serve without "
                                           r"--continuous-batching$"):
        check_shared_sampling(transformers.GenerationConfig(do_sample=True, temperature=0.7), Worker())
    with pytest.raises(RequestError, match=r"^frequency_penalty: .*greedy with \{'repetition_penalty': 1.5\}"):
        check_shared_sampling(transformers.GenerationConfig(repetition_penalty=1.5), Worker())
    with pytest.raises(RequestError, match=r"^stop: continuous batching does not apply stop strings"):
        check_shared_sampling(transformers.GenerationConfig(stop_strings=["w9"]), Worker())
