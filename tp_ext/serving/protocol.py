"""The OpenAI request bodies ``tp-ext serve`` takes, checked field by field: a bad one is an
:class:`APIError` that the server turns into OpenAI's error body (``{"error": {"message",
"type", "param", "code"}}``) with its HTTP status. Fields the server does not know are ignored,
as vLLM and OpenAI's own API do; a known field of the wrong type or out of range is refused by
name."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Optional

from tp_ext.serving.scheduler import SamplingParams

__all__ = ["APIError", "CompletionBody", "completion_body", "chat_body"]

# below this a temperature samples like greedy decoding (as vLLM treats it)
GREEDY_BELOW = 1e-5


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, **extra):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = extra.get("kind", "invalid_request_error" if status < 500 else "server_error")
        self.code = extra.get("code")
        self.headers = extra.get("headers")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
            }
        }  # fmt: skip


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


@dataclasses.dataclass
class CompletionBody:
    """What a completion or chat request asks, checked: ``prompts`` are text or token ids."""

    model: str
    prompts: list
    params: SamplingParams
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False
    messages: Optional[list] = None


def _field(body: dict, name: str, kinds, default=None, *, rule=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in _tuple(kinds))
    if not ok or (rule is not None and not rule(value)):
        raise bad(name, f"must be {what}, got {value!r}")
    return value


def _tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _int_list(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(body: dict) -> list:
    """``prompt`` as OpenAI takes it: a string, token ids, or a list of either."""
    if "prompt" not in body:
        raise bad("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (_int_list(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) or (_int_list(p) and p) for p in prompt):
            return list(prompt)
    raise bad("prompt", f"must be a string, token ids, or a non-empty list of them, got {prompt!r}")


def _params(body: dict, max_tokens_default: int) -> tuple[SamplingParams, tuple]:
    number = (int, float)
    max_tokens = _field(body, "max_tokens", int, max_tokens_default, rule=lambda v: v >= 1,
                        what="an integer >= 1")  # fmt: skip
    max_tokens = _field(body, "max_completion_tokens", int, max_tokens, rule=lambda v: v >= 1,
                        what="an integer >= 1")  # fmt: skip
    temperature = _field(body, "temperature", number, 1.0, rule=lambda v: 0 <= v <= 1e5,
                         what="a number in [0, 100000]")  # fmt: skip
    top_p = _field(body, "top_p", number, 1.0, rule=lambda v: 0 < v <= 1, what="in (0, 1]")
    top_k = _field(body, "top_k", int, -1, rule=lambda v: v == -1 or v >= 1,
                   what="an integer >= 1, or -1 (no top-k)")  # fmt: skip
    seed = _field(body, "seed", int, None, what="an integer")
    stop = _field(body, "stop", (str, list), [], what="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"must hold non-empty strings, got {stop!r}")
    stop_ids = _field(body, "stop_token_ids", list, [], rule=_int_list, what="a list of token ids")
    ignore_eos = _field(body, "ignore_eos", bool, False, what="true or false")
    if _field(body, "n", int, 1, what="an integer") != 1:
        raise bad("n", "only n=1 is served (send the prompt several times for more)")
    if body.get("logprobs") not in (None, False) or body.get("echo"):
        param = "logprobs" if body.get("logprobs") not in (None, False) else "echo"
        raise bad(param, "is not served yet; leave it out")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else float(temperature),
        top_p=None if top_p >= 1 else float(top_p),
        top_k=None if top_k == -1 else top_k,
        seed=secrets.randbits(62) if seed is None else seed % 2**63,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
    )
    return params, tuple(stop)


def _common(body: Any, max_tokens_default: int) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    model = _field(body, "model", str, None, what="a string")
    if model is None:
        raise bad("model", "is required")
    params, stop = _params(body, max_tokens_default)
    stream = _field(body, "stream", bool, False, what="true or false")
    options = _field(body, "stream_options", dict, {}, what="an object")
    usage = _field(options, "include_usage", bool, False, what="true or false")
    return dict(model=model, params=params, stop=stop, stream=stream, include_usage=usage)


def completion_body(body: Any) -> CompletionBody:
    common = _common(body, 16)  # OpenAI's default max_tokens for completions
    return CompletionBody(prompts=_prompts(body), **common)


def chat_body(body: Any, context: int) -> CompletionBody:
    """A chat request; ``max_tokens`` defaults to the rest of the context (capped later)."""
    common = _common(body, context)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"must be a non-empty list of messages, got {messages!r}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise bad(f"messages[{i}]", "must be an object with a string 'role'")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise bad(f"messages[{i}].content", "must be a string or a list of parts")
    return CompletionBody(prompts=[], messages=messages, **common)
