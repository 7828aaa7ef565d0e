"""torch's PowerSGD hook behind tp_ext's switch, with its error feedback saved by parameter.

torch keeps PowerSGD's residual ("error") per DDP bucket index, and DDP numbers its buckets
differently in a fresh process (its initial buckets) than after its first step (rebuilt in
the order gradients became ready). A state saved by bucket cannot be restored into another
run's buckets, so :class:`PowerSGDCompression` records which parameters each bucket holds,
saves the error split by parameter name (``<name>.powersgd_error``) with the step count, and on
resume adds each parameter's saved error to its first gradient: what the run had not sent is
sent then, nothing is lost. The first resumed step all-reduces uncompressed (torch's own rule:
PowerSGD starts after DDP has rebuilt its buckets), the following ones compress again.

Not saved: the warm-start Q matrices (torch draws them again, as at the first compressed step),
so a resumed PowerSGD run is not bitwise the uninterrupted one, as int8 and 1-bit runs are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

__all__ = ["PowerSGDCompression", "ERROR", "ITER"]

ERROR = ".powersgd_error"  # state_dict key suffix of a parameter's error feedback
ITER = "powersgd.iter"  # state_dict key of the step count


class PowerSGDCompression:
    """torch's :class:`PowerSGDState` (``.torch_state``) and what is needed to save it by
    parameter. Install with :func:`tp_ext.compression.register` (method "powersgd")."""

    def __init__(self, torch_state, named_parameters: Iterable, in_order: bool) -> None:
        self.torch_state = torch_state
        self._names = {p: n for n, p in named_parameters}
        self._bucket_params: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[str, torch.Tensor] = {}  # saved errors not yet sent again
        self.in_order = in_order  # finish each bucket before the next (gloo; see hook)

    # -- the hook ---------------------------------------------------------------------------------

    @staticmethod
    def hook(state: PowerSGDCompression, bucket):
        """DDP comm hook: torch's PowerSGD, after adding any restored error to the gradients.

        On gloo each bucket is finished before DDP starts the next one's: torch's hook issues
        its later all-reduces from callbacks of its first one, which gloo runs on its own
        thread; with several buckets in flight, ranks issue the next bucket's all-reduce and the
        previous bucket's second one in different orders, and gloo pairs collectives of
        different sizes ("Received data size doesn't match expected size")."""
        params = list(bucket.parameters())
        state._bucket_params[bucket.index()] = params
        if state._pending:
            for grad, param in zip(bucket.gradients(), params):
                saved = state._pending.pop(state._names.get(param, ""), None)
                if saved is not None:
                    grad.add_(saved.view_as(grad).to(grad.dtype))
        future = powersgd.powerSGD_hook(state.torch_state, bucket)
        if state.in_order:
            future.wait()
        return future

    # -- state by parameter -------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's error feedback (zeros before it has any) and the step count."""
        errors = {}
        for index, params in self._bucket_params.items():
            flat = self.torch_state.error_dict.get(index)
            if flat is None or flat.numel() != sum(p.numel() for p in params):
                continue
            for param, piece in zip(params, flat.split([p.numel() for p in params])):
                errors[param] = piece
        out = {}
        for param, name in self._names.items():
            if param.requires_grad:
                saved = self._pending.get(name)
                error = errors.get(param, saved)
                out[name + ERROR] = (
                    error.reshape(-1)
                    if error is not None
                    else torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
                )
        out[ITER] = torch.tensor(self.torch_state.iter, dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        by_name = {n: p for p, n in self._names.items()}
        for key, saved in state.items():
            if key == ITER:
                continue
            name = key[: -len(ERROR)] if key.endswith(ERROR) else None
            if name not in by_name:
                raise ValueError(
                    f"PowerSGD state for a parameter this model does not have: {key!r}"
                )
            if saved.numel() != by_name[name].numel():
                raise ValueError(
                    f"PowerSGD error {key!r} has {saved.numel()} elements; the parameter has "
                    f"{by_name[name].numel()} (saved at other dims?)"
                )
            self._pending[name] = saved.detach().clone()
        if ITER in state:
            # one uncompressed step first, whatever the saved count: DDP's buckets of a fresh
            # process are not the ones torch's per-bucket state would be built on
            self.torch_state.iter = min(int(state[ITER]), self.torch_state.start_powerSGD_iter - 1)
        self.torch_state.error_dict.clear()
        self.torch_state.p_memory_dict.clear()
        self.torch_state.q_memory_dict.clear()


def register_powersgd(ddp, group, named_parameters: Iterable, **options) -> PowerSGDCompression:
    """torch's PowerSGD on ``ddp`` over ``group`` (a resolved tp_ext group), rank 1 and
    compressing from the third step by default."""
    kwargs = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, **options}
    torch_state = powersgd.PowerSGDState(process_group=group.group, **kwargs)
    gloo = dist.get_backend(group.group) == "gloo"
    # only this DDP module's parameters: with several stage modules on a rank, each state
    # saves its own (another's would be zeros overwriting the real ones)
    own = {id(p) for p in ddp.module.parameters()}
    named = [(n, p) for n, p in named_parameters if id(p) in own]
    state = PowerSGDCompression(torch_state, named, in_order=gloo)
    ddp.register_comm_hook(state, PowerSGDCompression.hook)
    return state
