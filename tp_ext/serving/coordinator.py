"""The engine on every rank, fed by rank 0: :class:`EngineLoop`.

Rank 0 takes requests and cancellations from the server's threads into an inbox. Each turn of
the loop it broadcasts what arrived since the last turn (a small list of events) to the other
ranks over a gloo group of the whole job, and then every rank applies the same events to its
engine and runs the same step. With data-parallel replicas (each its own engine over its own TP
ranks) rank 0 sends each new request to the replica with the fewest requests, every replica
takes its own, and after each step the replicas' first ranks send their outputs and counts to
rank 0 (one gather a turn, so the replicas step together).

When nothing is running, rank 0 still broadcasts an empty list every ``heartbeat_s``: the others
are never left waiting longer than that, so the group's timeout tells a dead rank 0 from a quiet
one, and a dead other rank shows at rank 0 as an error of its next broadcast. Either way the
loop ends with the error (the server then answers 503 and exits non-zero).

Events: ``("add", replica, id, prompt, params)``, ``("abort", id)``, ``("stop",)`` (every rank
leaves the loop; requests still running are cancelled).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from typing import Callable, Optional

import torch.distributed as dist

from tp_ext.serving.engine import Engine, StepOutput
from tp_ext.serving.scheduler import FinishReason

__all__ = ["EngineLoop"]

log = logging.getLogger(__name__)


class EngineLoop:
    """``replica`` of ``replicas``: this rank's data-parallel replica; ``leader``: whether this
    rank speaks for it (its first TP rank)."""

    def __init__(
        self,
        engine: Engine,
        heartbeat_s: float = 0.5,
        timeout_s: float = 60.0,
        *,
        replica: int = 0,
        replicas: int = 1,
        leader: bool = True,
    ):
        self.engine, self.heartbeat_s = engine, heartbeat_s
        self.replica, self.replicas, self.leader = replica, replicas, leader
        self.assigned: dict[str, int] = {}  # rank 0: request -> its replica
        self.counts = [engine.stats()] * replicas  # rank 0: every replica's latest counts
        self.pending: list = []  # outputs the events of this turn caused
        self.inbox: queue.Queue = queue.Queue()
        self.listeners: dict[str, Callable[[StepOutput], None]] = {}
        self.error: Optional[BaseException] = None
        self.stopped = threading.Event()
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = None
        if world > 1:  # a CPU group for the events, whatever the model's backend
            timeout = datetime.timedelta(seconds=timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    # -- rank 0's side (any thread) ------------------------------------------------------------

    def submit(self, request_id: str, prompt: list, params, listener) -> None:
        """Queue a request; ``listener(output)`` is called (on the loop's thread) with each of its
        step outputs, the last with a finish reason."""
        if self.error is not None or self.stopped.is_set():
            raise RuntimeError("the engine has stopped")
        self.listeners[request_id] = listener
        load = [0] * self.replicas
        for replica in self.assigned.values():
            load[replica] += 1
        replica = load.index(min(load))
        self.assigned[request_id] = replica
        self.inbox.put(("add", replica, request_id, list(prompt), params))

    def cancel(self, request_id: str) -> None:
        if request_id in self.listeners:
            self.inbox.put(("abort", request_id))

    def stop(self) -> None:
        self.inbox.put(("stop",))

    def stats(self) -> dict:
        """The engines' counts, summed over the replicas (rank 0)."""
        if self.replicas == 1:
            return self.engine.stats()
        return {key: sum(c[key] for c in self.counts) for key in self.counts[0]}

    # -- every rank ------------------------------------------------------------------------------

    def run(self) -> None:
        """Turns until a stop event or an error (kept in ``self.error`` and raised)."""
        try:
            while True:
                events = self._exchange(self._collect() if self.rank == 0 else None)
                if not self._apply(events):
                    break
                outputs = self.engine.step() if self.engine.has_work else []
                self._deliver(self._gather([o for o in self.pending if o] + outputs))
        except BaseException as e:  # noqa: BLE001 - kept for the server, then raised
            self.error = e
            raise
        finally:
            self._cancel_all()
            self.stopped.set()

    def _collect(self) -> list:
        """Rank 0: the events that arrived (waiting up to a heartbeat when nothing runs)."""
        events = []
        if not self.listeners:  # nothing running on any replica
            try:
                events.append(self.inbox.get(timeout=self.heartbeat_s))
            except queue.Empty:
                return events
        while True:
            try:
                events.append(self.inbox.get_nowait())
            except queue.Empty:
                return events

    def _exchange(self, events):
        if self.group is None:
            return events
        box = [events]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _gather(self, outputs: list) -> list:
        """Rank 0: every replica's outputs of this turn (and their counts)."""
        if self.replicas == 1:
            return outputs
        mine = (self.replica, outputs, self.engine.stats()) if self.leader else None
        everyone = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=self.group)
        if self.rank != 0:
            return []
        merged = []
        for replica, outs, counts in filter(None, everyone):
            self.counts[replica] = counts
            merged += outs
        return merged

    def _apply(self, events: list) -> bool:
        """Apply the events in order; False at a stop. Outputs they cause (a cancellation, a
        refusal) go with this turn's step's."""
        self.pending = []
        for event in events:
            kind = event[0]
            if kind == "stop":
                return False
            if kind == "abort":
                self.pending.append(self.engine.abort(event[1]))
                continue
            _, replica, request_id, prompt, params = event
            if replica != self.replica:
                continue
            try:
                self.engine.add_request(request_id, prompt, params)
            except ValueError as e:  # checked by the server first; the same on every rank
                log.warning("request %s refused: %s", request_id, e)
                self.pending.append(StepOutput(request_id, None, FinishReason.ABORT))
        return True

    def _deliver(self, outputs) -> None:
        if self.rank != 0:
            return
        for output in outputs:
            if output is None:
                continue
            listener = self.listeners.get(output.request_id)
            if output.finish_reason is not None:
                self.listeners.pop(output.request_id, None)
                self.assigned.pop(output.request_id, None)
            if listener is not None:
                listener(output)

    def _cancel_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        for request_id in list(self.listeners):
            self._deliver([StepOutput(request_id, None, FinishReason.ABORT)])
