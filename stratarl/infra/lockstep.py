"""Several members' code run in lockstep, one at a time, with the calls they make batched across members.

A population (stratarl.trainer.population) runs K training runs in one process, each through the solo run's
own code. Each member runs in a thread of its own, but never two at once: the coordinator (the thread that
called ``Lockstep.run``) hands the turn to one member at a time, in member order, and the member runs until it
makes a batched call (``Lockstep.call(kind, payload)``) or ends. Once every member still running waits in a
call, the coordinator takes the calls of one kind (the first of ``priority`` that any member waits in), runs
that kind's handler once on all of them, and hands each member its result. So:

- the members' code runs exactly as it would alone, in the same order of operations, with nothing shared;
- the schedule depends only on what the members do, never on thread timing (no two threads ever run at once),
  so a population is as deterministic as its members;
- a member that raises is reported (its ``Outcome.error``) and the others go on.

A handler gets ``[(member index, payload), ...]`` and returns one result per entry; a result that is an
exception is raised in that member's call (its failure alone). A handler that raises fails every member of the
batch.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Handler = Callable[[list[tuple[int, Any]]], list[Any]]


@dataclass
class Outcome:
    """How a member's body ended: its return value, or the exception it raised (with its traceback text)."""

    value: Any = None
    error: BaseException | None = None
    trace: str = ""


def _batch_failure(kind: str, error: Exception) -> RuntimeError:
    """One member's share of a handler that raised (a fresh exception per member, caused by the handler's)."""
    failure = RuntimeError(f"the batched {kind!r} call failed: {type(error).__name__}: {error}")
    failure.__cause__ = error
    return failure


class _Slot:
    def __init__(self) -> None:
        self.state = "ready"  # ready (may run when given the turn) | waiting (in a call) | done
        self.request: tuple[str, Any] | None = None
        self.result: Any = None
        self.outcome = Outcome()

    def call(self) -> tuple[str, Any]:
        """The (kind, payload) of the call this member waits in."""
        if self.request is None:
            raise RuntimeError(f"a member in state {self.state!r} is in no call")
        return self.request


class Lockstep:
    """The coordinator of members that run one at a time and meet in batched calls (module docstring).

    ``handlers``: kind -> handler; ``priority``: the order kinds are served in when members wait in several;
    ``on_turn(i)``: called by the coordinator before member i runs (e.g. to send its output to its own log),
    and ``on_turn(None)`` before a handler runs."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        priority: Sequence[str] | None = None,
        on_turn: Callable[[int | None], None] | None = None,
    ) -> None:
        self.handlers = dict(handlers)
        self.priority = list(priority) if priority is not None else list(handlers)
        missing = set(self.handlers) - set(self.priority)
        if missing:
            raise ValueError(f"handlers {sorted(missing)} have no place in priority {self.priority}")
        self.on_turn = on_turn
        self._cv = threading.Condition()
        self._turn: int | None = None
        self._slots: list[_Slot] = []
        self._local = threading.local()
        self.batches: list[tuple[str, int]] = []
        """(kind, members) of every batch served, in order: what was batched (tests and benchmarks read it)."""

    # ------------------------------------------------------------------ the members' side

    @property
    def member(self) -> int | None:
        """The calling thread's member index (None outside a member)."""
        return getattr(self._local, "index", None)

    def call(self, kind: str, payload: Any) -> Any:
        """From a member: wait until the coordinator ran ``kind``'s handler on this and the other members' calls;
        returns this member's result (raises it when it is an exception). Outside a member (no population
        running in this thread) the handler runs at once on this call alone."""
        if kind not in self.handlers:
            raise KeyError(f"no handler for {kind!r}; kinds: {sorted(self.handlers)}")
        index = self.member
        if index is None:
            result = self.handlers[kind]([(0, payload)])[0]
        else:
            slot = self._slots[index]
            with self._cv:
                slot.request, slot.state = (kind, payload), "waiting"
                self._turn = None
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == index)
                result, slot.result = slot.result, None
        if isinstance(result, BaseException):
            raise result
        return result

    def _main(self, index: int, body: Callable[[], Any]) -> None:
        self._local.index = index
        slot = self._slots[index]
        with self._cv:
            self._cv.wait_for(lambda: self._turn == index)
        try:
            slot.outcome = Outcome(value=body())
        except BaseException as error:  # noqa: BLE001 - a member's failure is its own (reported, never raised)
            slot.outcome = Outcome(error=error, trace=traceback.format_exc())
        with self._cv:
            slot.state = "done"
            self._turn = None
            self._cv.notify_all()

    # ------------------------------------------------------------------ the coordinator's side

    def _give_turn(self, index: int) -> None:
        if self.on_turn is not None:
            self.on_turn(index)
        with self._cv:
            self._turn = index
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn is None)

    def _serve(self, waiting: list[int]) -> list[int]:
        """Run one handler on the waiting calls of the first kind in priority; returns the members served."""
        kinds = {self._slots[i].call()[0] for i in waiting}
        kind = next(k for k in self.priority if k in kinds)
        batch = [i for i in waiting if self._slots[i].call()[0] == kind]
        if self.on_turn is not None:
            self.on_turn(None)
        try:
            results = self.handlers[kind]([(i, self._slots[i].call()[1]) for i in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the {kind!r} handler returned {len(results)} results for {len(batch)} calls")
        except Exception as error:  # noqa: BLE001 - the batch's members fail, the others go on
            results = [_batch_failure(kind, error) for _ in batch]
        self.batches.append((kind, len(batch)))
        for i, result in zip(batch, results):
            slot = self._slots[i]
            slot.result, slot.request, slot.state = result, None, "ready"
        return batch

    def run(self, bodies: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Run every body (one per member) to its end; returns each one's ``Outcome``, in order."""
        if self._slots:
            raise RuntimeError("a Lockstep runs once")
        self._slots = [_Slot() for _ in bodies]
        threads = [
            threading.Thread(target=self._main, args=(i, body), name=f"member-{i}", daemon=True)
            for i, body in enumerate(bodies)
        ]
        for thread in threads:
            thread.start()
        ready = list(range(len(bodies)))
        try:
            while True:
                for index in ready:
                    self._give_turn(index)
                waiting = [i for i, slot in enumerate(self._slots) if slot.state == "waiting"]
                if not waiting:
                    break
                ready = self._serve(waiting)
        finally:
            if self.on_turn is not None:
                self.on_turn(None)
        for thread in threads:
            thread.join()
        return [slot.outcome for slot in self._slots]
