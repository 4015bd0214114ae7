"""Run one schedule of the claim protocol on the real database, step by step.

Each simulated request (an *actor*) is a thread that calls a view decorated
with ``@idempotent``, so the package's own protocol and store functions run
on the thread's own connection. The store's ``claim``, ``complete`` and
``release`` and the view's handler are wrapped with *gates*: the actor stops
at each and moves on only when the scheduler picks it, so one move is one
protocol step. A step that waits on a database lock is seen through the
server's lock tables and the actor is not picked again until it can move.

The time every module sees is a clock the scheduler moves forward, and the
faults (a process that dies, a connection the server ends, a body the
database refuses, a purge) are moves like any other. See "Exploring the
claim protocol" in docs/reliability.rst.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.db import DatabaseError, DataError, connection, connections, transaction
from django.db.backends.signals import connection_created
from django.http import HttpResponse
from django.test import RequestFactory
from django.utils import timezone

from django_idempotency import clock as database_clock
from django_idempotency import lease_connection, operations, store
from django_idempotency.conf import idempotency_settings
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyKey
from django_idempotency.purge import purge_expired
from django_idempotency.recovery import hold
from tests.models import Order

KEY = "explored-key-0001"
WAIT = 3.0  # the package's bounded lock wait, seconds
LEASE = timedelta(seconds=10)
TTL = timedelta(seconds=60)
#: What each actor's connection has as its own lock wait (the view's), so
#: that the package's wait showing through is told apart from it.
VIEW_LOCK_TIMEOUT_PG = "29s"
VIEW_LOCK_WAIT_MYSQL = 29
TICKS = {"lease": LEASE + timedelta(seconds=1), "ttl": TTL + timedelta(seconds=1)}
START = datetime(2030, 1, 1, tzinfo=dt_timezone.utc)
#: The clock-jump fault: the app hosts' clocks, never the database's.
CLOCK_JUMP = timedelta(days=1)
STEP_TIMEOUT = 30.0
MODES = ("atomic", "lease", "lease_in_tx")
INNODB_TRX_CACHE = 0.12

_run_ids = itertools.count()
#: The order in which claims were won: on one clock reading, which came first.
_claim_order = itertools.count()
_local = threading.local()


class ActorKilled(BaseException):
    """The actor's process is gone: nothing of it runs again (not even cleanup)."""


class HandlerFailed(Exception):
    """The view's own failure, before it had any effect."""


#: What a spec may add after its fingerprint.
FLAGS = ("fails", "steps", "hold", "reconcile")


@dataclass(frozen=True)
class Spec:
    """One simulated request: its mode, scope and fingerprint, and how its view behaves.

    ``fails``: the view raises before its effect. ``steps``: the view records
    its effect as a checkpoint, and skips it when a taken-over claim already
    has it. ``hold`` / ``reconcile``: the view's recovery policy (lease mode)
    holds an abandoned claim, or settles it from its checkpoint.
    """

    name: str
    mode: str = "atomic"
    scope: str = "s1"
    fingerprint: str = "f1"
    fails: bool = False
    steps: bool = False
    policy: str | None = None

    @property
    def body(self) -> str:
        return f"{self.name}|{self.scope}|{self.fingerprint}"

    def __str__(self) -> str:
        flags = [flag for flag in ("fails", "steps") if getattr(self, flag)]
        flags += [self.policy] if self.policy else []
        return ":".join([self.name, self.mode, self.scope, self.fingerprint, *flags])

    @classmethod
    def parse(cls, text: str) -> Spec:
        name, mode, scope, fingerprint, *flags = text.split(":")
        unknown = set(flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"unknown flags {sorted(unknown)} in {text!r}")
        policy = next((flag for flag in flags if flag in ("hold", "reconcile")), None)
        return cls(name, mode, scope, fingerprint, "fails" in flags, "steps" in flags, policy)


class Clock:
    """The time while a schedule runs; moves only when told.

    ``current`` is the database's clock, which decides; ``now()`` is what
    the app hosts' clocks show (``timezone.now()``), off by ``skew`` after a
    clock jump, which must decide nothing.
    """

    def __init__(self) -> None:
        self.current = START
        self.skew = timedelta(0)

    def now(self) -> datetime:
        return self.current + self.skew

    def advance(self, delta: timedelta) -> None:
        self.current += delta
        database_clock.pin(self.current)


@dataclass
class Step:
    move: str
    outcome: str


class Violation(AssertionError):
    """An invariant broke; the message is the schedule as a script."""


class _Thread:
    """A thread with its own database connection that runs one step per ``go``."""

    def __init__(self, name: str, world: World) -> None:
        self.name = name
        self.world = world
        self.inbox: queue.Queue[str] = queue.Queue()
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.connection_ids: list[int] = []
        self.blocked = False
        self.done = False
        self.in_transaction = False
        self.killed = False
        self.cut = False
        self.outcome = ""
        self.thread = threading.Thread(target=self._main, name=f"explorer-{name}", daemon=True)

    @property
    def application_name(self) -> str:
        return f"{self.world.run_id}-{self.name}"

    def _main(self) -> None:
        _local.actor = self
        try:
            self.body()
        finally:
            _local.actor = None
            for wrapper in [*connections.all(initialized_only=True)]:
                _close_quietly(wrapper)
            for wrapper in lease_connection._wrappers().values():
                _close_quietly(wrapper)
            self.events.put(("done", self.outcome))

    def body(self) -> None:
        raise NotImplementedError

    def gate(self, label: str) -> None:
        """Stop here until the scheduler picks this actor again."""
        if self.killed:
            raise ActorKilled
        self.in_transaction = connections["default"].in_atomic_block
        self.events.put(("gate", label))
        if self.inbox.get() == "die":
            self.killed = True
            raise ActorKilled


def _close_quietly(wrapper: Any) -> None:
    # A connection the server ended may not close cleanly.
    with contextlib.suppress(Exception):
        wrapper.close()


class Actor(_Thread):
    def __init__(self, spec: Spec, world: World) -> None:
        super().__init__(spec.name, world)
        self.spec = spec
        self.token: str | None = None
        self.claimed_at: datetime | None = None
        self.claimed_when: datetime | None = None
        self.claim_order = 0
        self.completed_expires: datetime | None = None
        self.handler_ran = False
        self.handler_returned = False
        self.cut_after_handler = False
        self.refuse_body = False
        self.releasing = False
        self.database_error = False
        self.label = "begin"
        #: The body of the effect this actor answered for: its own, or, when
        #: it resumed or settled a taken-over claim, the one its checkpoint names.
        self.effect_body = spec.body

    def body(self) -> None:
        if self.inbox.get() == "die":
            self.killed = True
            self.outcome = "killed"
            return
        request = RequestFactory().post(
            "/explored",
            data=b"{}",
            content_type="application/json",
            headers={idempotency_settings.header: KEY},
        )
        view = idempotent(
            atomic=self.spec.mode == "atomic",
            wait=WAIT,
            lease=LEASE,
            ttl=TTL,
            scope=lambda request: self.spec.scope,
            fingerprint=lambda request: self.spec.fingerprint,
            recover=self.recover if self.spec.policy else None,
        )(self.handler)
        try:
            if self.spec.mode == "lease_in_tx":
                # As ATOMIC_REQUESTS would: the view runs inside the request's transaction.
                with transaction.atomic():
                    response = view(request)
                    self.gate("commit")
            else:
                response = view(request)
            self.outcome = self.describe(response)
        except ActorKilled:
            self.outcome = "killed"
        except HandlerFailed:
            self.outcome = "failed"
        except Exception as exc:  # an outcome like any other, judged later
            if self.killed:
                self.outcome = "killed"
                return
            self.database_error = isinstance(exc, DatabaseError)
            self.outcome = f"error {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"

    def handler(self, request: Any) -> HttpResponse:
        self.gate("effect")
        self.handler_ran = True
        self.world.check_view_lock_wait(self)
        if self.spec.fails:
            raise HandlerFailed
        done = request.idempotency.checkpoints
        if self.spec.steps and "effect" in done:
            # Resumed: an earlier owner's effect is done, and checkpointed.
            self.effect_body = done["effect"]
        else:
            self.world.check_resumes(self, request)
            Order.objects.create(item=self.spec.body)
            if self.spec.steps:
                request.idempotency.checkpoint("effect", self.spec.body)
        self.handler_returned = True
        return HttpResponse(self.effect_body, status=201)

    def recover(self, request: Any, abandoned: Any) -> HttpResponse | None:
        """The view's recovery policy: hold every abandoned claim, or settle from its checkpoint."""
        self.gate("recover")
        if self.spec.policy == "hold":
            return hold(request, abandoned)
        effect = abandoned.checkpoints.get("effect")
        if effect is None:
            return None  # nothing escaped: take it over
        self.effect_body = effect
        return HttpResponse(effect, status=201)

    @staticmethod
    def describe(response: HttpResponse) -> str:
        status = response.status_code
        if response.get(idempotency_settings.replay_header) == "true":
            return f"replay {status} {response.content.decode()!r}"
        if status == 201:
            return "ran"
        if status == 409:
            return "conflict"
        if status == 422:
            return "mismatch"
        return f"status {status}"


class Operator(_Thread):
    """``manage.py idempotency_keys release`` on every in-progress record, without ``--force``."""

    def body(self) -> None:
        while True:
            command = self.inbox.get()
            if command != "release":
                return
            outcomes = []
            for record in IdempotencyKey.objects.filter(state=IdempotencyKey.State.IN_PROGRESS):
                try:
                    released = operations.release(record)
                except operations.LeaseStillHeld:
                    outcomes.append("refused (lease held)")
                else:
                    outcomes.append("released" if released else "changed meanwhile")
                    if released:
                        self.world.released_tokens.add(record.owner_token)
            self.events.put(("gate", "release: " + (", ".join(outcomes) or "nothing held")))


class Purger(_Thread):
    def body(self) -> None:
        while True:
            command = self.inbox.get()
            if command != "purge":
                return
            cutoff = self.world.clock.current
            try:
                removed = purge_expired()
                report = f"purged {removed} at +{_since(cutoff)}"
            except DatabaseError as exc:
                report = f"purge error {type(exc).__name__}"
            self.world.purge_cutoff = cutoff
            self.events.put(("gate", report))


def _purgeable(record: dict[str, Any], cutoff: datetime) -> bool:
    """Whether a purge with ``cutoff`` may delete ``record`` (as it was before the purge)."""
    if record["expires_at"] > cutoff:
        return False
    retained = record["retained_until"]
    in_progress = record["state"] == IdempotencyKey.State.IN_PROGRESS
    return not in_progress or retained is None or retained <= cutoff


def _since(moment: datetime) -> str:
    return f"{int((moment - START).total_seconds())}s"


def _current() -> _Thread | None:
    return getattr(_local, "actor", None)


# The gates, installed over the store's functions while a schedule runs.


def _gated_claim(using: str, new: store.NewClaim, wait: float, **options: Any) -> Any:
    actor = _current()
    if not isinstance(actor, Actor):
        return _real["claim"](using, new, wait, **options)
    actor.gate("claim")
    # When the statement runs, which is later than the request's own "now"
    # if the clock moved since it began; by the database's clock.
    claimed_when = actor.world.clock.current
    result = _real["claim"](using, new, wait, **options)
    if result.existing is not None:
        # Only a recovery policy is shown an expired record: an abandoned claim.
        left_to_policy = options.get("take_over_abandoned") is False
        if result.existing.expires_at <= claimed_when and not (
            left_to_policy and result.existing.abandoned()
        ):
            actor.world.violate(f"{actor.name} was answered from an expired record")
    else:
        actor.token = new.owner_token or None
        actor.claimed_at = claimed_when
        actor.claimed_when = claimed_when
        actor.claim_order = next(_claim_order)
    return result


def _gated_complete(
    using: str, record_id: int, response: store.StoredResponse, **kwargs: Any
) -> bool:
    actor = _current()
    if not isinstance(actor, Actor):
        return _real["complete"](using, record_id, response, **kwargs)
    actor.gate("store")
    if actor.refuse_body and response.body:
        # As MySQL refuses a packet over max_allowed_packet: the statement fails.
        raise DataError("The database refused the response body (explorer fault).")
    completed = _real["complete"](using, record_id, response, **kwargs)
    if completed and kwargs["owner_token"] is not None:
        # The expiry the database's clock gave it, read on the same connection.
        actor.completed_expires = (
            IdempotencyKey.objects.using(using)
            .filter(pk=record_id)
            .values_list("expires_at", flat=True)
            .get()
        )
    if kwargs["owner_token"] is None:
        actor.gate("commit")
    return completed


def _gated_progress(using: str, record_id: int, **options: Any) -> bool:
    actor = _current()
    if not isinstance(actor, Actor):
        return _real["record_progress"](using, record_id, **options)
    actor.gate("progress")
    recorded = _real["record_progress"](using, record_id, **options)
    if recorded and options.get("owner_token") is not None:
        owner = IdempotencyKey.objects.filter(pk=record_id).values_list("owner_token", flat=True)
        if list(owner) != [options["owner_token"]]:
            actor.world.violate(f"{actor.name} recorded progress on a claim it no longer owns")
    return recorded


def _gated_take_over(using: str, abandoned: Any, new: store.NewClaim) -> Any:
    actor = _current()
    if not isinstance(actor, Actor):
        return _real["take_over"](using, abandoned, new)
    actor.gate("take over")
    taken = _real["take_over"](using, abandoned, new)
    if taken is not None:
        actor.token = new.owner_token
        actor.claimed_at = actor.claimed_when = actor.world.clock.current
        actor.claim_order = next(_claim_order)
    return taken


def _gated_release(using: str, record_id: int, owner_token: str, **options: Any) -> bool:
    actor = _current()
    if not isinstance(actor, Actor):
        return _real["release"](using, record_id, owner_token, **options)
    actor.gate("release")
    actor.releasing = True
    return _real["release"](using, record_id, owner_token, **options)


_real: dict[str, Callable[..., Any]] = {}


def _on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    actor = _current()
    if actor is None:
        return
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT set_config('application_name', %s, false)", [actor.application_name]
            )
            cursor.execute(f"SET lock_timeout = '{VIEW_LOCK_TIMEOUT_PG}'")
        elif connection.vendor == "mysql":
            cursor.execute("SELECT CONNECTION_ID()")
            actor.connection_ids.append(int(cursor.fetchone()[0]))
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {VIEW_LOCK_WAIT_MYSQL}")


@contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Gate the store's functions and show every module ``clock`` as the time."""
    saved_now = timezone.now
    gated = {
        "claim": _gated_claim,
        "complete": _gated_complete,
        "release": _gated_release,
        "record_progress": _gated_progress,
        "take_over": _gated_take_over,
    }
    _real.update({name: getattr(store, name) for name in gated})
    for name, gate in gated.items():
        setattr(store, name, gate)
    timezone.now = clock.now  # type: ignore[assignment]
    # The database's clock, which decides, reads the same moving clock.
    database_clock.pin(clock.current)
    connection_created.connect(_on_connection, dispatch_uid="tests.explorer")
    try:
        yield
    finally:
        connection_created.disconnect(dispatch_uid="tests.explorer")
        database_clock.pin(None)
        timezone.now = saved_now  # type: ignore[assignment]
        for name in gated:
            setattr(store, name, _real[name])


@dataclass
class Budget:
    """How many moves of each kind a schedule may make before it is drained."""

    moves: int = 30
    ticks: int = 2
    purges: int = 2
    faults: int = 1
    #: The operator's releases (``idempotency_keys release``, no ``--force``).
    releases: int = 1
    #: Ticks, purges and faults together, when fewer than their sum.
    extras: int = 99


@dataclass
class World:
    """The actors of one schedule, the scheduler's view of them, and the trace."""

    specs: Sequence[Spec]
    budget: Budget = field(default_factory=Budget)
    run_id: str = field(default_factory=lambda: f"xp{os.getpid()}n{next(_run_ids)}")
    trace: list[Step] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    purge_cutoff: datetime | None = None
    faults: int = 0

    def __post_init__(self) -> None:
        self.clock = Clock()
        self.vendor = connection.vendor
        self.actors = [Actor(spec, self) for spec in self.specs]
        self.purger = Purger("P", self)
        self.operator = Operator("O", self)
        self.threads: list[_Thread] = [*self.actors, self.purger, self.operator]
        self.records: dict[int, dict[str, Any]] = {}
        self.ticks = self.purges = self.releases = 0
        #: The owner tokens of the claims the operator released.
        self.released_tokens: set[str] = set()
        self._trx_read = 0.0

    # Moves.

    def enabled(self, draining: bool = False) -> list[str]:
        moves = [a.name for a in self.actors if self._may_move(a)]
        extras = self.ticks + self.purges + self.faults + self.releases
        if draining or len(self.trace) >= self.budget.moves or extras >= self.budget.extras:
            return moves
        if self.ticks < self.budget.ticks:
            moves += ["tick:lease", "tick:ttl"]
        if self.purges < self.budget.purges and self._may_move(self.purger):
            moves.append("purge")
        if self.releases < self.budget.releases and self._may_move(self.operator):
            moves.append("release")
        if self.faults < self.budget.faults:
            if not self.clock.skew:
                moves.append("jump")
            for actor in self.actors:
                if actor.done or actor.killed:
                    continue
                moves.append(f"kill:{actor.name}")
                if self.vendor != "sqlite":
                    moves.append(f"cut:{actor.name}")
                if actor.spec.mode != "atomic" and not actor.refuse_body:
                    moves.append(f"refuse:{actor.name}")
        return moves

    def _may_move(self, thread: _Thread) -> bool:
        if thread.done or thread.blocked:
            return False
        if self.vendor == "sqlite":
            # One writer: a second transaction would wait in SQLite's busy
            # handler, which no lock table shows. Let the holder finish first.
            return not any(t.in_transaction for t in self.threads if t is not thread and not t.done)
        return True

    def play(self, move: str) -> str:
        if move.startswith("tick:"):
            self.ticks += 1
            self.clock.advance(TICKS[move[5:]])
            return f"now +{_since(self.clock.current)}"
        if move == "purge":
            self.purges += 1
            return self._step(self.purger, "purge")
        if move == "release":
            self.releases += 1
            return self._step(self.operator, "release")
        if move == "jump":
            # The app hosts' clocks jump a day ahead; the database's does not.
            self.faults += 1
            self.clock.skew = CLOCK_JUMP
            return "the app hosts' clocks jumped a day ahead"
        kind, _, name = move.partition(":")
        actor = next(a for a in self.actors if a.name == (name or kind))
        if kind == "kill":
            self.faults += 1
            return self._kill(actor)
        if kind == "cut":
            self.faults += 1
            actor.cut = True
            actor.cut_after_handler = actor.handler_returned
            self._terminate(actor)
            return "connection ended by the server"
        if kind == "refuse":
            self.faults += 1
            actor.refuse_body = True
            return "its response body will be refused"
        return self._step(actor, "go")

    def _step(self, thread: _Thread, command: str) -> str:
        thread.inbox.put(command)
        return self._wait(thread, STEP_TIMEOUT)

    def _wait(self, thread: _Thread, timeout: float, *, detect_block: bool = True) -> str:
        deadline = time.monotonic() + timeout
        polls = 0
        while time.monotonic() < deadline:
            try:
                kind, detail = thread.events.get(timeout=0.002)
            except queue.Empty:
                polls += 1
                if detect_block and polls % 3 == 0 and thread.name in self._blocked_names():
                    thread.blocked = True
                    return "blocked"
                continue
            thread.blocked = False
            if kind == "done":
                thread.done = True
                return f"done: {detail}"
            if isinstance(thread, Actor):
                thread.label = detail
                return f"-> {detail}"
            return str(detail)
        self.violate(f"{thread.name} made no progress for {timeout:.0f}s")
        raise Violation(self.script())

    def settle(self) -> None:
        """Let every blocked actor that can move reach its next gate."""
        for thread in self.threads:
            if not thread.blocked:
                continue
            while True:
                try:
                    kind, detail = thread.events.get(timeout=0.01)
                except queue.Empty:
                    if thread.name in self._blocked_names():
                        break
                    continue
                thread.blocked = False
                if kind == "done":
                    thread.done = True
                    self.trace.append(Step(f"({thread.name})", f"done: {detail}"))
                else:
                    if isinstance(thread, Actor):
                        thread.label = detail
                    self.trace.append(Step(f"({thread.name})", f"-> {detail}"))
                break

    def _blocked_names(self) -> set[str]:
        with connection.cursor() as cursor:
            if self.vendor == "postgresql":
                cursor.execute(
                    "SELECT application_name FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE %s "
                    "AND cardinality(pg_blocking_pids(pid)) > 0",
                    [f"{self.run_id}-%"],
                )
                return {row[0].rpartition("-")[2] for row in cursor.fetchall()}
            if self.vendor == "mysql":
                # InnoDB refreshes this table's cache only when it was not read
                # in the last 0.1 s: reading it more often reads stale rows.
                time.sleep(max(0.0, self._trx_read + INNODB_TRX_CACHE - time.monotonic()))
                self._trx_read = time.monotonic()
                cursor.execute(
                    "SELECT trx_mysql_thread_id FROM information_schema.innodb_trx "
                    "WHERE trx_state = 'LOCK WAIT'"
                )
                waiting = {int(row[0]) for row in cursor.fetchall()}
                return {t.name for t in self.threads if waiting & set(t.connection_ids)}
        return set()

    def _terminate(self, thread: _Thread) -> None:
        """End the thread's connections from the server side and wait until they are gone."""
        with connection.cursor() as cursor:
            if self.vendor == "postgresql":
                pattern = thread.application_name
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = %s",
                    [pattern],
                )
                for _ in range(1000):
                    cursor.execute(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = %s",
                        [pattern],
                    )
                    if cursor.fetchone()[0] == 0:
                        break
                    time.sleep(0.005)
            elif self.vendor == "mysql":
                for server_id in thread.connection_ids:
                    with contextlib.suppress(DatabaseError):  # already closed
                        cursor.execute(f"KILL CONNECTION {int(server_id)}")
                ids = ",".join(str(int(i)) for i in thread.connection_ids or [0])
                for _ in range(1000):
                    cursor.execute(
                        f"SELECT count(*) FROM information_schema.processlist WHERE id IN ({ids})"
                    )
                    if cursor.fetchone()[0] == 0:
                        break
                    time.sleep(0.005)

    def _kill(self, actor: Actor) -> str:
        actor.killed = True  # from now on nothing of it runs (see the gates)
        if self.vendor != "sqlite":
            self._terminate(actor)
        if actor.blocked:
            # Its statement fails now that its connection is gone; it stops at
            # its next gate or ends, and nothing of it runs after that.
            outcome = self._wait(actor, STEP_TIMEOUT, detect_block=False)
            if outcome.startswith("done"):
                return f"process killed, {outcome}"
        return "process killed, " + self._step(actor, "die")

    # Invariants.

    def violate(self, message: str) -> None:
        self.violations.append(message)

    def check_view_lock_wait(self, actor: Actor) -> None:
        """The view's own statements wait as its connection says, not as the claim did."""
        own = connections["default"]
        if actor.cut:
            return
        with own.cursor() as cursor:
            if own.vendor == "postgresql":
                cursor.execute("SHOW lock_timeout")
                seen, expected = cursor.fetchone()[0], VIEW_LOCK_TIMEOUT_PG
            elif own.vendor == "mysql":
                cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
                seen, expected = int(cursor.fetchone()[0]), VIEW_LOCK_WAIT_MYSQL
            else:
                cursor.execute("PRAGMA busy_timeout")
                seen = cursor.fetchone()[0]
                expected = round(own.settings_dict["OPTIONS"].get("timeout", 5) * 1000)
        if str(seen) != str(expected):
            self.violate(f"{actor.name}'s view saw lock wait {seen}, not its own {expected}")

    def check_resumes(self, actor: Actor, request: Any) -> None:
        """An actor about to run its effect: its own claim must not record the effect as done.

        A takeover carries the record's checkpoints into the request; were
        they lost on the way, the effect would run twice.
        """
        if not actor.spec.steps or actor.token is None:
            return
        recorded = IdempotencyKey.objects.filter(owner_token=actor.token).values_list(
            "checkpoints", flat=True
        )
        if any(checkpoints and "effect" in checkpoints for checkpoints in recorded):
            self.violate(f"{actor.name} runs an effect its claim records as done")

    def check(self, last_move: str) -> None:
        """The invariants that hold after every step."""
        effects = list(Order.objects.values_list("item", flat=True))
        by_body = {a.spec.body: a for a in self.actors}
        committed = [by_body[item] for item in effects if item in by_body]
        if len(committed) != len(effects) or len(set(effects)) != len(effects):
            self.violate(f"unexpected effects {effects}")
        # At most one committed effect per key and scope in each ownership epoch.
        for scope in {a.spec.scope for a in committed}:
            # An epoch runs from the claim's statement to the record's expiry.
            owners = sorted(
                (a for a in committed if a.spec.scope == scope),
                key=lambda a: a.claim_order,
            )
            for earlier, later in itertools.pairwise(owners):
                if earlier.claimed_when is None or later.claimed_when is None:
                    self.violate(f"{earlier.name} or {later.name} has an effect but no claim")
                elif later.claimed_when < self._epoch_end(earlier):
                    self.violate(
                        f"{earlier.name} and {later.name} both committed their effect "
                        f"for scope {scope} in one ownership epoch"
                    )
        records = {
            r["id"]: r
            for r in IdempotencyKey.objects.values(
                "id",
                "scope",
                "fingerprint",
                "state",
                "owner_token",
                "expires_at",
                "retained_until",
                "response_body",
            )
        }
        for record in records.values():
            body = record["response_body"]
            if record["state"] != IdempotencyKey.State.COMPLETED or not body:
                continue
            owner = by_body.get(bytes(body).decode())
            if (
                owner is None
                or owner not in committed
                or owner.spec.scope != record["scope"]
                or owner.spec.fingerprint != record["fingerprint"]
            ):
                self.violate(f"record {record['scope']} stores {bytes(body)!r}, no original of it")
        # A record is deleted only by its owner's release or by a purge after it
        # expired, and a claim in progress (its progress for the retry) only
        # once it is no longer retained either.
        for record_id, before in self.records.items():
            if record_id in records:
                continue
            if self.purge_cutoff is not None and _purgeable(before, self.purge_cutoff):
                continue
            if before["state"] == IdempotencyKey.State.IN_PROGRESS and any(
                a.releasing and a.token == before["owner_token"] for a in self.actors
            ):
                continue  # released by its owner
            self.violate(
                f"a {before['state']} record of scope {before['scope']} expiring at "
                f"+{_since(before['expires_at'])} was deleted"
            )
        self.records = records

    def _epoch_end(self, actor: Actor) -> datetime:
        assert actor.claimed_at is not None
        if actor.spec.mode == "atomic":
            return actor.claimed_at + TTL
        if actor.completed_expires is not None:
            return actor.completed_expires
        return actor.claimed_at + LEASE

    def check_end(self) -> None:
        """The invariants on every request's answer, once all have ended."""
        committed = {a.spec.body for a in self.actors} & set(
            Order.objects.values_list("item", flat=True)
        )
        refused = any(a.refuse_body for a in self.actors)
        for actor in self.actors:
            outcome = actor.outcome
            if outcome.startswith("replay"):
                _, status, body = outcome.split(" ", 2)
                body = body.strip("'")
                original = next((a for a in self.actors if a.spec.body == body), None)
                if body == "" and refused:
                    continue
                if (
                    original is None
                    or status != "201"
                    or body not in committed
                    or original.spec.scope != actor.spec.scope
                    or original.spec.fingerprint != actor.spec.fingerprint
                ):
                    self.violate(f"{actor.name} was replayed {outcome}, not its own original's")
            elif outcome == "ran" and actor.effect_body not in committed:
                self.violate(f"{actor.name} answered 201 but its effect is not committed")
            elif outcome == "failed" and not actor.spec.fails:
                self.violate(f"{actor.name} failed though its view does not")
            elif outcome.startswith(("error", "status")) and not (
                actor.database_error and (actor.cut or self._nothing_left(actor, committed))
            ):
                # A database error is an answer only where the connection
                # was ended, or where the request's transaction rolled back
                # whole (a lease sharing it on SQLite, see docs/backends.rst).
                self.violate(f"{actor.name} ended with {outcome}")
            # A request that ended leaves no claim of its own in progress: only
            # a dead process's claim waits for its lease to run out. (A lease
            # inside a request transaction whose commit failed is the known
            # exception: see docs/reliability.rst.)
            if (
                actor.token
                and not actor.killed
                and not (actor.spec.mode == "lease_in_tx" and actor.cut_after_handler)
                and IdempotencyKey.objects.filter(
                    owner_token=actor.token, state=IdempotencyKey.State.IN_PROGRESS
                ).exists()
            ):
                self.violate(f"{actor.name} ended ({outcome}) but left its claim in progress")

    def _nothing_left(self, actor: Actor, committed: set[str]) -> bool:
        if actor.spec.body in committed:
            return False
        return not (actor.token and IdempotencyKey.objects.filter(owner_token=actor.token).exists())

    # The schedule as a script.

    def script(self) -> str:
        actors = " ".join(str(spec) for spec in self.specs)
        moves = " ".join(step.move for step in self.trace if not step.move.startswith("("))
        lines = [
            "Schedule (paste into a regression test):",
            f"    run_script(actors={actors!r}, moves={moves!r})",
            "Trace:",
        ]
        lines += [f"    {s.move:<14} {s.outcome}" for s in self.trace]
        lines += ["Violations:"] + [f"    {v}" for v in self.violations]
        return "\n".join(lines)


@dataclass
class Result:
    moves: int
    faults: int
    choice_points: list[int]
    violations: list[str]
    script: str


def reset_tables() -> None:
    IdempotencyKey.objects.all().delete()
    Order.objects.all().delete()


def run_schedule(
    specs: Sequence[Spec],
    choose: Callable[[list[str]], str | None],
    budget: Budget | None = None,
) -> Result:
    """Play one schedule: ``choose`` picks each move from the enabled ones (None drains)."""
    world = World(specs, budget or Budget())
    choice_points: list[int] = []
    reset_tables()
    with instrumented(world.clock):
        for thread in world.threads:
            thread.thread.start()
        try:
            draining = False
            while True:
                world.settle()
                if all(a.done for a in world.actors):
                    break
                moves = world.enabled(draining)
                if not moves:
                    # Everyone left waits on a lock: the bounded wait ends it.
                    waiting = next(t for t in world.threads if t.blocked and not t.done)
                    world.trace.append(
                        Step(
                            f"({waiting.name})",
                            world._wait(waiting, STEP_TIMEOUT, detect_block=False),
                        )
                    )
                    continue
                if draining:
                    move = moves[0]
                else:
                    choice_points.append(len(moves))
                    chosen = choose(moves)
                    if chosen is None:
                        draining = True
                        choice_points.pop()
                        continue
                    move = chosen
                outcome = world.play(move)
                world.trace.append(Step(move, outcome))
                world.settle()
                world.check(move)
            world.check_end()
        finally:
            world.purger.inbox.put("stop")
            world.operator.inbox.put("stop")
            for thread in world.actors:
                if not thread.done:
                    # Only after a failure: nothing of it may outlive the schedule.
                    thread.killed = True
                    if world.vendor != "sqlite":
                        world._terminate(thread)
                    thread.inbox.put("die")
            for thread in world.threads:
                thread.thread.join(timeout=STEP_TIMEOUT)
    return Result(
        moves=len(world.trace),
        faults=world.faults,
        choice_points=choice_points,
        violations=list(world.violations),
        script=world.script(),
    )


def run_script(actors: str, moves: str, budget: Budget | None = None) -> Result:
    """Replay a printed schedule: ``actors`` as ``Spec`` strings, ``moves`` by name."""
    specs = [Spec.parse(text) for text in actors.split()]
    wanted = iter(moves.split())
    pending: list[str] = []

    def choose(enabled: list[str]) -> str | None:
        while True:
            if not pending:
                following = next(wanted, None)
                if following is None:
                    return None
                pending.append(following)
            if pending[0] in enabled:
                return pending.pop(0)
            if pending[0] in {a.name for a in specs}:
                # The actor is blocked or done here: the printed step was
                # its own unblocking, which settles by itself.
                pending.pop(0)
                continue
            return None

    return run_schedule(
        specs, choose, budget or Budget(moves=10_000, ticks=99, purges=99, faults=99)
    )
