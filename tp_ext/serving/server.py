"""``tp-ext serve``'s HTTP face on rank 0: OpenAI's completions and chat completions (streamed as
server-sent events or whole), the model list, health and Prometheus metrics, on FastAPI and
uvicorn. The engine runs on its own thread (:class:`~tp_ext.serving.coordinator.EngineLoop`);
each request's outputs come back to the event loop through a queue of its own.

Errors are OpenAI's body with the status: 400 for a bad body or field (named), 401 without the
API key, 404 for an unknown model, 429 with ``Retry-After`` when the queue is full, 503 when
the engine has failed (a rank died) or the server is draining. A streaming client that goes
away cancels its request, which frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tp_ext.serving.coordinator import EngineLoop
from tp_ext.serving.metrics import ServerMetrics
from tp_ext.serving.protocol import APIError, CompletionBody, chat_body, completion_body
from tp_ext.serving.text import TextStream, chat_prompt, encode

__all__ = ["Server"]


class _Job:
    """One prompt's request in the engine, as the event loop sees it."""

    def __init__(self, server: "Server", prompt: list, body: CompletionBody, index: int):
        self.id, self.index, self.prompt = f"r{uuid.uuid4().hex}", index, prompt
        self.text = TextStream(server.tokenizer, prompt, body.stop)
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.tokens = 0
        self.finish_reason: Optional[str] = None
        self.arrival, self.last = time.monotonic(), None


class Server:
    """``loop``: the engine loop (rank 0's); ``tokenizer``: the checkpoint's, or None (token ids
    in and out); ``max_queue``: requests waiting beyond which a new one gets 429."""

    def __init__(
        self, loop: EngineLoop, tokenizer, model_name: str, *, api_key=None, max_queue=256
    ):
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.api_key, self.max_queue = api_key, max_queue
        self.engine = loop.engine
        self.created = int(time.time())
        self.draining = False
        self.metrics = ServerMetrics(loop)
        self.app = FastAPI(title="tp_ext", docs_url=None, redoc_url=None)
        self._routes()

    # -- routes ---------------------------------------------------------------------------------

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(APIError)
        async def api_error(request: Request, e: APIError):
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.get("/health")
        async def health():
            problem = self._unavailable()
            return Response(status_code=503 if problem else 200, content=problem or "")

        @app.get("/metrics")
        async def metrics():
            body, content_type = self.metrics.render()
            return Response(body, media_type=content_type)

        @app.get("/v1/models")
        async def models(request: Request):
            self._authorize(request)
            return {"object": "list", "data": [self._model_card()]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            self._authorize(request)
            body = completion_body(await self._json(request))
            return await self._serve(body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            self._authorize(request)
            body = chat_body(await self._json(request), self.engine.max_model_len)
            return await self._serve(body, chat=True)

    def _model_card(self) -> dict:
        return {
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "tp_ext", "max_model_len": self.engine.max_model_len,
        }  # fmt: skip

    def _unavailable(self) -> Optional[str]:
        if self.loop.error is not None:
            return f"the engine failed: {self.loop.error}"
        if self.loop.stopped.is_set() or self.draining:
            return "the server is shutting down"
        return None

    def _authorize(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           kind="authentication_error", code="invalid_api_key")  # fmt: skip

    async def _json(self, request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not JSON: {e}") from None

    # -- a request ----------------------------------------------------------------------------

    def _admit(self, body: CompletionBody, chat: bool) -> list:
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                           f"{self.model_name!r}", "model", code="model_not_found")  # fmt: skip
        problem = self._unavailable()
        if problem:
            raise APIError(503, problem)
        waiting = self.loop.stats()["waiting"] + self.loop.inbox.qsize()
        if waiting >= self.max_queue:
            raise APIError(429, f"{waiting} requests are waiting (at most {self.max_queue}); "
                           "retry later", kind="rate_limit_exceeded",
                           headers={"Retry-After": "1"})  # fmt: skip
        try:
            prompts = [chat_prompt(self.tokenizer, body.messages)] if chat else [
                encode(self.tokenizer, p) for p in body.prompts]  # fmt: skip
        except ValueError as e:
            raise APIError(400, str(e), "messages" if chat else "prompt") from None
        jobs = []
        for index, prompt in enumerate(prompts):
            params = body.params
            if chat and body.params.max_tokens == self.engine.max_model_len:  # not given
                params = dataclasses.replace(
                    params, max_tokens=max(1, params.max_tokens - len(prompt))
                )
            try:
                self.engine.check_request(prompt, params)
            except ValueError as e:
                param = "prompt" if len(prompt) >= self.engine.max_model_len else "max_tokens"
                raise APIError(400, str(e), param) from None
            jobs.append((_Job(self, prompt, body, index), params))
        return jobs

    async def _serve(self, body: CompletionBody, chat: bool):
        jobs = self._admit(body, chat)
        event_loop = asyncio.get_running_loop()
        for job, params in jobs:
            listener = lambda out, q=job.outputs: event_loop.call_soon_threadsafe(q.put_nowait, out)  # noqa: E731,E501
            self.loop.submit(job.id, job.prompt, params, listener)
            self.metrics.requests.inc()
        jobs = [job for job, _ in jobs]
        reply = _Reply(self, body, chat)
        if body.stream:
            return StreamingResponse(self._stream(jobs, reply), media_type="text/event-stream")
        try:
            for job in jobs:
                while await self._next(job):
                    pass
        finally:
            self._cancel_unfinished(jobs)
        return reply.whole(jobs)

    async def _next(self, job: _Job) -> bool:
        """Take the job's next output into its text; False once it has ended."""
        out = await job.outputs.get()
        if out.token is not None:
            now = time.monotonic()
            self.metrics.token(now - (job.last or job.arrival), first=job.last is None)
            job.last, job.tokens = now, job.tokens + 1
            job.text.add(out.token)
        if job.text.stopped and out.finish_reason is None:  # a stop string: end it here
            self.loop.cancel(job.id)
            job.finish_reason = "stop"
        if out.finish_reason is not None:
            job.text.finish()
            if job.finish_reason is None:
                job.finish_reason = (
                    "abort" if out.finish_reason.value == "abort" else out.finish_reason.value
                )
            if job.finish_reason == "abort" and self._unavailable():
                raise APIError(503, self._unavailable())
            return False
        return True

    async def _stream(self, jobs: list, reply: "_Reply"):
        try:
            if reply.chat:
                yield reply.event(jobs[0], {"role": "assistant", "content": ""}, None)
            for job in jobs:
                running = True
                while running:
                    try:
                        running = await self._next(job)
                    except APIError as e:
                        yield f"data: {json.dumps(e.body())}\n\n"
                        return
                    piece = job.text.take(final=not running)
                    if piece is not None or not running:
                        yield reply.event(job, piece, None if running else job.finish_reason)
            if reply.include_usage:
                yield reply.usage_event(jobs)
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: its requests are cancelled
            self._cancel_unfinished(jobs)

    def _cancel_unfinished(self, jobs) -> None:
        for job in jobs:
            if job.finish_reason is None:
                self.loop.cancel(job.id)


@dataclasses.dataclass
class _Reply:
    """The response bodies of one request: whole, or as stream events."""

    server: Server
    body: CompletionBody
    chat: bool

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = self.body.include_usage

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.server.model_name}  # fmt: skip

    @staticmethod
    def usage(jobs) -> dict:
        prompt = sum(len(j.prompt) for j in jobs)
        completion = sum(j.tokens for j in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    def whole(self, jobs) -> dict:
        if self.chat:
            job = jobs[0]
            message = {"role": "assistant", "content": job.text.text}
            choices = [{"index": 0, "message": message, "logprobs": None,
                        "finish_reason": job.finish_reason}]  # fmt: skip
            return {**self._head("chat.completion"), "choices": choices, "usage": self.usage(jobs)}
        choices = [{"index": j.index, "text": j.text.text, "logprobs": None,
                    "finish_reason": j.finish_reason} for j in jobs]  # fmt: skip
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage(jobs)}

    def event(self, job, piece, finish_reason) -> str:
        if self.chat:
            delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": job.index, "text": piece or "", "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            body = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    def usage_event(self, jobs) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._head(kind), "choices": [], "usage": self.usage(jobs)}
        return f"data: {json.dumps(body)}\n\n"
