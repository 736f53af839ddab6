"""What ``python -m hf_attnorm serve`` puts in front of transformers serve's FastAPI app (wrapped where transformers
builds it, ``compat.SERVE_APP_FACTORY``; none of its code is copied), so that the server survives its clients:

* **Validation** (``check_request``): the body of every generation request (/v1/chat/completions, /v1/completions,
  /v1/responses) is checked before transformers serve's handler sees it: required fields, types and ranges of the
  fields transformers serve reads, and the OpenAI fields it would ignore where that changes the answer (``n``,
  ``logprobs``, ``echo``, ...). A refusal is a 400 in OpenAI's error shape (``{"error": {"message", "type",
  "param", "code"}}``) whose message names the field, what it got and what is allowed. Fields this module does not
  know are passed on; transformers serve's own refusals (an unknown field, another model) and every other error
  response of the app are reshaped to OpenAI's shape too.
* **Lengths** (``Guardian.admit``, at the generation managers, where the prompt is tokenized): a prompt must give at
  least one token; a request's new tokens are bounded by what the model can still produce after its prompt (its
  maximum positions minus the prompt), by the KV cache of continuous batching (a request larger than the whole
  cache would end its worker), and by ``--max-new-tokens-cap``. An explicit ``max_tokens`` (``max_completion_tokens``,
  ``max_output_tokens``, ``generation_config``) beyond the bound is refused with a 400 saying the bound and why, as
  OpenAI's API does; a request without one gets transformers serve's default capped at the bound.
* **Disconnects**: when a client goes away, its generation stops (streamed or not, on both routes): the sequential
  path's ``model.generate`` gets a stopping criterion, continuous batching cancels the request.
* **Stopping**: ``Guardian.abort_requests`` ends the requests still in flight when the grace period is over: each gets
  a 503 (or, streamed, a final error event) and its generation stops.
* **The continuous-batching worker** (``Guardian.revive``): if it dies anyway, the next request or the serve command's
  watch finds it, says why, and lets transformers serve start a new one; /health answers 200 again. Three deaths
  within ``REVIVAL_WINDOW_S`` end the server instead (exit status 1, with the reason).
* **Kernels** (``warm_up``): the model runs a few forward passes before the port opens, so the kernels its
  implementation needs are built (or loaded from the build cache) before the server reports healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import json
import math
import re
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from .hf import compat
from .hf.forward import PathRecord, record_paths

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


@dataclasses.dataclass(frozen=True)
class Route:
    """A generation route: the field holding its prompt and the fields that bound its new tokens (the first one
    present wins, as in transformers serve)."""

    prompt: str
    max_fields: tuple[str, ...]


ROUTES = {
    CHAT: Route("messages", ("max_completion_tokens", "max_tokens")),
    COMPLETIONS: Route("prompt", ("max_tokens",)),
    RESPONSES: Route("input", ("max_output_tokens",)),
}
#: content parts that carry text (chat completions and the Responses API)
TEXT_PARTS = ("text", "input_text", "output_text")
#: the largest request body read (bytes); a larger one gets a 413
MAX_BODY_BYTES = 64 * 1024 * 1024
#: torch.manual_seed's range (the ``seed`` field)
SEED_RANGE = (-(2**63), 2**64 - 1)
#: how long a stopped sequential generation may take to end by itself (one decode step) before its task is cancelled
STOP_WAIT_S = 10.0
#: three deaths of the continuous-batching worker within this many seconds end the server
REVIVAL_WINDOW_S = 300.0
REVIVAL_LIMIT = 3


class RequestError(Exception):
    """A refused request: its HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------------ request bodies


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What validation needs of the served model: its maximum positions (None: unbounded), its vocabulary size (for
    ``logit_bias``) and whether it reads text only (then a non-text content part is refused instead of dropped)."""

    max_positions: int | None = None
    vocab_size: int | None = None
    text_only: bool = True
    #: the name the server answers to (transformers serve's ``force_model``); None: any
    name: str | None = None


def describe(value: Any) -> str:
    """A JSON value as a refusal quotes it: its kind, and the value when short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({shown!r})"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _refuse(param: str, value: Any, allowed: str, missing: bool = False) -> RequestError:
    got = "required (missing)" if missing else describe(value)
    return RequestError(f"{param}: {got}; allowed: {allowed}", param=param,
                        code="missing_required_parameter" if missing else "invalid_value")


def _optional(body: dict, name: str, ok: Callable[[Any], bool], allowed: str) -> None:
    if name in body and body[name] is not None and not ok(body[name]):
        raise _refuse(name, body[name], allowed)


def _text_part(part: Any, where: str, text_only: bool) -> None:
    """One content part (chat completions or Responses API)."""
    if not isinstance(part, dict):
        raise _refuse(where, part, "an object with a 'type' (e.g. {'type': 'text', 'text': '...'})")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _refuse(f"{where}.type", kind, f"a string: {', '.join(map(repr, TEXT_PARTS))}"
                      + ("" if text_only else ", or an image/audio/video part the model's processor reads"),
                      missing="type" not in part)
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise _refuse(f"{where}.text", part.get("text"), "a string", missing="text" not in part)
    elif text_only:
        raise _refuse(f"{where}.type", kind, f"{', '.join(map(repr, TEXT_PARTS))} (this model reads text only)")


def _content(content: Any, where: str, text_only: bool) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _refuse(where, content, "a string or a list of content parts")
    for j, part in enumerate(content):
        _text_part(part, f"{where}[{j}]", text_only)


def _tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise _refuse(where, calls, "a list of tool calls, each {'type': 'function', 'id': ..., 'function': "
                                    "{'name': ..., 'arguments': '<JSON object>'}}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _refuse(at, call, "an object with a 'function' object")
        function = call.get("function") or call  # (as transformers serve reads it)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _refuse(f"{at}.function.name", function.get("name") if isinstance(function, dict) else function,
                          "a string", missing=isinstance(function, dict) and "name" not in function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError as e:
                raise RequestError(f"{at}.function.arguments: not valid JSON ({e}); allowed: a JSON object as a "
                                   "string, or an object", param=f"{at}.function.arguments",
                                   code="invalid_value") from None
            if not isinstance(parsed, dict):
                raise _refuse(f"{at}.function.arguments", arguments, "a JSON object as a string, or an object")
        elif not isinstance(arguments, dict):
            raise _refuse(f"{at}.function.arguments", arguments, "a JSON object as a string, or an object",
                          missing="arguments" not in function)


def check_messages(messages: Any, text_only: bool, name: str = "messages") -> None:
    """Chat completions' ``messages``: a non-empty list of objects with a ``role`` and a ``content`` (a string, or
    content parts; null or absent only for an assistant message with ``tool_calls``)."""
    allowed = ("a non-empty list of messages, each an object with 'role' (a string) and 'content' (a string or a "
               "list of content parts)")
    if not isinstance(messages, list) or not messages:
        raise _refuse(name, messages, allowed)
    for i, message in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _refuse(where, message, "an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _refuse(f"{where}.role", role, "a non-empty string (e.g. 'system', 'user', 'assistant', 'tool')",
                          missing="role" not in message)
        calls = message.get("tool_calls")
        if calls is not None:
            _tool_calls(calls, f"{where}.tool_calls")
        content = message.get("content")
        if content is None:
            if role != "assistant" or calls is None:
                raise _refuse(f"{where}.content", None, "a string or a list of content parts (null only for an "
                                                        "assistant message with 'tool_calls')",
                              missing="content" not in message)
        else:
            _content(content, f"{where}.content", text_only)
        if message.get("tool_call_id") is not None and not isinstance(message["tool_call_id"], str):
            raise _refuse(f"{where}.tool_call_id", message["tool_call_id"], "a string")


def check_input(items: Any, text_only: bool) -> None:
    """The Responses API's ``input``: a string, or a non-empty list of input items (content parts, or messages with
    a ``role`` and items of type 'function_call', 'function_call_output', 'reasoning'), as transformers serve reads
    it."""
    allowed = "a string, or a non-empty list of input items"
    if isinstance(items, str):
        return
    if not isinstance(items, list) or not items:
        raise _refuse("input", items, allowed)
    if not all(isinstance(item, dict) for item in items):
        i = next(i for i, item in enumerate(items) if not isinstance(item, dict))
        raise _refuse(f"input[{i}]", items[i], "an object (a content part, a message, or a function call item)")
    if "role" not in items[0]:  # a flat list of content parts (one user message)
        for i, part in enumerate(items):
            _text_part(part, f"input[{i}]", text_only)
        return
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type")
        if kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _refuse(f"{where}.content", item.get("content"), "a list of objects with a 'text' string")
        elif "role" in item:
            if not isinstance(item["role"], str) or not item["role"]:
                raise _refuse(f"{where}.role", item["role"], "a non-empty string")
            if item.get("content") is not None:
                _content(item["content"], f"{where}.content", text_only)
        elif kind in ("function_call", "function_call_output"):
            needed = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
            for field in needed:
                if not isinstance(item.get(field), str):
                    raise _refuse(f"{where}.{field}", item.get(field), "a string", missing=field not in item)
        else:
            raise _refuse(f"{where}.type", kind, "'message' (an item with a 'role'), 'function_call', "
                                                 "'function_call_output' or 'reasoning'", missing="type" not in item)


def _check_generation_config(text: Any) -> GenerationConfig | None:
    """The ``generation_config`` field (a JSON object as a string, which transformers serve passes to
    ``GenerationConfig``), parsed and validated; None when absent."""
    if text is None:
        return None
    allowed = "a string holding a JSON object of transformers GenerationConfig fields"
    if not isinstance(text, str):
        raise _refuse("generation_config", text, allowed)
    try:
        fields = json.loads(text)
    except ValueError as e:
        raise RequestError(f"generation_config: not valid JSON ({e}); allowed: {allowed}",
                           param="generation_config", code="invalid_value") from None
    if not isinstance(fields, dict):
        raise _refuse("generation_config", fields, allowed)
    try:
        config = GenerationConfig(**fields)
        config.validate(strict=True)
    except Exception as e:  # (GenerationConfig raises ValueError, TypeError, or its own warnings as errors)
        raise RequestError(f"generation_config: transformers refuses it: {str(e).splitlines()[0]}; allowed: "
                           f"{allowed}", param="generation_config", code="invalid_value") from None
    for name in ("max_new_tokens", "max_length"):
        value = getattr(config, name, None)
        if fields.get(name) is not None and (not _is_int(value) or value < 1):
            raise _refuse(f"generation_config.{name}", value, "an integer >= 1")
    return config


@dataclasses.dataclass
class RequestInfo:
    """What the guard knows of a generation request while it runs: its route, the field that set its new tokens
    (and the value), and the calls that stop its generation (added by the generation managers' wrappers)."""

    path: str
    prompt_field: str
    explicit: tuple[str, Any] | None = None
    stream: bool = False
    stoppers: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    stopped: str | None = None
    #: its generation is the sequential path's, not streamed: once stopped, its task ends by itself (cancelling it
    #: would leave transformers serve's inference thread setting the result of a cancelled future)
    ends_when_stopped: bool = False

    def stop(self, why: str) -> bool:
        """Stop every generation of the request (once); whether there was one to stop."""
        if self.stopped is not None:
            return False
        self.stopped = why
        for stop in self.stoppers:
            with contextlib.suppress(Exception):  # (a generation that already ended)
                stop()
        return bool(self.stoppers)


def check_request(path: str, body: Any, facts: ModelFacts = ModelFacts()) -> RequestInfo:
    """Check the body of a generation request (``path``: one of ``ROUTES``); raises ``RequestError`` naming the
    field, what it got and what is allowed. Fields it does not know pass."""
    route = ROUTES[path]
    if not isinstance(body, dict):
        raise RequestError(f"the request body is {describe(body)}; allowed: a JSON object (OpenAI's "
                           f"{path.rsplit('/', 1)[1].replace('_', ' ')} request)", code="invalid_value")
    if path == CHAT:
        if "messages" not in body:
            raise _refuse("messages", None, "a non-empty list of messages, each an object with 'role' and "
                                            "'content'", missing=True)
        check_messages(body["messages"], facts.text_only)
    elif path == COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _refuse("prompt", prompt, "a string (one prompt per request, as text; not a list of prompts or "
                                            "of token ids)", missing="prompt" not in body)
        _optional(body, "suffix", lambda v: isinstance(v, str), "a string")
    else:
        if "input" not in body:
            raise _refuse("input", None, "a string, or a non-empty list of input items", missing=True)
        check_input(body["input"], facts.text_only)
        _optional(body, "instructions", lambda v: isinstance(v, str), "a string")

    served = f"{facts.name!r} (the model this server serves) or leave it out" if facts.name else "a string"
    _optional(body, "model", lambda v: isinstance(v, str) and (facts.name is None or v == facts.name), served)
    _optional(body, "stream", lambda v: isinstance(v, bool), "true or false")
    _optional(body, "temperature", lambda v: _is_number(v) and v >= 0, "a number >= 0 (0: greedy)")
    _optional(body, "top_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number from 0 to 1")
    _optional(body, "seed", lambda v: _is_int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1], "an integer")
    # OpenAI fields transformers serve accepts and ignores: refused where ignoring them would change the answer
    _optional(body, "n", lambda v: v == 1 and _is_int(v), "1 (this server returns one choice per request)")
    _optional(body, "best_of", lambda v: v == 1 and _is_int(v), "1 (this server returns one choice per request)")
    _optional(body, "logprobs", lambda v: v is False or v == 0, "false, 0 or leave it out (this server returns no "
                                                              "log probabilities)")
    _optional(body, "top_logprobs", lambda v: v == 0 and _is_int(v), "0 or leave it out (this server returns no log "
                                                                   "probabilities)")
    _optional(body, "echo", lambda v: v is False, "false or leave it out (this server does not echo the prompt)")
    _optional(body, "presence_penalty", lambda v: v == 0 and _is_number(v),
              "0 or leave it out (this server does not apply it; frequency_penalty is applied)")
    _optional(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
              "{'type': 'text'} or leave it out (this server does not constrain the answer's format)")
    _optional(body, "frequency_penalty", lambda v: _is_number(v) and -1 < v <= 2,
              "a number > -1 and <= 2 (the server applies repetition_penalty = 1 + frequency_penalty, which must be "
              "> 0)")
    _optional(body, "stop", lambda v: (isinstance(v, str) and v != "") or (
        isinstance(v, list) and v and all(isinstance(s, str) and s for s in v)),
              "a non-empty string or a non-empty list of non-empty strings")
    _optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    _optional(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
              "a list of tool objects")
    if body.get("logit_bias") is not None:
        _check_logit_bias(body["logit_bias"], facts.vocab_size)
    for name in route.max_fields:
        _optional(body, name, lambda v: _is_int(v) and v >= 1,
                  "an integer >= 1 (at most what the model can still produce after the prompt)")
    config = _check_generation_config(body.get("generation_config"))

    explicit = next(((n, body[n]) for n in route.max_fields if body.get(n) is not None), None)
    if explicit is None and config is not None:
        fields = json.loads(body["generation_config"])
        if fields.get("max_new_tokens") is not None:
            explicit = ("generation_config.max_new_tokens", fields["max_new_tokens"])
        elif fields.get("max_length") is not None:
            explicit = ("generation_config.max_length", fields["max_length"])
    stream = body.get("stream")
    return RequestInfo(path, route.prompt, explicit, stream=bool(path == RESPONSES if stream is None else stream))


def _check_logit_bias(bias: Any, vocab_size: int | None) -> None:
    top = f"0..{vocab_size - 1}" if vocab_size else "a token id"
    allowed = f"an object mapping token ids ({top}, as strings) to numbers from -100 to 100"
    if not isinstance(bias, dict):
        raise _refuse("logit_bias", bias, allowed)
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise _refuse(f"logit_bias[{key!r}]", key, allowed) from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"logit_bias[{key!r}]: token id {token} is not in this model's vocabulary; allowed: "
                               f"{allowed}", param="logit_bias", code="invalid_value")
        if not _is_number(value) or not -100 <= value <= 100:
            raise _refuse(f"logit_bias[{key!r}]", value, "a number from -100 to 100")


# ------------------------------------------------------------------------------------------------ the guardian


#: the generation request the running task serves (set by the middleware; the task of each request copies it)
CURRENT: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("hf_attnorm_serve_request",
                                                                            default=None)


class EventStop(StoppingCriteria):
    """Stops ``model.generate`` at its next step once ``event`` is set (the sequential path's cancellation)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """input_ids: [B, L] -> [B] bool."""
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def log(message: str) -> None:
    print(f"hf_attnorm serve: {message}", file=sys.stderr, flush=True)


def model_facts(model: Any, modality: Any = None) -> ModelFacts:
    """The served model's maximum positions, vocabulary size and whether it reads text only."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    positions = getattr(config, "max_position_embeddings", None)
    vocab = getattr(config, "vocab_size", None)
    name = getattr(modality, "name", str(modality) if modality is not None else "LLM")
    return ModelFacts(positions if _is_int(positions) and positions > 0 else None,
                      vocab if _is_int(vocab) and vocab > 0 else None, text_only=name == "LLM")


def warm_up(model: Any, record: PathRecord | None = None) -> tuple[float, PathRecord]:
    """Run the model as serving will before the port opens, so that the kernels its attention implementation needs
    are built (or loaded from the build cache) now: a prefill, a decode step on its cache, and a left-padded batch
    (a given mask, as continuous batching's packed calls have). Returns (seconds, the paths that ran)."""
    record = PathRecord() if record is None else record
    vocab = max(2, int(getattr(model.config.get_text_config(), "vocab_size", 2) or 2))
    ids = (torch.arange(8, device=model.device) % (vocab - 1) + 1)[None]
    start = time.perf_counter()
    with torch.no_grad(), record_paths(record):  # (not inference_mode: a cache state may update in place)
        out = model(input_ids=ids, use_cache=True)
        model(input_ids=ids[:, -1:], use_cache=True, **compat.cache_kwargs(model, compat.output_cache(out)))
        mask = torch.ones(2, 8, dtype=torch.long, device=model.device)
        mask[0, :3] = 0
        model(input_ids=ids.repeat(2, 1), attention_mask=mask)
    return time.perf_counter() - start, record


class Guardian:
    """The guard of one server: the model's facts, the bounds, the requests in flight, the counts the summary
    reports, and the continuous-batching worker's revival."""

    def __init__(self, max_new_tokens_cap: int | None = None, cache_tokens: int | None = None) -> None:
        self.cap = max_new_tokens_cap
        #: the KV cache of continuous batching in tokens when the command sized it (else read from the manager)
        self.cache_tokens = cache_tokens
        self.facts = ModelFacts()
        self.allowed_fields: dict[str, list[str]] = {}
        self.generation_state: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.active: dict[asyncio.Task, RequestInfo] = {}
        self.lock = threading.Lock()  # (the worker's revival)
        self.count_lock = threading.Lock()
        self.counts = {"refused": 0, "disconnected": 0, "aborted": 0, "capped": 0, "restarts": 0}
        self.deaths: deque[float] = deque()
        #: why the server must stop (the worker kept dying); the serve command exits 1 with it
        self.fatal: str | None = None

    # -- wiring into transformers serve's app

    @contextlib.contextmanager
    def wrapping_app_factory(self, on_built: Callable[[Any, Any], None] | None = None) -> Iterator[None]:
        """While the block runs, transformers serve's app factory returns its app with this guard in front
        (``attach``); ``on_built(model, processor)`` runs first (the kernels' warm-up)."""
        module, name = compat.serve_app_factory()
        original = getattr(module, name)
        signature = inspect.signature(original)

        def build_server(*args: Any, **kwargs: Any) -> Any:
            arguments = signature.bind(*args, **kwargs).arguments
            app = original(*args, **kwargs)
            self.attach(app, arguments, on_built)
            return app

        setattr(module, name, build_server)
        try:
            yield
        finally:
            setattr(module, name, original)

    def attach(self, app: Any, arguments: dict[str, Any], on_built: Callable[[Any, Any], None] | None) -> None:
        """Put the guard in front of ``app`` (transformers serve's FastAPI app, not yet started), given the objects
        its factory received."""
        manager = arguments["model_manager"]
        model, processor = loaded_model(manager)
        if on_built is not None:
            on_built(model, processor)
        modality = None
        with contextlib.suppress(Exception):
            modality = manager.get_model_modality(model, processor=processor)
        self.facts = dataclasses.replace(model_facts(model, modality), name=manager.force_model)
        handlers = {CHAT: "chat_handler", COMPLETIONS: "completion_handler", RESPONSES: "response_handler"}
        for path, key in handlers.items():
            self.allowed_fields[path] = compat.serve_handler_fields(arguments.get(key))
        self.generation_state = state = arguments["generation_state"]
        get_manager = state.get_manager

        def guarded_get_manager(*args: Any, **kwargs: Any) -> Any:
            self.revive()
            return self.guard_manager(get_manager(*args, **kwargs))

        state.get_manager = guarded_get_manager
        app.add_middleware(Guard, guardian=self)

    def guard_manager(self, manager: Any) -> Any:
        """Wrap a generation manager's two entry points (once per instance): lengths are checked there, and each
        generation registers how to stop it with its request."""
        if getattr(manager, "_hf_attnorm_guarded", False):
            return manager
        is_cb = compat.serve_is_continuous_batching(manager)
        stream, whole = manager.generate_streaming, manager.generate_non_streaming
        stream_sig, whole_sig = inspect.signature(stream), inspect.signature(whole)

        def generate_streaming(*args: Any, **kwargs: Any) -> Any:
            a = stream_sig.bind(*args, **kwargs).arguments
            self.admit(a["model"], a["inputs"], a["gen_config"], manager if is_cb else None)
            if is_cb:
                check_shared_sampling(a["gen_config"], compat.serve_continuous_batching(manager))
            queue, streamer = stream(*args, **kwargs)
            info = CURRENT.get()
            if info is not None:
                info.stoppers.append(streamer.cancel)
            return queue, streamer

        async def generate_non_streaming(*args: Any, **kwargs: Any) -> Any:
            bound = whole_sig.bind(*args, **kwargs)
            a = bound.arguments
            self.admit(a["model"], a["inputs"], a["gen_config"], manager if is_cb else None)
            info = CURRENT.get()
            if is_cb:
                check_shared_sampling(a["gen_config"], compat.serve_continuous_batching(manager))
                cb, request_id = compat.serve_continuous_batching(manager), a["request_id"]
                if info is not None and cb is not None:
                    info.stoppers.append(lambda: cb.cancel_request(request_id))
            else:  # model.generate receives the inputs' keys: a stopping criterion among them stops it
                event = threading.Event()
                criteria = StoppingCriteriaList([EventStop(event)])
                bound.arguments["inputs"] = {**a["inputs"], "stopping_criteria": criteria}
                if info is not None:
                    info.stoppers.append(event.set)
                    info.ends_when_stopped = True
            return await whole(*bound.args, **bound.kwargs)

        manager.generate_streaming = generate_streaming
        manager.generate_non_streaming = generate_non_streaming
        manager._hf_attnorm_guarded = True
        return manager

    def capacity(self, cb_manager: Any) -> int | None:
        """The KV cache of continuous batching in tokens (None: unknown, or the sequential path)."""
        if cb_manager is None:
            return None
        found = compat.serve_cache_tokens(compat.serve_continuous_batching(cb_manager))
        return found if found is not None else self.cache_tokens

    def admit(self, model: Any, inputs: Any, gen_config: Any, cb_manager: Any = None) -> None:
        """Check a tokenized request against the bounds (raises ``RequestError``) and set its ``max_new_tokens``:
        transformers serve's default is capped at the bound; an explicit value beyond it is refused."""
        info = CURRENT.get()
        param = info.prompt_field if info is not None else "prompt"
        ids = inputs["input_ids"]
        n = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
        if n == 0:
            raise RequestError(f"{param}: it gives no tokens (the tokenizer turned it into an empty prompt); "
                               "allowed: a prompt of at least one token", param=param, code="invalid_value")
        bounds: list[tuple[int, str, int | None]] = []  # (new tokens, why, the most prompt tokens it allows)
        positions = self.facts.max_positions
        if positions is not None:
            bounds.append((positions - n, f"the model's {positions} positions minus the prompt's {n} tokens",
                           positions - 1))
        cache = self.capacity(cb_manager)
        if cache is not None:
            bounds.append((cache - n, f"continuous batching's KV cache of {cache} tokens minus the prompt's {n}",
                           cache - 1))
        if self.cap is not None:
            bounds.append((self.cap, f"the server's --max-new-tokens-cap {self.cap}", None))
        if not bounds:
            return
        limit, why, longest = min(bounds, key=lambda b: b[0])
        if limit < 1:
            raise RequestError(f"{param}: the prompt has {n} tokens, which leaves nothing to generate ({why}); "
                               f"allowed: a prompt of at most {longest} tokens", param=param,
                               code="context_length_exceeded")
        requested = gen_config.max_new_tokens
        if requested is None:
            requested = (gen_config.max_length or 20) - n
        if requested > limit:
            if info is not None and info.explicit is not None:
                field, value = info.explicit
                raise RequestError(f"{field}: {value} is more new tokens than this server generates after this "
                                   f"prompt: at most {limit} ({why}); allowed: an integer from 1 to {limit}",
                                   param=field.split(".")[0], code="context_length_exceeded")
            requested = limit
            with self.count_lock:
                self.counts["capped"] += 1
        gen_config.max_new_tokens = max(1, requested)

    # -- the continuous-batching worker

    def revive(self) -> None:
        """If continuous batching's worker died, say why and let transformers serve start a new one at the next
        request (/health answers 200 again); the third death within ``REVIVAL_WINDOW_S`` sets ``fatal`` instead."""
        state = self.generation_state
        if state is None:
            return
        with self.lock:
            if state.is_cb_alive():
                return
            error = compat.serve_worker_error(state)
            reason = f"{type(error).__name__}: {error}" if error is not None else "unknown"
            now = time.monotonic()
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > REVIVAL_WINDOW_S:
                self.deaths.popleft()
            with contextlib.suppress(Exception):
                state.shutdown()  # stops the dead manager and forgets it: the next request starts a new one
            if len(self.deaths) >= REVIVAL_LIMIT:
                self.fatal = (f"continuous batching's worker died {len(self.deaths)} times within "
                              f"{REVIVAL_WINDOW_S:.0f} s (last: {reason})")
                log(f"ERROR: {self.fatal}; stopping the server")
                return
            self.counts["restarts"] += 1
        log(f"WARNING: continuous batching's worker died ({reason}); the requests it held failed, and a new worker "
            "starts with the next request")

    # -- requests in flight

    def abort_requests(self, why: str) -> int:
        """Stop every request still in flight (from any thread): its generation stops and its task ends with a 503
        (or a final error event). Returns how many there were."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return 0

        async def abort() -> int:
            tasks = list(self.active)
            for task in tasks:
                task.cancel(why)
            if tasks:
                await asyncio.wait(tasks, timeout=STOP_WAIT_S + 2)
            return len(tasks)

        try:
            return asyncio.run_coroutine_threadsafe(abort(), loop).result(timeout=STOP_WAIT_S + 5)
        except Exception:
            return 0

    def stop_generations(self, why: str) -> None:
        """Stop the generations of the requests in flight (from any thread; no reply is sent)."""
        for info in list(self.active.values()):
            info.stop(why)

    def summary(self) -> str:
        """What the guard did, for the line printed at the end."""
        c = self.counts
        parts = [f"{c['refused']} refused", f"{c['capped']} capped at the bound",
                 f"{c['disconnected']} stopped when their client disconnected"]
        if c["aborted"]:
            parts.append(f"{c['aborted']} stopped at shutdown")
        if c["restarts"]:
            parts.append(f"continuous batching's worker restarted {c['restarts']} time{'s' * (c['restarts'] != 1)}")
        return ", ".join(parts)


#: the settings of a request that continuous batching applies from the first request to all (transformers serve
#: passes a request only its prompt, max_new_tokens and eos_token_id), each with the request field that sets it
SHARED_SAMPLING = (("do_sample", "temperature"), ("temperature", "temperature"), ("top_p", "top_p"),
                   ("top_k", "generation_config"), ("min_p", "generation_config"),
                   ("repetition_penalty", "frequency_penalty"), ("sequence_bias", "logit_bias"))


#: the values of ``SHARED_SAMPLING`` that mean "not set"
_UNSET = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "top_k": 0, "min_p": 0.0, "sequence_bias": {}}


def _sampling(config: Any) -> dict[str, Any]:
    """What of ``SHARED_SAMPLING`` changes the tokens chosen (the sampling ones only when sampling), unset values
    as None."""
    sampled = bool(getattr(config, "do_sample", False))
    out: dict[str, Any] = {"do_sample": sampled}
    for name, _ in SHARED_SAMPLING[1:]:
        if sampled or name in ("repetition_penalty", "sequence_bias"):
            value = getattr(config, name, None)
            out[name] = None if value is None or value == _UNSET[name] else value
    return out


def check_shared_sampling(gen_config: Any, cb: Any) -> None:
    """On continuous batching, refuse a request whose sampling differs from the one its worker runs every request
    with (the first request's: transformers serve has no per-request sampling there), and stop strings (its worker
    stops at the end-of-sequence token and the new-token bound only): served, they would be ignored silently."""
    if getattr(gen_config, "stop_strings", None):
        raise RequestError("stop: continuous batching does not apply stop strings (its worker stops at the "
                           "end-of-sequence token and max_tokens only); allowed: leave it out, or serve without "
                           "--continuous-batching", param="stop", code="unsupported_value")
    running = getattr(cb, "generation_config", None)
    if running is None:
        return
    want, have = _sampling(gen_config), _sampling(running)
    if want == have:
        return
    name = next(n for n in dict.fromkeys([*want, *have]) if want.get(n) != have.get(n))
    field = dict(SHARED_SAMPLING)[name]

    def said(values: dict[str, Any]) -> str:
        if not values["do_sample"]:
            extra = {k: v for k, v in values.items() if k != "do_sample" and v is not None}
            return "greedy" + (f" with {extra}" if extra else "")
        return "sampling with " + ", ".join(f"{k} {v}" for k, v in values.items()
                                            if k != "do_sample" and v is not None)

    raise RequestError(f"{field}: this request asks for {said(want)}, but continuous batching runs every request with "
                       f"the sampling of the first one it served ({said(have)}): transformers serve has no "
                       "per-request sampling there; allowed: the same settings, or serve without "
                       "--continuous-batching", param=field, code="unsupported_value")


def loaded_model(model_manager: Any) -> tuple[Any, Any]:
    """The model and processor transformers serve's ``ModelManager`` preloaded (its ``force_model``)."""
    name = model_manager.process_model_name(model_manager.force_model)
    return model_manager.load_model_and_processor(name)


# ------------------------------------------------------------------------------------------------ the middleware


class Guard:
    """ASGI middleware in front of transformers serve's app (see the module docstring)."""

    def __init__(self, app: Any, guardian: Guardian) -> None:
        self.app, self.guardian = app, guardian

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.guardian.loop is None:
            self.guardian.loop = asyncio.get_running_loop()
        path = scope.get("path", "")
        reply = Reply(send, path, self.guardian)
        if scope.get("method") != "POST" or path not in ROUTES:
            await self._run(scope, receive, reply, None)
            return
        body = await read_body(receive)
        if body is None:  # the client left before its request was read
            return
        try:
            if len(body) > MAX_BODY_BYTES:
                raise RequestError(f"the request body has {len(body)} bytes; allowed: at most {MAX_BODY_BYTES}",
                                   status=413, code="request_too_large")
            try:
                payload = json.loads(body)
            except ValueError as e:
                raise RequestError(f"the request body is not valid JSON ({e}); allowed: a JSON object",
                                   code="invalid_json") from None
            info = check_request(path, payload, self.guardian.facts)
        except RequestError as e:
            await reply.error(e)
            return
        app_receive, client_receive = replay(body, receive)
        token = CURRENT.set(info)
        try:
            await self._run(scope, app_receive, reply, info, client_receive)
        finally:
            CURRENT.reset(token)

    async def _run(self, scope: dict, receive: Callable, reply: Reply, info: RequestInfo | None,
                   client: Callable | None = None) -> None:
        """Run the app for one request in its own task, while watching ``client`` for a disconnect. A disconnect, or
        the end of the grace period (the guard's task cancelled), stops the request's generation and ends the app's
        task: the sequential path's ``model.generate`` returns at its next step (its task ends by itself, its reply
        dropped); any other task is cancelled. At the end of the grace period the client gets a 503."""
        guardian = self.guardian
        task = asyncio.ensure_future(self.app(scope, receive, reply.send))
        me = asyncio.current_task()
        if info is not None and me is not None:
            guardian.active[me] = info

        async def disconnected() -> None:
            while True:
                message = await client()
                if message.get("type") == "http.disconnect" and not reply.finished:
                    return  # (once the response is complete, the server's receive says "disconnect" too)
                if message.get("type") == "http.disconnect":
                    await asyncio.Event().wait()  # finished: not a client leaving

        async def end(why: str) -> bool:
            """Stop the request's generation and end the app's task; whether a generation was stopped."""
            stopped = info.stop(why) if info is not None else False
            reply.discard = True
            if info is not None and info.ends_when_stopped:
                done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
                if done:
                    return stopped
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return stopped

        watcher = asyncio.ensure_future(disconnected()) if client is not None else None
        try:
            waited = {task} if watcher is None else {task, watcher}
            try:
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the grace period is over
                await end("the server stopped")
                with guardian.count_lock:
                    guardian.counts["aborted"] += 1
                await reply.error(RequestError("the server stopped: its grace period for requests in flight ended "
                                               "before this one finished", status=503, kind="server_error",
                                               code="server_shutting_down"))
                return
            if not task.done():  # the client left
                if await end("the client disconnected"):
                    with guardian.count_lock:
                        guardian.counts["disconnected"] += 1
                return
            task.result()
        except RequestError as e:
            await reply.error(e)
        except Exception as e:
            await reply.error(classify(e))
        finally:
            if watcher is not None:
                watcher.cancel()
            guardian.active.pop(me, None)  # type: ignore[arg-type]


def classify(error: Exception) -> RequestError:
    """An exception of the app as a reply: a chat template's refusal of the messages is the client's (400); anything
    else is the server's (500, logged with its traceback)."""
    if type(error).__module__.startswith("jinja2"):
        return RequestError(f"messages: the model's chat template refuses them: {error}; allowed: the roles and "
                            "order of messages this model's chat template takes", param="messages",
                            code="invalid_value")
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return RequestError(f"the server failed on this request: {type(error).__name__}: {error}", status=500,
                        kind="server_error")


async def read_body(receive: Callable) -> bytes | None:
    """The whole request body (None when the client disconnected first)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Callable) -> tuple[Callable, Callable]:
    """(the app's ``receive``, the guard's): the app gets the body already read, then waits for the disconnect that
    the guard's ``receive`` (the only reader of the client's) passes on."""
    state = {"sent": False}
    left = asyncio.Event()

    async def app_receive() -> dict:
        if not state["sent"]:
            state["sent"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def client_receive() -> dict:
        message = await receive()
        if message.get("type") == "http.disconnect":
            left.set()
        return message

    return app_receive, client_receive


class Reply:
    """The ``send`` the app gets: error responses (status >= 400) are rewritten to OpenAI's error shape; the guard's
    own refusals are sent through it too."""

    def __init__(self, send: Callable, path: str, guardian: Guardian) -> None:
        self._send, self.path, self.guardian = send, path, guardian
        self.started = False
        self.finished = False
        self.streaming = False
        #: drop what the app sends (its request was stopped: the guard answers, or nobody listens)
        self.discard = False
        self._held: dict | None = None
        self._chunks: list[bytes] = []

    async def send(self, message: dict) -> None:
        if self.discard:
            return
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            self.streaming = b"text/event-stream" in headers.get(b"content-type", b"")
            if message["status"] >= 400 and self.path.startswith("/v1/"):
                self._held = message  # rewritten once its body is complete
                return
        elif kind == "http.response.body" and self._held is not None:
            self._chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            held, self._held = self._held, None
            await self._send_json(held["status"], self.reshape(held["status"], b"".join(self._chunks)))
            return
        if kind == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    def reshape(self, status: int, raw: bytes) -> dict[str, Any]:
        """An error body of the app (FastAPI's ``{"detail": ...}``, transformers serve's ``{"error": "..."}``, plain
        text) in OpenAI's shape."""
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw.decode("utf-8", "replace")
        if isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]:
            return data
        detail = data.get("detail", data.get("error", data)) if isinstance(data, dict) else data
        param = None
        if isinstance(detail, list):  # FastAPI's validation errors: [{"loc": [...], "msg": ..., "type": ...}]
            items = [d for d in detail if isinstance(d, dict)]
            if items:
                param = ".".join(str(x) for x in items[0].get("loc", [])[1:]) or None
            detail = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', [])[1:]) or 'body'}: {d.get('msg')}"
                               for d in items) or str(detail)
        message = str(detail)
        allowed = self.guardian.allowed_fields.get(self.path)
        if status == 422 and message.startswith("Unexpected fields") and allowed:
            message += f"; allowed: the fields of OpenAI's request that this server reads: {', '.join(allowed)}"
            named = re.findall(r"'([^']*)'", message.split(";", 1)[0])
            param = named[0] if named else param
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status < 500:
            with self.guardian.count_lock:
                self.guardian.counts["refused"] += 1
        return error_body(message, kind, param)

    async def error(self, e: RequestError) -> None:
        """Send a refusal (or, inside a started stream, a final error event)."""
        if e.status < 500:
            with self.guardian.count_lock:
                self.guardian.counts["refused"] += 1
        if self.finished:
            return
        if self.started:
            if self.streaming:
                event = f"data: {json.dumps(e.body())}\n\n".encode()
                with contextlib.suppress(Exception):
                    await self._send({"type": "http.response.body", "body": event, "more_body": False})
                self.finished = True
            return
        await self._send_json(e.status, e.body())

    async def _send_json(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.started = self.finished = True
        with contextlib.suppress(Exception):  # (the client may be gone)
            await self._send({"type": "http.response.start", "status": status,
                              "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())]})
            await self._send({"type": "http.response.body", "body": raw, "more_body": False})
