"""``tp-ext serve --model DIR``: an OpenAI-compatible server over the model's TP ranks
(continuous batching over a paged KV cache, :mod:`tp_ext.serving`).

    torchrun --standalone --nproc-per-node 2 -m tp_ext serve --model DIR --tp 2 --port 8000
    curl -H "Authorization: Bearer $KEY" localhost:8000/v1/completions \\
        -d '{"model": "DIR", "prompt": "Hello", "max_tokens": 16}'

Every rank loads its shards and runs the engine; rank 0 also answers HTTP (on 127.0.0.1 unless
``--host`` says otherwise). SIGTERM (torchrun passes it to every rank) stops taking requests,
lets the running ones finish within ``--drain-timeout`` seconds, then every rank exits 0. When a
rank dies, the others' next exchange fails within the group timeout: rank 0 answers 503 and
every rank exits non-zero (torchrun can restart the job).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading

import torch

from tp_ext.cli.flags import add_field_flag
from tp_ext.cli.launch import one_process_unless_launched
from tp_ext.config import PARALLEL_FIELDS
from tp_ext.distributed import destroy_parallel, init_parallel
from tp_ext.validation import ConfigError, as_torch_dtype

__all__ = ["add_arguments", "main"]

HELP = (
    "an OpenAI-compatible server (completions, chat, streaming, metrics) with continuous "
    "batching over a paged KV cache, across TP ranks"
)
log = logging.getLogger(__name__)

_SIZES = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def memory_size(text: str) -> int:
    """Bytes from ``"4GiB"``, ``"512M"`` or ``"1000000"``."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = float(t[:-1]) * _SIZES[t[-1]] if t and t[-1] in _SIZES else float(t)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"--kv-cache-memory must be a size such as 4GiB or 512MiB, got {text!r}")
    return int(value)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a transformers checkpoint directory")
    dims = parser.add_argument_group("dims")
    for name in ("tp", "pp", "ep"):
        add_field_flag(dims, name, PARALLEL_FIELDS[name], "1", default=1)
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    net.add_argument("--served-model-name", help="the model's name in requests (default --model)")
    net.add_argument(
        "--api-key",
        default=os.environ.get("TP_EXT_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default $TP_EXT_API_KEY)",
    )
    net.add_argument(
        "--max-queue-len",
        type=int,
        default=256,
        help="waiting requests beyond which a new one gets 429",
    )
    net.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any collective may take before the job fails (a dead rank)",
    )
    net.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM lets running requests finish",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="tokens a step computes (prompts are read in chunks of at most it)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=str,
        default=None,
        help="KV-cache bytes per rank, e.g. 2GiB (default: --max-num-seqs "
        "requests at the full context)",
    )
    engine.add_argument("--block-size", type=int, default=16, help="positions a KV block holds")
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens (default: the model's context)",
    )
    engine.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share the blocks of common prompt prefixes",
    )
    add_field_flag(parser, "dtype", PARALLEL_FIELDS["dtype"], "the checkpoint's", default=None)


def _check(args) -> None:
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r} is not a checkpoint directory")
    if args.pp > 1:
        raise ConfigError(
            f"--pp {args.pp}: pipeline stages are not served yet; serve with --pp 1 (--tp, and "
            "--ep for MoE models)"
        )
    if args.kv_cache_memory is not None:
        args.kv_cache_memory = memory_size(args.kv_cache_memory)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp * args.pp:
        raise ConfigError(
            f"{world} processes for --tp {args.tp} --pp {args.pp}: data replicas are not served "
            f"yet; launch --nproc-per-node {args.tp * args.pp}"
        )


def main(args) -> int:
    from tp_ext.cli.generate import _checkpoint_dtype, _tokenizer
    from tp_ext.models.hf.source import HFModelSource

    _check(args)
    source = HFModelSource.from_path(args.model)
    source.check_tp(args.tp)
    tokenizer = _tokenizer(args.model)
    one_process_unless_launched("serve")
    timeout = datetime.timedelta(seconds=args.timeout)
    state = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, timeout=timeout)
    try:
        dtype = as_torch_dtype(args.dtype) if args.dtype else _checkpoint_dtype(source)
        model, _ = source.build_and_load(state, dtype=dtype, seed=0)
        model.eval()
        loop = _engine_loop(args, model, state)
        if torch.distributed.get_rank() == 0:
            return _serve(args, loop, tokenizer)
        return _follow(args, loop)
    finally:
        destroy_parallel(destroy_process_group=True)


def _engine_loop(args, model, state):
    from tp_ext.serving import Engine
    from tp_ext.serving.coordinator import EngineLoop

    engine = Engine(
        model,
        parallel=state,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        prefix_caching=not args.no_prefix_caching,
    )
    return EngineLoop(engine, timeout_s=args.timeout)


def _serve(args, loop, tokenizer) -> int:
    import uvicorn

    from tp_ext.serving.server import Server

    name = args.served_model_name or args.model
    server = Server(loop, tokenizer, name, api_key=args.api_key, max_queue=args.max_queue_len)
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.drain_timeout,
    )
    http = uvicorn.Server(config)

    def engine():
        try:
            loop.run()
        except BaseException:  # noqa: BLE001 - logged; the server answers 503 and stops
            log.exception("the engine failed")
            http.should_exit = True

    thread = threading.Thread(target=engine, name="tp_ext-engine", daemon=True)
    thread.start()
    print(f"tp-ext serve: {name!r} on http://{args.host}:{args.port}", flush=True)
    # uvicorn raises the signal that stopped it again once it is done; this rank is then
    # stopping anyway, and exits with its own status rather than be killed by it
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    http.run()  # until SIGTERM/SIGINT (after draining) or the engine's failure
    server.draining = True
    loop.stop()
    thread.join(timeout=args.drain_timeout + 30)
    return 1 if loop.error is not None else 0


def _follow(args, loop) -> int:
    """A rank other than 0: the engine until rank 0 says stop. SIGTERM waits for that stop (rank
    0 drains first), and gives up after the drain's deadline."""

    def give_up():
        log.error("no stop from rank 0 within the drain deadline; exiting")
        os._exit(1)

    def on_term(signum, frame):
        timer = threading.Timer(args.drain_timeout + 30, give_up)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_term)
    loop.run()
    return 0
