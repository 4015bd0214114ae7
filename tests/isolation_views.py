"""The views of the isolation table (``tests/test_isolation.py``): one handler under every adapter.

Every view runs the same handler: it finds out who the caller is, writes
one ``Order`` named after the key and the caller (the effect, counted by
the test), and answers ``{"caller", "via", "order", "pid"}``, so that the
test can tell whose answer a client received. ``via`` says how the caller
was known:

- ``user``: ``request.user``, authenticated by Django (the session) or by
  DRF (a token, a bearer JWT, the session);
- ``view``: the view checked the ``Authorization`` header itself (an API key,
  or a DRF token or JWT sent to a view that DRF does not authenticate);
- ``session``: an anonymous caller's own session, which names it (a
  browser posting a form with its key in a field, too);
- ``nobody``: no credentials at all.

``BearerJWTAuthentication`` is a minimal HS256 bearer authentication for
DRF, written here so that the suite needs no JWT library.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from typing import Any

from adrf.views import APIView as AsyncAPIView
from adrf.viewsets import ViewSet as AsyncViewSet
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.sessions.backends.db import SessionStore
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.authentication import (
    BaseAuthentication,
    SessionAuthentication,
    TokenAuthentication,
    get_authorization_header,
)
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from django_idempotency import idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order

#: The API keys the views check themselves (``Authorization: Api-Key <key>``).
API_KEYS = {"ak-alice-0f3c9d": "alice", "ak-bob-77e1a2": "bob"}
#: The session entry that names an anonymous caller with a session of its own.
SESSION_CALLER = "isolation_caller"


# A bearer JWT (HS256), signed with SECRET_KEY, whose ``sub`` is a username.


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(signing_input: str) -> bytes:
    secret = settings.SECRET_KEY.encode()
    return hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()


def encode_jwt(claims: dict[str, Any]) -> str:
    header = _b64encode(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    signing_input = f"{header}.{_b64encode(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64encode(_signature(signing_input))}"


def decode_jwt(token: str) -> dict[str, Any] | None:
    """The claims of a token signed with SECRET_KEY, or ``None``."""
    try:
        header, claims, signature = token.split(".")
        if json.loads(_b64decode(header)).get("alg") != "HS256":
            return None
        if not hmac.compare_digest(_b64decode(signature), _signature(f"{header}.{claims}")):
            return None
        decoded: dict[str, Any] = json.loads(_b64decode(claims))
    except ValueError:
        return None
    return decoded


class BearerJWTAuthentication(BaseAuthentication):
    """``Authorization: Bearer <jwt>``, as djangorestframework-simplejwt authenticates."""

    def authenticate(self, request: Request) -> tuple[User, dict[str, Any]] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"bearer":
            return None
        claims = decode_jwt(parts[1].decode()) if len(parts) == 2 else None
        if claims is None:
            raise AuthenticationFailed("Invalid bearer token.")
        try:
            return User.objects.get(username=claims.get("sub")), claims
        except User.DoesNotExist:
            raise AuthenticationFailed("No such user.") from None

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


#: API keys that DRF authenticates from a header of their own (``X-Api-Key``).
#: Neither Django nor the scope knows that header: two such callers have
#: scopes of their own only once DRF has authenticated them.
HEADER_API_KEYS = {"hk-alice-5b1e7c": "alice", "hk-bob-c40d93": "bob"}


class HeaderApiKeyAuthentication(BaseAuthentication):
    """``X-Api-Key: <key>``, an API key in a header of its own, as many APIs take it."""

    def authenticate(self, request: Request) -> tuple[User, str] | None:
        key = request.headers.get("X-Api-Key")
        if key is None:
            return None
        name = HEADER_API_KEYS.get(key)
        if name is None:
            raise AuthenticationFailed("Invalid API key.")
        try:
            return User.objects.get(username=name), key
        except User.DoesNotExist:
            raise AuthenticationFailed("No such user.") from None


#: How the DRF views authenticate: tokens, bearer JWTs, header API keys and the session.
AUTHENTICATION = [
    TokenAuthentication,
    BearerJWTAuthentication,
    HeaderApiKeyAuthentication,
    SessionAuthentication,
]


# Who the caller is, as the handler finds out.


def _checked_by_the_view(authorization: str) -> str | None:
    """The caller an ``Authorization`` header names, checked as a view would check it."""
    scheme, _, credential = authorization.partition(" ")
    if scheme == "Api-Key":
        return API_KEYS.get(credential)
    if scheme == "Token":
        token = Token.objects.select_related("user").filter(key=credential).first()
        return token.user.username if token is not None else None
    if scheme == "Bearer":
        claims = decode_jwt(credential)
        return str(claims["sub"]) if claims is not None else None
    return None


def identify(request: HttpRequest) -> tuple[str, str] | None:
    """``(caller, via)``, or ``None`` for credentials that name nobody."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return user.username, "user"
    authorization = request.headers.get("Authorization")
    if authorization:
        caller = _checked_by_the_view(authorization)
        return (caller, "view") if caller is not None else None
    named = request.session.get(SESSION_CALLER) if hasattr(request, "session") else None
    if named:
        return named, "session"
    return "anonymous", "nobody"


def answer(request: HttpRequest) -> tuple[dict[str, Any], int]:
    """The handler: the effect and the answer, or 401 for credentials that name nobody."""
    caller = identify(request)
    if caller is None:
        return {"detail": "unknown credentials"}, 401
    name, via = caller
    # A browser's form sends its key in a field (SPEC 9), anyone else in the header.
    key = request.headers.get("Idempotency-Key") or request.POST["idempotency_key"]
    order = Order.objects.create(item=f"{key}|{name}")
    return {"caller": name, "via": via, "order": order.pk, "pid": os.getpid()}, 201


def plain(request: HttpRequest) -> HttpResponseBase:
    data, status = answer(request)
    return JsonResponse(data, status=status)


async def aplain(request: HttpRequest) -> HttpResponseBase:
    data, status = await sync_to_async(answer)(request)
    return JsonResponse(data, status=status)


def drf(request: Request) -> HttpResponseBase:
    data, status = answer(request)
    return Response(data, status=status)


async def adrf(request: Request) -> HttpResponseBase:
    data, status = await sync_to_async(answer)(request)
    return Response(data, status=status)


# The views that protect themselves: a row of the table each.


@idempotent
def function_view(request: HttpRequest) -> HttpResponseBase:
    return plain(request)


class ClassBasedView(View):
    @method_decorator(idempotent)
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return plain(request)


@idempotent
async def async_function_view(request: HttpRequest) -> HttpResponseBase:
    return await aplain(request)


class AsyncClassBasedView(View):
    @method_decorator(idempotent)
    async def post(self, request: HttpRequest) -> HttpResponseBase:
        return await aplain(request)


@method_decorator(idempotent, name="dispatch")
class AsyncDispatchDecoratedView(View):
    """``@idempotent`` on an async view's ``dispatch``, which returns the handler's coroutine."""

    async def post(self, request: HttpRequest) -> HttpResponseBase:
        return await aplain(request)


@api_view(["POST"])
@authentication_classes(AUTHENTICATION)
@permission_classes([AllowAny])
@idempotent
def api_view_function(request: Request) -> HttpResponseBase:
    return drf(request)


class _Open:
    """DRF's authentication, and every caller allowed: the handler tells them apart."""

    authentication_classes = AUTHENTICATION
    permission_classes = [AllowAny]


class MixinAPIView(IdempotentMixin, _Open, APIView):
    def post(self, request: Request) -> HttpResponseBase:
        return drf(request)


class MethodDecoratedAPIView(_Open, APIView):
    """``@idempotent`` on a DRF handler: it receives DRF's request, after authentication."""

    @method_decorator(idempotent)
    def post(self, request: Request) -> HttpResponseBase:
        return drf(request)


@method_decorator(idempotent, name="dispatch")
class DispatchDecoratedAPIView(_Open, APIView):
    """``@idempotent`` on a DRF view's ``dispatch``: the handler, protected after DRF's auth."""

    def post(self, request: Request) -> HttpResponseBase:
        return drf(request)


class DispatchDecoratedSubclassAPIView(DispatchDecoratedAPIView):
    """A subclass with a ``dispatch`` of its own, calling the decorated one (a logging mixin's)."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        return super().dispatch(request, *args, **kwargs)


@method_decorator(idempotent, name="dispatch")
class DispatchDecoratedAdrfAPIView(_Open, AsyncAPIView):
    """The same on an adrf view, whose ``dispatch`` returns a coroutine."""

    async def post(self, request: Request) -> HttpResponseBase:
        return await adrf(request)


class MixinViewSet(IdempotentMixin, _Open, ViewSet):
    def create(self, request: Request) -> HttpResponseBase:
        return drf(request)


class SessionOnTheDrfRequestAPIView(IdempotentMixin, _Open, APIView):
    """A project that keeps the caller's session on DRF's request itself, not on Django's.

    As a session of the project's own for anonymous callers would be: here
    the one Django loaded from the cookie moves to DRF's request once DRF
    has authenticated the caller, and Django's request keeps an empty one.
    The scope is taken after this, when the handler runs.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        django_request = request._request
        request.session = django_request.session
        django_request.session = SessionStore()

    def post(self, request: Request) -> HttpResponseBase:
        return drf(request)


class AdrfMixinAPIView(IdempotentMixin, _Open, AsyncAPIView):
    async def post(self, request: Request) -> HttpResponseBase:
        return await adrf(request)


# Views that protect nothing themselves, for IdempotencyMiddleware's rows.


def plain_view(request: HttpRequest) -> HttpResponseBase:
    return plain(request)


async def async_plain_view(request: HttpRequest) -> HttpResponseBase:
    return await aplain(request)


@api_view(["POST"])
@authentication_classes(AUTHENTICATION)
@permission_classes([AllowAny])
def plain_api_view(request: Request) -> HttpResponseBase:
    return drf(request)


class PlainAPIView(_Open, APIView):
    def post(self, request: Request) -> HttpResponseBase:
        return drf(request)


class PlainViewSet(_Open, ViewSet):
    def create(self, request: Request) -> HttpResponseBase:
        return drf(request)


class PlainAdrfAPIView(_Open, AsyncAPIView):
    async def post(self, request: Request) -> HttpResponseBase:
        return await adrf(request)


class PlainAdrfViewSet(_Open, AsyncViewSet):
    async def create(self, request: Request) -> HttpResponseBase:
        return await adrf(request)
