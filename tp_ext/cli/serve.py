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
import sys
import threading

import torch

from tp_ext.cli.flags import SERVE_FIELDS, add_field_flag
from tp_ext.cli.generate import checkpoint_dtype_of, checkpoint_tokenizer
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
        add_field_flag(dims, name, PARALLEL_FIELDS[name], "1", default=None)
    add_field_flag(dims, "dp", PARALLEL_FIELDS["dp"], "the processes left over", default=None)
    dims.add_argument("--auto", action="store_true",
                      help="the planner's (tp, dp) for the weights and a KV cache of "
                      "--max-num-seqs requests at the full context on every rank")  # fmt: skip
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    add_field_flag(net, "port", SERVE_FIELDS["port"], "8000", default=8000)
    net.add_argument("--served-model-name", help="the model's name in requests (default --model)")
    net.add_argument(
        "--api-key",
        default=os.environ.get("TP_EXT_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default $TP_EXT_API_KEY)",
    )
    add_field_flag(net, "max_queue_len", SERVE_FIELDS["max_queue_len"], "256", default=256)
    add_field_flag(net, "timeout", SERVE_FIELDS["timeout"], "60", default=60.0)
    add_field_flag(net, "drain_timeout", SERVE_FIELDS["drain_timeout"], "30", default=30.0)
    engine = parser.add_argument_group("engine")
    for name, default in (("max_num_seqs", 16), ("max_num_batched_tokens", 256)):
        add_field_flag(engine, name, SERVE_FIELDS[name], str(default), default=default)
    engine.add_argument(
        "--kv-cache-memory",
        type=str,
        default=None,
        help="KV-cache bytes per rank, e.g. 2GiB (default: --max-num-seqs "
        "requests at the full context)",
    )
    add_field_flag(engine, "block_size", SERVE_FIELDS["block_size"], "16", default=16)
    add_field_flag(engine, "max_model_len", SERVE_FIELDS["max_model_len"], "the model's context")
    engine.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share the blocks of common prompt prefixes",
    )
    add_field_flag(parser, "dtype", PARALLEL_FIELDS["dtype"], "the checkpoint's", default=None)


def _check(args) -> None:
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r} is not a checkpoint directory")
    given = [f"--{k}" for k in ("tp", "pp", "dp", "ep") if getattr(args, k) is not None]
    if args.auto and given:
        raise ConfigError(f"--auto chooses the dims itself; drop {', '.join(given)} (or --auto)")
    args.tp, args.pp, args.ep = args.tp or 1, args.pp or 1, args.ep or 1
    if args.kv_cache_memory is not None:
        args.kv_cache_memory = memory_size(args.kv_cache_memory)


def _dims(args, source) -> None:
    """--tp and --dp: the planner's (--auto), or the flags' with the replicas the processes
    left over make."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.auto:
        _auto(args, source, world)
    model = args.tp * args.pp
    dp = args.dp if args.dp is not None else max(1, world // model)
    if world != model * dp:
        raise ConfigError(
            f"{world} processes do not make --dp {dp} replicas of --tp {args.tp} --pp {args.pp}: "
            f"launch --nproc-per-node {model * dp}"
        )
    args.dp = dp


def _auto(args, source, world: int) -> None:
    from tp_ext.cli.auto import this_machine
    from tp_ext.planner.serving import plan_serving

    hardware, memory = this_machine(int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    if args.kv_cache_memory is not None:
        raise ConfigError("--auto sizes the KV cache for --max-num-seqs; drop --kv-cache-memory")
    dtype = args.dtype or str(checkpoint_dtype_of(source)).removeprefix("torch.")
    ranked = plan_serving(
        source.hf_config, world=world, memory=memory, max_num_seqs=args.max_num_seqs,
        context=args.max_model_len or source.max_position_embeddings, dtype=dtype,
        hardware=hardware,
    )  # fmt: skip
    best = next((e for e in ranked if e.fits), None)
    if best is None:
        raise ConfigError(f"--auto: nothing of {world} ranks fits; the closest: {ranked[0].reason}")
    args.tp, args.dp = best.tp, best.dp
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"tp-ext serve: --auto chose {best.describe()} ({best.reason})", file=sys.stderr)


def main(args) -> int:
    from tp_ext.models.hf.source import HFModelSource

    _check(args)
    source = HFModelSource.from_path(args.model)
    _dims(args, source)
    source.check_tp(args.tp)
    tokenizer = checkpoint_tokenizer(args.model)
    one_process_unless_launched("serve")
    timeout = datetime.timedelta(seconds=args.timeout)
    state = init_parallel(tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, timeout=timeout)
    try:
        dtype = as_torch_dtype(args.dtype) if args.dtype else checkpoint_dtype_of(source)
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
    tp_ranks = set(torch.distributed.get_process_group_ranks(state.tp_group))
    if (
        state.dp > 1
        and not set(torch.distributed.get_process_group_ranks(state.ep_group)) <= tp_ranks
    ):
        raise ConfigError(
            f"--ep {args.ep} spreads the experts over data replicas, whose engines step apart: "
            f"keep --ep within --tp {args.tp} (experts over the TP ranks) when --dp > 1"
        )
    return EngineLoop(
        engine,
        timeout_s=args.timeout,
        replica=state.dp_rank,
        replicas=state.dp,
        leader=state.tp_rank == 0 and state.pp_rank == 0,
    )


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
