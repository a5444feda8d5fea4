"""Execute one rank's action list: forwards, backwards, transfers, losses, timeline."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

from nxd_pipeline._actions import Action, ActionKind
from nxd_pipeline._backward import (
    WeightGradState,
    backward_full,
    backward_input,
    backward_weight,
)
from nxd_pipeline._p2p import (
    PendingReceive,
    SendsInFlight,
    TensorMeta,
    Transfer,
    exchange,
    exchange_nonblocking,
)
from nxd_pipeline._schedules import PipelineSchedule, stage_to_rank
from nxd_pipeline._timeline import ActionTiming, Timeline

__all__ = ["StepRunner"]

logger = logging.getLogger(__name__)
F, B, BI, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


class Stage(Protocol):
    """What the runner needs of a local stage (a traced ``StageModule`` or a ``ManualStage``):
    ``forward(*received_values, *model_inputs)``, the inputs named by ``input_names``."""

    input_names: list[str]

    def __call__(self, *args: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


@dataclass
class _Context:
    """What a forward leaves for its backward."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    weight_state: WeightGradState | None = None


@dataclass(kw_only=True)
class StepRunner:
    """Runs a schedule's actions for this pipeline rank over its local stage modules."""

    schedule: PipelineSchedule
    """The schedule (all ranks' lists; this runner executes ``actions[pipeline_rank]``)."""
    pipeline_rank: int
    """This rank's index in the pipeline group."""
    pipeline_ranks: list[int]
    """Global rank of every pipeline index (the p2p peers)."""
    group: ProcessGroup | None
    """The pipeline parallel group."""
    stages: dict[int, Stage]
    """Local stage index -> module."""
    select_loss: Callable[[Any], torch.Tensor]
    """Picks the loss out of the last stage's output."""
    device: torch.device
    """Where received tensors are allocated."""
    async_sends: bool = False
    """Non-blocking p2p (gloo): sends left in flight, receives waited for where the data is
    used; else synchronous batches."""
    fill_waits: bool = False
    """Split schedules on non-blocking p2p: run the next weight-gradient pass (W) while a
    compute's input is still in flight, instead of idling until the W's place in the list.
    Off by default: the list already puts W where the unit-cost timeline has its bubbles, and
    a W started just before the input arrives delays the critical path by up to one W (on 2
    shared CPU cores neither order measured better)."""
    header_cache: dict[Hashable, list[TensorMeta]] = field(default_factory=dict)
    sends: SendsInFlight = field(default_factory=SendsInFlight)

    def run(
        self, microbatches: list[dict[str, Any]], *, train: bool, signature: Hashable
    ) -> tuple[list[torch.Tensor], Timeline]:
        """Run the step; returns the per-microbatch losses (last stage only) and the timeline."""
        m = len(microbatches)
        actions = self.schedule.actions[self.pipeline_rank]
        if not train:  # forwards only, with their transfers
            actions = [a for a in actions if a.kind in (F, ActionKind.SEND_F, ActionKind.RECV_F)]
        inbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        outbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        contexts: dict[tuple[int, int], _Context] = {}
        losses: dict[int, torch.Tensor] = {}
        timeline = Timeline(start=time.perf_counter())
        weights = [a for a in actions if a.kind is W]  # run in this order, some early
        w_index = {a: k for k, a in enumerate(weights)}
        run_w = 0
        i = 0
        while i < len(actions):
            action = actions[i]
            if action.kind is W and w_index[action] < run_w:
                i += 1  # already run, while a receive was in flight
                continue
            start = time.perf_counter()
            if action.kind.is_comm:
                batch = [action]
                while i + 1 < len(actions) and actions[i + 1].kind.is_comm:
                    i += 1
                    batch.append(actions[i])
                self._communicate(batch, inbox, outbox, contexts, signature, train)
                label = ",".join(str(a) for a in batch)
            else:
                if self.fill_waits and action.kind is not W:
                    run_w = self._weights_while_waiting(
                        action, weights, run_w, inbox, contexts, timeline
                    )
                    start = time.perf_counter()
                run_w += action.kind is W
                waited = self._await_data(action, inbox)
                if waited is not None:  # the receive this compute needs was still in flight
                    timeline.entries.append(ActionTiming(f"wait {action}", False, start, waited))
                    start = waited
                grad_ctx = torch.enable_grad() if train else torch.no_grad()
                with grad_ctx:
                    self._compute(action, microbatches, inbox, outbox, contexts, losses, m)
                label = str(action)
                self._hand_over_locally(action, outbox, inbox)
            timeline.entries.append(
                ActionTiming(label, action.kind.is_compute, start, time.perf_counter())
            )
            i += 1
        self.sends.wait_all()  # sent buffers stay alive until the peer has them
        timeline.end = time.perf_counter()
        if contexts and train:
            raise RuntimeError(f"schedule left backwards undone for {sorted(contexts)}")
        return [losses[mb] for mb in sorted(losses)], timeline

    def _weights_while_waiting(
        self,
        action: Action,
        weights: list[Action],
        run_w: int,
        inbox: dict,
        contexts: dict[tuple[int, int], _Context],
        timeline: Timeline,
    ) -> int:
        """While the data ``action`` consumes is in flight, run the next W if its I has run.

        ``weights[run_w]`` is the next weight-gradient pass of the list. W sends nothing and
        feeds no other action, so running it early changes no transfer; W still run in list
        order, so every parameter's gradient sums its microbatches in the same order (the
        result is bitwise that of the list order). Returns the new count of W run.
        """
        key = ("F" if action.kind is F else "B", action.stage, action.microbatch)
        pending = inbox.get(key)
        while (
            isinstance(pending, PendingReceive) and run_w < len(weights) and not pending.arrived()
        ):
            nxt = weights[run_w]
            context = contexts.get((nxt.stage, nxt.microbatch))
            if context is None or context.weight_state is None:
                break  # its I has not run yet
            start = time.perf_counter()
            contexts.pop((nxt.stage, nxt.microbatch))
            with torch.enable_grad():
                backward_weight(context.weight_state)
            timeline.entries.append(ActionTiming(str(nxt), True, start, time.perf_counter()))
            run_w += 1
        return run_w

    def _await_data(self, action: Action, inbox: dict) -> float | None:
        """Wait for the received data ``action`` consumes; the time it arrived, if it was
        still in flight."""
        key = ("F" if action.kind is F else "B", action.stage, action.microbatch)
        pending = inbox.get(key)
        if not isinstance(pending, PendingReceive):
            return None
        inbox[key] = pending.wait()
        return time.perf_counter()

    def _hand_over_locally(self, action: Action, outbox: dict, inbox: dict) -> None:
        """Consecutive stages on this rank (p = 1): the output of a forward or backward
        becomes the next stage's input (no transfer)."""
        direction = "F" if action.kind is F else "B"
        target = action.stage + 1 if direction == "F" else action.stage - 1
        p, n_stages = self.schedule.num_ranks, self.schedule.num_stages
        local = 0 <= target < n_stages and stage_to_rank(target, p) == self.pipeline_rank
        if action.kind not in (F, B, BI) or not local:
            return
        tensors = outbox.pop((direction, action.stage, action.microbatch))
        if direction == "F":
            tensors = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        inbox[(direction, target, action.microbatch)] = tensors

    def _compute(
        self,
        action: Action,
        microbatches: list[dict[str, Any]],
        inbox: dict,
        outbox: dict,
        contexts: dict[tuple[int, int], _Context],
        losses: dict[int, torch.Tensor],
        m: int,
    ) -> None:
        s, mb = action.stage, action.microbatch
        stage = self.stages[s]
        last = s == self.schedule.num_stages - 1
        if action.kind is F:
            received = inbox.pop(("F", s, mb), []) if s > 0 else []
            args = [*received, *(microbatches[mb][name] for name in stage.input_names)]
            output = stage(*args)
            if last:
                loss = self.select_loss(output)
                losses[mb] = loss.detach()
                roots = [loss / m] if loss.requires_grad else []
            else:
                for value in output:
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(
                            f"stage {s} would send a {type(value).__name__} to stage {s + 1}; "
                            f"only tensors can cross a pipeline cut: move the cut"
                        )
                outbox[("F", s, mb)] = list(output)
                roots = [t for t in output if t.requires_grad]
            if torch.is_grad_enabled():
                contexts[(s, mb)] = _Context(
                    inputs=[t for t in received if t.requires_grad], roots=roots
                )
            return
        if action.kind is W:
            context = contexts.pop((s, mb))
            assert context.weight_state is not None
            backward_weight(context.weight_state)
            return
        context = contexts[(s, mb)] if action.kind is BI else contexts.pop((s, mb))
        grads: list[torch.Tensor | None] = (
            [None] * len(context.roots) if last else list(inbox.pop(("B", s, mb)))
        )
        if action.kind is B:
            input_grads = backward_full(context.roots, grads, context.inputs)
        else:
            params: list[torch.Tensor] = list(stage.parameters())
            input_grads, context.weight_state = backward_input(
                context.roots, grads, context.inputs, params
            )
            context.roots = []
        if s > 0:
            outbox[("B", s, mb)] = [
                g if g is not None else torch.zeros_like(x)
                for g, x in zip(input_grads, context.inputs)
            ]
        context.inputs = []

    def _communicate(
        self,
        batch: list[Action],
        inbox: dict,
        outbox: dict,
        contexts: dict[tuple[int, int], _Context],
        signature: Hashable,
        train: bool,
    ) -> None:
        p = self.schedule.num_ranks
        transfers: list[tuple[Action, Transfer]] = []
        for action in batch:
            s, mb, kind = action.stage, action.microbatch, action.kind
            if kind is ActionKind.SEND_F:
                peer, tensors = s + 1, outbox.pop(("F", s, mb))
                transfer = Transfer(True, 0, ("F", s, signature, train), tensors=tensors)
            elif kind is ActionKind.RECV_F:
                peer = s - 1
                transfer = Transfer(False, 0, ("F", s - 1, signature, train))
            elif kind is ActionKind.SEND_B:
                peer, tensors = s - 1, outbox.pop(("B", s, mb))
                metas = TensorMeta.of(tensors, grads=True)
                transfer = Transfer(True, 0, ("B", s), tensors=tensors, metas=metas)
            else:  # RECV_B: gradients of this stage's own outputs
                peer = s + 1
                metas = TensorMeta.of(contexts[(s, mb)].roots, grads=True)
                transfer = Transfer(False, 0, ("B", s), metas=metas)
            transfer.peer = self.pipeline_ranks[stage_to_rank(peer, p)]
            transfers.append((action, transfer))
        received: list[Any]
        if self.async_sends:
            received = exchange_nonblocking(
                [t for _, t in transfers], self.header_cache, self.device, self.group, self.sends
            )
        else:
            exchange([t for _, t in transfers], self.header_cache, self.device, self.group)
            received = [t.tensors for _, t in transfers]
        for (action, _), data in zip(transfers, received):
            if action.kind is ActionKind.RECV_F:
                inbox[("F", action.stage, action.microbatch)] = data
            elif action.kind is ActionKind.RECV_B:
                inbox[("B", action.stage, action.microbatch)] = data
