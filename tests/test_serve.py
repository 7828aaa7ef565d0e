"""``tp-ext serve`` (tp_ext/serving/server.py) as users run it: under torchrun at TP=2, the
official ``openai`` client gets transformers' greedy text for completions (text, token ids, a
list of prompts) and chat completions, streamed or whole, with usage; 64 concurrent streaming
clients each get their own text; raw HTTP gets OpenAI's error bodies for bad input and the
server stays healthy; a client that goes away frees its KV blocks; metrics count. One process:
a full queue answers 429 with Retry-After; SIGTERM lets a running request finish, then the
server exits 0. Two ranks started by hand: when one dies the other answers 503 and exits
non-zero. All traffic is bounded and on 127.0.0.1."""

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

import pytest
import torch

from .test_generate import _checkpoint_with_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
PROMPTS = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20", "w40"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(directory) -> str:
    """The word-level Llama checkpoint, with a chat template and a decoder joining words."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    path = _checkpoint_with_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


class Server:
    """A ``tp-ext serve`` job on a free port, stopped at the end."""

    def __init__(self, path: str, nproc: int, *flags, torchrun: bool = True, env=None):
        self.port = _free_port()
        argv = ["-m", "tp_ext", "serve", "--model", path, "--port", str(self.port)]
        argv += ["--api-key", KEY, "--dtype", "float64", *map(str, flags)]
        if torchrun:
            argv = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(nproc), *argv]  # fmt: skip
        environ = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.log = open(os.path.join(os.path.dirname(path), f"serve-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=environ, stdout=self.log, stderr=self.log
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return self
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        raise AssertionError(f"not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def request(self, method: str, route: str, body=None, key=KEY, raw: bytes = None):
        """``(status, headers, parsed body)`` of one HTTP request."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, _lower(r.headers), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, _lower(e.headers), e.read().decode()

    def metric(self, name: str) -> float:
        _, _, text = self.request("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics:\n{text}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _lower(headers) -> dict:
    return {k.lower(): v for k, v in headers.items()}


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _greedy_text(path: str, ids: list, new: int) -> tuple[str, str]:
    """transformers' greedy continuation of ``ids`` alone, as the text following the prompt's,
    and why it ended."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                         do_sample=False, pad_token_id=0)[0].tolist()  # fmt: skip
    before = tokenizer.decode(ids, skip_special_tokens=True)
    text = tokenizer.decode(out, skip_special_tokens=True)[len(before) :]
    return text, "stop" if out[-1] == tokenizer.eos_token_id else "length"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = _checkpoint(tmp_path_factory.mktemp("serve"))
    server = Server(path, 2, "--tp", 2, "--max-num-seqs", 8, "--block-size", 4).wait_ready()
    yield path, server
    server.stop()  # torchrun itself raises on SIGTERM; its ranks drain and exit 0
    out = server.output()
    assert out.count("Traceback") == out.count("SignalException: Process"), out


def _ids(path, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(text)["input_ids"]


def test_completions_give_transformers_text_streamed_or_whole(served):
    path, server = served
    client = _client(server)
    for prompt in PROMPTS:
        want, reason = _greedy_text(path, _ids(path, prompt), 6)
        whole = client.completions.create(model=path, prompt=prompt, max_tokens=6, temperature=0)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want, reason)
        n = len(_ids(path, prompt))
        assert (whole.usage.prompt_tokens, whole.usage.total_tokens - n) == (
            n,
            whole.usage.completion_tokens,
        )
        usage = {"include_usage": True}
        stream = client.completions.create(model=path, prompt=prompt, max_tokens=6, temperature=0,
                                           stream=True, stream_options=usage)  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    several = client.completions.create(model=path, prompt=[[5, 6, 7], "w40"], max_tokens=4,
                                        temperature=0)  # fmt: skip
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[1].text == _greedy_text(path, _ids(path, "w40"), 4)[0]


@pytest.mark.full_matrix
def test_pipeline_stages_serve_transformers_text(tmp_path):
    path = _checkpoint(tmp_path)
    server = Server(path, 2, "--pp", 2, "--block-size", 4).wait_ready()
    try:
        for prompt in PROMPTS:
            want = _greedy_text(path, _ids(path, prompt), 6)[0]
            whole = _client(server).completions.create(
                model=path, prompt=prompt, max_tokens=6, temperature=0
            )
            assert whole.choices[0].text == want
    finally:
        server.stop()


def test_chat_completions_use_the_chat_template(served):
    from transformers import AutoTokenizer

    path, server = served
    messages = [{"role": "user", "content": "w9 w10 w11"}]
    ids = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want, reason = _greedy_text(path, ids, 5)
    client = _client(server)
    whole = client.chat.completions.create(model=path, messages=messages, max_tokens=5,
                                           temperature=0)  # fmt: skip
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason == reason
    stream = client.chat.completions.create(model=path, messages=messages, max_tokens=5,
                                            temperature=0, stream=True)  # fmt: skip
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == want


@pytest.mark.full_matrix  # a load run: make test-all
def test_64_concurrent_streams_each_get_their_own_text(served):
    path, server = served
    prompts = [f"w{5 + i % 40} w{50 + i % 7} w{60 + i % 11}" for i in range(64)]
    wanted = {p: _greedy_text(path, _ids(path, p), 5)[0] for p in set(prompts)}

    def stream(prompt):
        chunks = _client(server).completions.create(
            model=path, prompt=prompt, max_tokens=5, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(stream, prompts))
    assert got == [wanted[p] for p in prompts]
    assert server.metric("tp_ext_kv_cache_blocks_used") == 0


BAD = [  # (body or raw bytes, status, param, a piece of the message)
    (b"{not json", 400, None, "the body is not JSON"),
    ({"model": "M", "prompt": "w5", "max_tokens": "6"}, 400, "max_tokens", "an integer >= 1"),
    ({"model": "M", "prompt": "w5", "max_tokens": 0}, 400, "max_tokens", "an integer >= 1"),
    ({"model": "M", "prompt": "w5", "temperature": -1}, 400, "temperature", "in [0, 100000]"),
    ({"model": "M", "prompt": "w5", "top_p": 0}, 400, "top_p", "in (0, 1]"),
    ({"model": "M", "prompt": {"a": 1}}, 400, "prompt", "must be a string, token ids"),
    ({"model": "M", "prompt": "w5 " * 70}, 400, "prompt", "this model's context is 64 tokens"),
    ({"model": "other", "prompt": "w5"}, 404, "model", "is not served here"),
]


@pytest.mark.parametrize("body,status,param,message", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(
    served, body, status, param, message
):
    path, server = served
    raw = body if isinstance(body, bytes) else None
    if isinstance(body, dict):
        body = {**body, "model": path if body["model"] == "M" else body["model"]}
    got, _, text = server.request("POST", "/v1/completions", body, raw=raw)
    error = json.loads(text)["error"]
    assert (got, error["param"]) == (status, param) and message in error["message"], text
    assert set(error) == {"message", "type", "param", "code"}
    assert server.request("GET", "/health")[0] == 200


def test_the_api_key_is_required_and_models_are_listed(served):
    path, server = served
    status, _, text = server.request("GET", "/v1/models", key=None)
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert [m.id for m in _client(server).models.list().data] == [path]


def test_a_client_that_goes_away_frees_its_blocks(served):
    path, server = served
    body = {"model": path, "prompt": "w5 w6", "max_tokens": 50, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    response = urllib.request.urlopen(req, timeout=30)
    response.readline()  # the first event: the request is running
    response.close()  # gone mid-stream
    deadline = time.monotonic() + 20
    while server.metric("tp_ext_requests_running") or server.metric("tp_ext_kv_cache_blocks_used"):
        assert time.monotonic() < deadline, "the cancelled request kept its blocks"
        time.sleep(0.2)
    assert server.metric("tp_ext_generated_tokens_total") > 0
    assert server.metric("tp_ext_time_to_first_token_seconds_count") > 0


def test_one_process_answers_429_when_full_and_drains_on_sigterm(tmp_path):
    path = _checkpoint(tmp_path)
    server = Server(path, 1, "--max-num-seqs", 1, "--max-queue-len", 1, torchrun=False)
    server.wait_ready()
    body = {"model": path, "prompt": "w5", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda _: server.request("POST", "/v1/completions", body), range(6))
        )
    statuses = sorted(status for status, _, _ in answers)
    assert 200 in statuses and 429 in statuses, statuses
    full = next(a for a in answers if a[0] == 429)
    assert full[1]["retry-after"] == "1" and "waiting" in json.loads(full[2])["error"]["message"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(server.request, "POST", "/v1/completions", body)
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)  # drains: the running request finishes
        status, _, text = running.result(timeout=60)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 40
    assert server.stop() == 0, server.output()


def test_a_dead_rank_makes_the_server_answer_503_and_exit_nonzero(tmp_path):
    path = _checkpoint(tmp_path)
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    ranks = [
        Server(path, 2, "--tp", 2, "--timeout", 20, torchrun=False,
               env={**rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(2)
    ]  # fmt: skip
    ranks[0].wait_ready()
    body = {"model": path, "prompt": "w5 w6", "max_tokens": 60, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(ranks[0].url + "/v1/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as response:
        response.readline()  # running
        ranks[1].proc.kill()
        started = time.monotonic()
        rest = response.read().decode()
    assert "the engine failed" in rest and '"server_error"' in rest, rest[-2000:]
    code = ranks[0].proc.wait(60)
    assert code != 0 and time.monotonic() - started < 60, ranks[0].output()
    for server in ranks:
        server.stop()


REFUSED = [  # (flags, a piece of the one-line refusal)
    (["--auto", "--tp", 2], "--auto chooses the dims itself; drop --tp"),
    (["--pp", 2], "1 processes do not make --dp 1 replicas of --tp 1 --pp 2"),
    (["--tp", 2], "1 processes do not make --dp 1 replicas of --tp 2"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory must be a size such as 4GiB"),
    (["--max-num-seqs", 0], "argument --max-num-seqs: must be an integer in [1, 4,096], got '0'"),
    (["--timeout", "0"], "argument --timeout: must be a finite number in (0, 86,400], got '0'"),
    (["--block-size", "2.5"], "argument --block-size: must be an integer in [1, 1,024]"),
    (["--port", 70000], "argument --port: must be an integer in [1, 65,535], got '70000'"),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_bad_flags_are_refused_before_anything_runs(tmp_path, tp_ext_here, flags, message):
    path = _checkpoint(tmp_path)
    status, _, err = tp_ext_here("serve", "--model", path, *flags)
    assert status == 2 and message in err, err
