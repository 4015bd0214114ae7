"""One caller never receives another's stored response, under every adapter (SPEC 4.3, 4.5).

One parametrised table: ``ADAPTERS`` (rows) x ``KINDS`` (caller kinds), each
cell played through the test client and, for the middleware's rows, over a
real server as well (gunicorn for WSGI, uvicorn for ASGI). In every cell
two callers of one kind, alice and bob, send the same key and the same
body: alice, then bob, then alice again. Then

- alice's first answer is hers (the handler ran, for her);
- bob's answer is his own: not a replay of alice's (no
  ``Idempotent-Replayed``), and the handler ran again, for him;
- alice's retry replays her answer, byte for byte, without a run;
- the database holds one record per caller's scope, in the scope SPEC 4.5
  gives that caller (:func:`expected_scope`), and one effect (an ``Order``)
  per caller.

Callers with nothing to tell them apart (``anonymous``: neither a session
nor credentials) share the scope ``anonymous``, as SPEC allows: there bob's
answer *is* alice's replay, and the cell asserts exactly that. Under
``session_scope``, anonymous callers with sessions of their own are told
apart (``anonymous_session``); so are they under the default scope, as
browsers posting a form with the key in its field and a CSRF token masked
afresh on every post (``browser``, SPEC 9). Below the table, a guest who
logs in between two submits of one form is another caller for the second.

Some kinds reach some adapters only as another kind, and the table says
so (:func:`seen_as`): a DRF token or JWT sent to a view that DRF does not
serve is an ``Authorization`` header that Django does not authenticate,
which the view checks itself, the ``authorization`` kind; the cell's id
says so (``function-token-as-authorization-client``). A new adapter joins
the table with one line in ``ADAPTERS`` (and its view in
``tests/isolation_views.py``); a new caller kind with one in ``KINDS``.

Below the table: servers started with the middleware listed before
``AuthenticationMiddleware`` never answer a protected request, and
``RemoteUserMiddleware`` listed after it is refused as that order is.

Last, the table of calls (``CALL_ROWS``): a function's or task's caller is
the protected function or task itself, its scope its dotted name or the
``scope=`` it was given. Two of each kind (``idempotent_function``, sync and
async; Celery's ``idempotent_task`` on a real worker; Django's Tasks
framework's, enqueued, ``call()``-ed and ``acall()``-ed), and a function
beside a task, are given one key: each runs its own body once, and alice's
retry gets her value back.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.contrib.sessions.backends.db import SessionStore
from django.middleware.csrf import get_token
from django.test import AsyncClient, Client, RequestFactory
from django.utils.crypto import get_random_string
from rest_framework.authtoken.models import Token

from django_idempotency.models import IdempotencyKey
from django_idempotency.scopes import user_scope
from django_idempotency.signals import key_claimed
from tests.isolation_views import API_KEYS, HEADER_API_KEYS, SESSION_CALLER, encode_jwt
from tests.models import Order
from tests.polling import wait_until
from tests.server import GunicornServer, UvicornServer, running

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.isolation_urls")]

MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
SESSION_SCOPE = "django_idempotency.scopes.session_scope"
WSGI, ASGI = "wsgi", "asgi"
BODY = json.dumps({"item": "book", "quantity": 1})
FORM = "application/x-www-form-urlencoded"
REQUEST_TIMEOUT = 30
_TASKS = "django.tasks" if find_spec("django.tasks") else "django_tasks"
IMMEDIATE_TASKS = f"{_TASKS}.backends.immediate.ImmediateBackend"


# The rows: every adapter, and how it is served.


@dataclass(frozen=True)
class Adapter:
    name: str
    #: The view's name in tests/isolation_urls.py: it is served at /isolation/<view>/.
    view: str
    #: Which handler serves it: the test client's, and the middleware rows' server.
    transport: str
    #: DRF serves the view: its authentication (token, JWT, session) runs.
    drf: bool = False
    #: IdempotencyMiddleware is installed.
    middleware: bool = False
    #: A placement the package refuses at the first keyed request (500, nothing stored).
    refused: bool = False

    @property
    def path(self) -> str:
        return f"/isolation/{self.view}/"


ADAPTERS = [
    Adapter("function", "function", WSGI),
    Adapter("method_decorator", "class-based", WSGI),
    Adapter("api_view", "api-view", WSGI, drf=True),
    Adapter("mixin_apiview", "mixin-apiview", WSGI, drf=True),
    Adapter("mixin_viewset", "mixin-viewset", WSGI, drf=True),
    # A session set on DRF's request itself, Django's left without it: the
    # scope reads DRF's first, as DRF's request gives it to the view.
    Adapter("mixin_session_on_drf_request", "mixin-session-on-drf-request", WSGI, drf=True),
    Adapter("drf_method_decorator", "drf-method-decorator", WSGI, drf=True),
    # On dispatch, through method_decorator: the handler is protected, after DRF's authentication.
    Adapter("drf_dispatch_decorator", "drf-dispatch-decorator", WSGI, drf=True),
    Adapter("adrf_dispatch_decorator", "adrf-dispatch-decorator", ASGI, drf=True),
    # ...and under a subclass whose own dispatch calls the decorated one.
    Adapter("drf_dispatch_subclass", "drf-dispatch-subclass", WSGI, drf=True),
    Adapter("async_dispatch_decorator", "async-dispatch-decorator", ASGI),
    Adapter("async_function", "async-function", ASGI),
    Adapter("async_method_decorator", "async-class-based", ASGI),
    Adapter("adrf_mixin", "adrf", ASGI, drf=True),
    # IdempotencyMiddleware on a view that protects nothing itself.
    Adapter("middleware_wsgi", "plain", WSGI, middleware=True),
    Adapter("middleware_asgi", "plain", ASGI, middleware=True),
    Adapter("middleware_asgi_async_view", "async-plain", ASGI, middleware=True),
    # The middleware over a view that protects itself: protected once, by the view.
    Adapter("middleware_decorator", "function", WSGI, middleware=True),
    Adapter("middleware_async_decorator", "async-function", ASGI, middleware=True),
    # ...and one whose mark a project decorator hides: the middleware protects
    # it, with the same options, and the view runs under that protection.
    Adapter("middleware_hidden_decorator", "hidden-function", WSGI, middleware=True),
    # A DRF view hidden so: the claim would come before DRF's authentication,
    # so every keyed request is refused, whether the view protects itself or not.
    Adapter("middleware_hidden_mixin", "hidden-mixin-apiview", WSGI, True, True, True),
    Adapter("middleware_hidden_drf_apiview", "hidden-plain-apiview", WSGI, True, True, True),
    Adapter("middleware_hidden_adrf", "hidden-plain-adrf", ASGI, True, True, True),
    Adapter(
        "decorator_over_hidden_drf", "decorated-hidden-plain-apiview", WSGI, True, refused=True
    ),
    Adapter("middleware_mixin", "mixin-apiview", WSGI, drf=True, middleware=True),
    Adapter(
        "middleware_drf_dispatch_decorator",
        "drf-dispatch-decorator",
        WSGI,
        drf=True,
        middleware=True,
    ),
    Adapter("middleware_adrf_mixin", "adrf", ASGI, drf=True, middleware=True),
    Adapter("middleware_drf_dispatch_subclass", "drf-dispatch-subclass", WSGI, True, True),
    # The middleware over DRF views without the mixin: protected through the
    # mixin's path, after DRF's authentication.
    Adapter("middleware_drf_apiview", "plain-apiview", WSGI, drf=True, middleware=True),
    Adapter("middleware_drf_viewset", "plain-viewset", WSGI, drf=True, middleware=True),
    Adapter("middleware_drf_api_view", "plain-api-view", WSGI, drf=True, middleware=True),
    Adapter("middleware_drf_apiview_asgi", "plain-apiview", ASGI, drf=True, middleware=True),
    Adapter("middleware_adrf", "plain-adrf", ASGI, drf=True, middleware=True),
    Adapter("middleware_adrf_viewset", "plain-adrf-viewset", ASGI, drf=True, middleware=True),
    # ...inside a project decorator of its as_view(): refused (it would run without it),
    # unless the decorator is csrf_exempt, which changes nothing.
    Adapter(
        "middleware_wrapped_drf_apiview",
        "wrapped-plain-apiview",
        WSGI,
        drf=True,
        middleware=True,
        refused=True,
    ),
    Adapter(
        "middleware_csrf_exempt_drf_apiview",
        "csrf-exempt-plain-apiview",
        WSGI,
        drf=True,
        middleware=True,
    ),
]


# The columns: every kind of caller the scope tells apart, two of each.


@dataclass
class Caller:
    name: str
    headers: dict[str, str] = field(default_factory=dict)
    cookies: dict[str, str] = field(default_factory=dict)
    user: User | None = None
    session_key: str | None = None
    #: Posts a form with the key in its field, as a browser does (SPEC 9).
    form: bool = False


def session_user(name: str) -> Caller:
    """A user logged in with Django's session (and a CSRF token, which DRF asks of them)."""
    user = User.objects.create_user(name)
    client = Client()
    client.force_login(user)
    session = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    csrf = get_random_string(32)
    cookies = {django_settings.SESSION_COOKIE_NAME: session, django_settings.CSRF_COOKIE_NAME: csrf}
    return Caller(name, {"X-CSRFToken": csrf}, cookies, user=user)


def token_user(name: str) -> Caller:
    """A user of DRF's TokenAuthentication."""
    user = User.objects.create_user(name)
    token = Token.objects.create(user=user)
    return Caller(name, {"Authorization": f"Token {token.key}"}, user=user)


def jwt_user(name: str) -> Caller:
    """A user with a bearer JWT, as djangorestframework-simplejwt issues them."""
    user = User.objects.create_user(name)
    return Caller(name, {"Authorization": f"Bearer {encode_jwt({'sub': name})}"}, user=user)


def api_key_caller(name: str) -> Caller:
    """A caller that neither Django nor DRF authenticates: the view checks its API key."""
    key = next(key for key, owner in API_KEYS.items() if owner == name)
    return Caller(name, {"Authorization": f"Api-Key {key}"})


def header_api_key_user(name: str) -> Caller:
    """A user that DRF authenticates from an API key in a header of its own (``X-Api-Key``)."""
    user = User.objects.create_user(name)
    key = next(key for key, owner in HEADER_API_KEYS.items() if owner == name)
    return Caller(name, {"X-Api-Key": key}, user=user)


def anonymous_caller(name: str) -> Caller:
    """Neither a session nor credentials: nothing tells two of them apart."""
    return Caller("anonymous")


def anonymous_with_session(name: str) -> Caller:
    """An anonymous caller whose own session (one the store knows) names it."""
    session = SessionStore()
    session[SESSION_CALLER] = name
    session.create()
    assert session.session_key is not None
    cookies = {django_settings.SESSION_COOKIE_NAME: session.session_key}
    return Caller(name, cookies=cookies, session_key=session.session_key)


def browser(name: str) -> Caller:
    """A guest's browser: its own session, and a form with the key in a field, no header."""
    caller = anonymous_with_session(name)
    caller.form = True
    return caller


@dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[str], Caller]
    #: The SCOPE setting its cells run with (None: the default, user_scope).
    scope_setting: str | None = None
    #: The servers' settings module for its cells.
    server_settings: str = "tests.isolation_settings"
    #: Only DRF's authentication knows it: elsewhere it is a caller with
    #: neither a session nor credentials, the ``anonymous`` kind's cells.
    drf_only: bool = False


KINDS = [
    Kind("session", session_user),
    Kind("token", token_user),
    Kind("jwt", jwt_user),
    Kind("authorization", api_key_caller),
    Kind("api_key_header", header_api_key_user, drf_only=True),
    Kind("anonymous", anonymous_caller),
    Kind(
        "anonymous_session",
        anonymous_with_session,
        scope_setting=SESSION_SCOPE,
        server_settings="tests.isolation_session_settings",
    ),
    # Under the default scope: a guest's session is its scope (SPEC 9).
    Kind("browser", browser),
]


def seen_as(adapter: Adapter, kind: Kind) -> str:
    """The kind of caller this adapter's scope sees.

    A DRF token or JWT on a view that DRF does not serve is only an
    ``Authorization`` header Django does not authenticate: the view checks
    it itself, so the caller is of the ``authorization`` kind there.
    """
    if kind.name in ("token", "jwt") and not adapter.drf:
        return "authorization"
    return kind.name


def expected_scope(seen: str, caller: Caller) -> str:
    """SPEC 4.5: the scope of ``caller``, seen as ``seen``."""
    if seen in ("session", "token", "jwt", "api_key_header"):
        assert caller.user is not None
        return f"user:{caller.user.pk}"
    if seen == "authorization":
        # The keyed digest of the header, as user_scope takes it from a bare request.
        return user_scope(RequestFactory().post("/", headers=caller.headers))
    if seen in ("anonymous_session", "browser"):
        assert caller.session_key is not None
        return "session:" + hashlib.sha256(caller.session_key.encode()).hexdigest()
    return "anonymous"


def expected_via(seen: str) -> str:
    """How the handler knew the caller (``tests.isolation_views.identify``)."""
    return {
        "session": "user",
        "token": "user",
        "jwt": "user",
        "api_key_header": "user",
        "authorization": "view",
        "anonymous_session": "session",
        "browser": "session",
    }.get(seen, "nobody")


# Where a cell is played: the test client, or a real server.

CLIENT, GUNICORN, UVICORN = "client", "gunicorn", "uvicorn"


def places(adapter: Adapter) -> list[str]:
    """The test client for every row; the middleware's rows over a real server too."""
    if not adapter.middleware:
        return [CLIENT]
    return [CLIENT, GUNICORN if adapter.transport == WSGI else UVICORN]


CELLS = [
    pytest.param(
        (adapter, kind, place),
        id=f"{adapter.name}-{kind.name}"
        + (f"-as-{seen_as(adapter, kind)}" if seen_as(adapter, kind) != kind.name else "")
        + f"-{place}",
    )
    for adapter in ADAPTERS
    for kind in KINDS
    if adapter.drf or not kind.drf_only
    for place in places(adapter)
]


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    replayed: bool

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.body)
        return data


def headers_for(caller: Caller, key: str) -> dict[str, str]:
    if caller.form:
        return {**caller.headers, "Content-Type": FORM}
    return {**caller.headers, "Content-Type": "application/json", "Idempotency-Key": key}


def body_for(caller: Caller, key: str) -> str:
    """The JSON body; a browser's form, with the key and a CSRF token masked afresh each time."""
    if caller.form:
        fields = {
            **json.loads(BODY),
            "idempotency_key": key,
            "csrfmiddlewaretoken": csrf_token(caller),
        }
        return urlencode(fields)
    return BODY


def csrf_token(caller: Caller) -> str:
    """A fresh mask of the caller's CSRF secret, as every render of a form has one."""
    secret = caller.cookies.get(django_settings.CSRF_COOKIE_NAME)
    if secret is None:
        return uuid.uuid4().hex  # nothing checks it: any token, a new one each time
    request = RequestFactory().get("/")
    request.META["CSRF_COOKIE"] = secret
    return get_token(request)


def through_client(adapter: Adapter, caller: Caller, key: str) -> Answer:
    """A new test client per request, as a server serves each with a fresh handler."""
    client: Client | AsyncClient
    if adapter.transport == WSGI:
        client = Client(raise_request_exception=False)
    else:
        client = AsyncClient(raise_request_exception=False)
    for name, value in caller.cookies.items():
        client.cookies[name] = value
    post = client.post if isinstance(client, Client) else async_to_sync(client.post)
    headers = headers_for(caller, key)
    content_type = headers.pop("Content-Type")
    response = post(adapter.path, body_for(caller, key), content_type=content_type, headers=headers)
    replayed = response.get("Idempotent-Replayed") == "true"
    return Answer(response.status_code, response.content, replayed)


def through_server(
    server: GunicornServer, path: str, caller: Caller, key: str, timeout: float = REQUEST_TIMEOUT
) -> Answer:
    response = requests.post(
        server.url + path,
        data=body_for(caller, key),
        headers=headers_for(caller, key),
        cookies=caller.cookies,
        timeout=timeout,
    )
    replayed = response.headers.get("Idempotent-Replayed") == "true"
    return Answer(response.status_code, response.content, replayed)


# The servers: one per server and settings module, started on first use.


class IsolationGunicorn(GunicornServer):
    probe_path = "/isolation/ping/"


class IsolationUvicorn(UvicornServer):
    probe_path = "/isolation/ping/"


SERVER_CLASSES: dict[str, type[GunicornServer]] = {
    GUNICORN: IsolationGunicorn,
    UVICORN: IsolationUvicorn,
}


@dataclass
class Servers:
    """The module's servers, each started by the first cell that needs it."""

    stack: ExitStack
    log_dir: Callable[[str], Path]
    started: dict[tuple[str, str], GunicornServer] = field(default_factory=dict)

    def get(self, place: str, settings: str) -> GunicornServer:
        if (place, settings) not in self.started:
            server = running(SERVER_CLASSES[place], settings, self.log_dir(place), workers=2)
            self.started[(place, settings)] = self.stack.enter_context(server)
        return self.started[(place, settings)]


@pytest.fixture(scope="module")
def servers(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with ExitStack() as stack:
        yield Servers(stack, lambda name: tmp_path_factory.mktemp(f"isolation-{name}"))


# A cell: where it is played, and the claims it made.


@dataclass
class Cell:
    adapter: Adapter
    kind: Kind
    place: str
    #: The test client's, or the server that serves the cell.
    server: GunicornServer | None = None
    #: The scopes the key was claimed in, in order (test client only: signals are per process).
    claims: list[str] = field(default_factory=list)

    @property
    def seen(self) -> str:
        return seen_as(self.adapter, self.kind)

    def post(self, caller: Caller, key: str) -> Answer:
        if self.server is not None:
            return through_server(self.server, self.adapter.path, caller, key)
        return through_client(self.adapter, caller, key)


@pytest.fixture
def cell(request: pytest.FixtureRequest, settings: Any) -> Iterator[Cell]:
    """A cell of the table: the test client with the row's settings, or a running server."""
    adapter, kind, place = request.param
    if place != CLIENT:
        servers = request.getfixturevalue("servers")
        yield Cell(adapter, kind, place, server=servers.get(place, kind.server_settings))
        return
    if adapter.middleware:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]
    if kind.scope_setting:
        settings.IDEMPOTENCY = {"SCOPE": kind.scope_setting}
    played = Cell(adapter, kind, place)

    def claimed(sender: Any, idempotency: Any, **kwargs: Any) -> None:
        played.claims.append(idempotency.scope)

    key_claimed.connect(claimed)
    try:
        yield played
    finally:
        key_claimed.disconnect(claimed)


# What a cell must come to.


def records(key: str) -> Counter[str]:
    return Counter(IdempotencyKey.objects.filter(key=key).values_list("scope", flat=True))


def effects(key: str) -> Counter[str]:
    """The handler's committed runs, by caller (each run writes ``<key>|<caller>``)."""
    items = Order.objects.filter(item__startswith=f"{key}|").values_list("item", flat=True)
    return Counter(item.split("|", 1)[1] for item in items)


def check_own(answer: Answer, caller: Caller, via: str, place: str, what: str) -> dict[str, Any]:
    """``answer`` is the caller's own, from a run of the handler."""
    assert answer.status == 201, f"{what}: {answer.status} {answer.body!r}"
    assert not answer.replayed, f"{what} was a replay: {answer.body!r}"
    data = answer.json()
    assert data["caller"] == caller.name, f"{what} got {data['caller']}'s answer: {data}"
    assert data["via"] == via, f"{what}: the caller was known by {data['via']}, not {via}"
    # Served where the cell says: in this process, or by a server's worker.
    assert (data["pid"] == os.getpid()) == (place == CLIENT), data
    return data


@pytest.mark.parametrize("cell", CELLS, indirect=True)
def test_isolation(cell: Cell) -> None:
    via = expected_via(cell.seen)
    alice, bob = cell.kind.make("alice"), cell.kind.make("bob")
    key = f"iso-{uuid.uuid4().hex[:12]}"

    first = cell.post(alice, key)
    other = cell.post(bob, key)
    retry = cell.post(alice, key)

    if cell.adapter.refused:
        for answer in (first, other, retry):
            assert answer.status == 500 and b"caller" not in answer.body, answer
        assert records(key) == {}, records(key)
        assert effects(key) == {}, effects(key)
        return
    alices = check_own(first, alice, via, cell.place, "alice's first request")
    assert retry.status == 201 and retry.replayed, f"alice's retry: {retry.status} {retry.body!r}"
    assert retry.body == first.body, "alice's retry is not her answer"
    scopes = [expected_scope(cell.seen, alice), expected_scope(cell.seen, bob)]
    if alice.name == bob.name:
        # Neither a session nor credentials: one scope, shared, as SPEC 4.5 allows.
        assert scopes == ["anonymous", "anonymous"]
        assert other.status == 201 and other.replayed, f"bob: {other.status} {other.body!r}"
        assert other.body == first.body
        assert records(key) == {"anonymous": 1}
        assert effects(key) == {"anonymous": 1}
        assert cell.claims == ([] if cell.server else ["anonymous"])
        return
    bobs = check_own(other, bob, via, cell.place, "bob's request")
    assert bobs["order"] != alices["order"]
    assert scopes[0] != scopes[1], f"alice and bob share the scope {scopes[0]}"
    assert records(key) == dict.fromkeys(scopes, 1), records(key)
    assert effects(key) == {"alice": 1, "bob": 1}, effects(key)
    # Protected once: one claim per caller, in the caller's scope.
    assert cell.claims == ([] if cell.server else scopes)
    secrets = [*alice.headers.values(), *bob.headers.values()]
    secrets += [*alice.cookies.values(), *bob.cookies.values()]
    for scope in scopes:
        assert not any(secret in scope for secret in secrets), f"a credential in clear: {scope}"


# A browser's guest session that logs in between two submits of one form.


def logged_in(guest: Caller) -> Caller:
    """The guest's browser once its person logged in: Django gives it a new session key."""
    user = User.objects.create_user(guest.name)
    client = Client()
    client.cookies[django_settings.SESSION_COOKIE_NAME] = guest.cookies[
        django_settings.SESSION_COOKIE_NAME
    ]
    client.force_login(user)
    session = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    assert session != guest.session_key
    cookies = {
        django_settings.SESSION_COOKIE_NAME: session,
        django_settings.CSRF_COOKIE_NAME: get_random_string(32),
    }
    return Caller(guest.name, cookies=cookies, user=user, form=True)


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param((adapter, Kind("browser", browser), CLIENT), id=adapter.name)
        for adapter in ADAPTERS
        if not adapter.refused
    ],
    indirect=True,
)
def test_a_guest_who_logs_in_is_another_caller(cell: Cell) -> None:
    """The form was submitted as a guest, then again, with the same key, once logged in.

    The second submission comes from the user's scope: it runs, for the user,
    and is never given the guest's stored answer; its own retry replays it.
    """
    guest = browser("alice")
    key = f"iso-{uuid.uuid4().hex[:12]}"

    first = cell.post(guest, key)
    user = logged_in(guest)
    again = cell.post(user, key)
    retry = cell.post(user, key)

    check_own(first, guest, "session", cell.place, "the guest's submission")
    check_own(again, user, "user", cell.place, "the user's submission")
    assert retry.status == 201 and retry.replayed and retry.body == again.body
    scopes = [expected_scope("browser", guest), expected_scope("session", user)]
    assert records(key) == dict.fromkeys(scopes, 1), records(key)
    assert effects(key) == {"alice": 2}, effects(key)


# A server whose MIDDLEWARE lists IdempotencyMiddleware before AuthenticationMiddleware.

MISPLACED = "must come after 'django.contrib.auth.middleware.AuthenticationMiddleware'"


class Refusing:
    """A server harness that is up once a worker refused to load the application (or it exited)."""

    process: Any
    log: Callable[[], str]

    def _wait_until_answering(self, probe_path: str) -> None:
        refused = lambda: MISPLACED in self.log() or self.process.poll() is not None  # noqa: E731
        wait_until(refused, "a worker to refuse the misplaced middleware")


class RefusingGunicorn(Refusing, IsolationGunicorn):
    pass


class RefusingUvicorn(Refusing, IsolationUvicorn):
    pass


def try_post(server: GunicornServer, caller: Caller, key: str) -> int | None:
    """The status of a protected request, or ``None`` when nothing answered it."""
    try:
        return through_server(server, "/isolation/plain/", caller, key, timeout=2).status
    except (requests.ConnectionError, requests.Timeout):
        return None


@pytest.mark.parametrize(
    ("server_class", "workers", "exits"),
    [(RefusingGunicorn, 2, True), (RefusingUvicorn, 1, True), (RefusingUvicorn, 2, False)],
    ids=["gunicorn", "uvicorn", "uvicorn-workers"],
)
def test_misplaced_middleware_never_serves(
    server_class: type[GunicornServer],
    workers: int,
    exits: bool,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The middleware refuses to load, so no protected request is answered, let alone wrongly.

    Gunicorn and uvicorn run no system checks, so E006 alone would let them
    serve with every session user ``anonymous``. Gunicorn halts when its
    workers fail to boot and a single uvicorn process exits; uvicorn's
    supervisor starts new workers that refuse in turn, and nothing answers.
    """
    alice, bob = session_user("alice"), session_user("bob")
    settings = "tests.isolation_misplaced_settings"
    log_dir = tmp_path_factory.mktemp(f"misplaced-{server_class.name}")
    with running(server_class, settings, log_dir, workers=workers) as server:
        assert "ImproperlyConfigured" in server.log()
        assert server.process is not None
        if exits:
            wait_until(lambda: server.process.poll() is not None, f"{server.name} to exit")
        statuses = [try_post(server, caller, "shared") for caller in (alice, bob)]

    assert statuses == [None, None], f"a server in that order answered: {statuses}"
    assert not IdempotencyKey.objects.exists()
    assert not Order.objects.exists()


# RemoteUserMiddleware logs in the web server's user: it too must come before ours.

REMOTE_USER_MIDDLEWARE = "django.contrib.auth.middleware.RemoteUserMiddleware"
REMOTE_USER_BACKEND = "django.contrib.auth.backends.RemoteUserBackend"


class RemoteUserTests:
    """Listed after IdempotencyMiddleware, RemoteUserMiddleware would log users in too late."""

    @staticmethod
    def post_as(remote_user: str) -> Answer:
        client = Client(raise_request_exception=False)
        response = client.post(
            "/isolation/plain/",
            BODY,
            content_type="application/json",
            headers={"Idempotency-Key": "shared"},
            REMOTE_USER=remote_user,
        )
        replayed = response.get("Idempotent-Replayed") == "true"
        return Answer(response.status_code, response.content, replayed)

    @pytest.fixture(autouse=True)
    def remote_users(self, settings: Any) -> None:
        settings.AUTHENTICATION_BACKENDS = [REMOTE_USER_BACKEND]

    def test_after_ours_is_e006_and_the_handler_refuses_to_load(self, settings: Any) -> None:
        from django.core.exceptions import ImproperlyConfigured

        from django_idempotency.checks import check_middleware_order

        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE, REMOTE_USER_MIDDLEWARE]
        [error] = check_middleware_order()
        assert error.id == "django_idempotency.E006"
        assert (
            error.msg == f"{MIDDLEWARE!r} must come after {REMOTE_USER_MIDDLEWARE!r} in MIDDLEWARE."
        )
        assert "every remote user would be 'anonymous'" in error.hint

        with pytest.raises(ImproperlyConfigured, match="must come after") as refused:
            self.post_as("alice")
        assert REMOTE_USER_MIDDLEWARE in str(refused.value)
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_before_ours_each_remote_user_gets_their_own_answer(self, settings: Any) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, REMOTE_USER_MIDDLEWARE, MIDDLEWARE]

        first, other, retry = (self.post_as(name) for name in ("alice", "bob", "alice"))

        check_own(first, Caller("alice"), "user", CLIENT, "alice's first request")
        check_own(other, Caller("bob"), "user", CLIENT, "bob's request")
        assert retry.replayed and retry.body == first.body
        users = {user.username: user.pk for user in User.objects.all()}
        assert records("shared") == {f"user:{users['alice']}": 1, f"user:{users['bob']}": 1}


# A project without the auth middleware still scopes its guests by their session.

SESSION_MIDDLEWARE = "django.contrib.sessions.middleware.SessionMiddleware"


class SessionMiddlewareOrderTests:
    """Listed after IdempotencyMiddleware, SessionMiddleware would start sessions too late."""

    @staticmethod
    def post_as(client: Client) -> Any:
        return client.post(
            "/isolation/plain/",
            BODY,
            content_type="application/json",
            headers={"Idempotency-Key": "shared"},
        )

    def test_after_ours_is_e006_and_the_handler_refuses_to_load(self, settings: Any) -> None:
        from django.core.exceptions import ImproperlyConfigured

        from django_idempotency.checks import check_middleware_order

        settings.MIDDLEWARE = [MIDDLEWARE, SESSION_MIDDLEWARE]
        [error] = check_middleware_order()
        assert error.id == "django_idempotency.E006"
        assert error.msg == f"{MIDDLEWARE!r} must come after {SESSION_MIDDLEWARE!r} in MIDDLEWARE."
        assert "before Django knows the session" in error.hint

        with pytest.raises(ImproperlyConfigured, match="must come after"):
            self.post_as(Client(raise_request_exception=False))
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_refused_without_the_sessions_app_too(self, settings: Any) -> None:
        # Signed-cookie sessions need no app: the middleware works without it.
        from django_idempotency.middleware import misplaced

        settings.INSTALLED_APPS = [
            app for app in settings.INSTALLED_APPS if app != "django.contrib.sessions"
        ]
        settings.SESSION_ENGINE = "django.contrib.sessions.backends.signed_cookies"
        settings.MIDDLEWARE = [MIDDLEWARE, SESSION_MIDDLEWARE]

        problem = misplaced()

        assert problem is not None
        assert problem[0] == f"{MIDDLEWARE!r} must come after {SESSION_MIDDLEWARE!r} in MIDDLEWARE."

    def test_before_ours_each_guest_gets_their_own_answer(self, settings: Any) -> None:
        settings.MIDDLEWARE = [SESSION_MIDDLEWARE, MIDDLEWARE]
        alice, bob = Client(), Client()
        for client, name in ((alice, "alice"), (bob, "bob")):
            for cookie, value in anonymous_with_session(name).cookies.items():
                client.cookies[cookie] = value

        first = self.post_as(alice)
        other = self.post_as(bob)
        retry = self.post_as(alice)

        assert "Idempotent-Replayed" not in other
        assert other.content != first.content
        assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
        assert Order.objects.count() == 2
        assert all(scope.startswith("session:") for scope in records("shared"))


# Calls: functions and tasks. Their caller is the protected function or task
# itself (its scope its dotted name, or the scope= it was given): two of each
# kind, given one key, and a function and a task given one key.


@dataclass(frozen=True)
class Callee:
    """One protected function or task, and how it is called."""

    #: "call", "async" (awaited), "celery" (published to a real worker),
    #: "enqueue" (Django's Tasks framework, ImmediateBackend), "task_call", "task_acall".
    how: str
    #: Its name in tests.isolation_calls (tests.tasks for Celery's).
    name: str
    #: The scope it was given; ``None``: its dotted name.
    scope: str | None = None

    def expected_key(self, key: str) -> str:
        """The key its function makes of the argument (Celery's tasks here: ``order-<label>``)."""
        return f"order-{key}" if self.how == "celery" else key

    def target(self) -> Any:
        if self.how == "celery":
            from tests import tasks

            return getattr(tasks, self.name)
        from tests import isolation_calls

        return getattr(isolation_calls, self.name)

    def expected_scope(self) -> str:
        """SPEC 8: the scope given, or the function's dotted name (a Celery task's name)."""
        target = self.target()
        if self.scope is not None:
            return self.scope
        if self.how == "celery":
            return str(target.name)
        if self.how in ("enqueue", "task_call", "task_acall"):
            return str(target.module_path)
        return f"{target.__module__}.{target.__qualname__}"

    def call(self, key: str) -> Any:
        target = self.target()
        if self.how == "call":
            return target(key)
        if self.how == "async":
            return async_to_sync(target)(key)
        if self.how == "celery":
            return target.delay(key).get(timeout=REQUEST_TIMEOUT)
        if self.how == "enqueue":
            result = target.enqueue(key)
            assert result.status.name == "SUCCESSFUL", result.errors
            return result.return_value
        if self.how == "task_call":
            return target.call(key)
        assert self.how == "task_acall", self.how
        return async_to_sync(target.acall)(key)


CALL_ROWS = [
    pytest.param(Callee("call", "alice_function"), Callee("call", "bob_function"), id="function"),
    pytest.param(
        Callee("call", "acme_function", "tenant:Acme"),
        Callee("call", "other_acme_function", "tenant:acme"),
        id="function_scopes_differing_in_case",
    ),
    pytest.param(
        Callee("async", "alice_async_function"),
        Callee("async", "bob_async_function"),
        id="async_function",
    ),
    pytest.param(
        Callee("celery", "place_order"), Callee("celery", "place_other_order"), id="celery_task"
    ),
    pytest.param(
        Callee("enqueue", "alice_task"), Callee("enqueue", "bob_task"), id="django_task_enqueue"
    ),
    pytest.param(
        Callee("enqueue", "alice_async_task"),
        Callee("enqueue", "bob_async_task"),
        id="django_async_task_enqueue",
    ),
    pytest.param(
        Callee("task_call", "alice_task"), Callee("task_call", "bob_task"), id="django_task_call"
    ),
    pytest.param(
        Callee("task_acall", "alice_async_task"),
        Callee("task_acall", "bob_async_task"),
        id="django_task_acall",
    ),
    pytest.param(
        Callee("call", "alice_function"), Callee("enqueue", "bob_task"), id="function_and_task"
    ),
    pytest.param(
        Callee("celery", "place_order"), Callee("call", "bob_function"), id="celery_and_function"
    ),
]


@pytest.fixture(scope="module")
def isolation_worker(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A real Celery worker on the test database, for the rows of Celery's tasks."""
    from tests.celery_worker import running_worker

    directory = tmp_path_factory.mktemp("isolation-worker")
    with running_worker(directory, pool="solo", concurrency=1) as worker:
        yield worker


@pytest.mark.parametrize(("alice", "bob"), CALL_ROWS)
def test_isolation_of_calls(
    alice: Callee, bob: Callee, request: pytest.FixtureRequest, settings: Any
) -> None:
    settings.TASKS = {"default": {"BACKEND": IMMEDIATE_TASKS}}
    if "celery" in (alice.how, bob.how):
        request.getfixturevalue("isolation_worker")
    key = f"iso-{uuid.uuid4().hex[:12]}"

    first = alice.call(key)
    other = bob.call(key)
    retry = alice.call(key)

    orders = list(Order.objects.order_by("pk").values_list("pk", flat=True))
    assert len(orders) == 2, f"{len(orders)} effects, not one per caller"
    assert other != first, f"bob got alice's value: {other}"
    assert retry == first, f"alice's retry got {retry}, not her value {first}"
    assert first["order"] == orders[0] and other["order"] == orders[1]
    scopes = [alice.expected_scope(), bob.expected_scope()]
    assert scopes[0] != scopes[1]
    stored = sorted(IdempotencyKey.objects.values_list("scope", "key"))
    expected = [(scopes[0], alice.expected_key(key)), (scopes[1], bob.expected_key(key))]
    assert stored == sorted(expected), stored
