"""Django's ASGI application, telling the endings table when a client went away.

When the server hands Django ``http.disconnect`` for a request, this writes
``<key>.disconnected`` in the control directory, before Django acts on it
(cancelling the view). A test then knows the disconnect has reached the
application, whatever the protocol does with it.
"""

from __future__ import annotations

from typing import Any

from django.core.asgi import get_asgi_application

#: The header a form's cell names its key in, for this report only (the package never reads it).
CELL_HEADER = b"x-endings-cell"


def application() -> Any:
    """The factory uvicorn calls (``--factory``)."""
    django_application = get_asgi_application()
    from tests.endings_effects import report  # once Django is set up

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers", []))
        # A browser's form has its key in the body: its cell names it in a header of the tests'.
        key = headers.get(b"idempotency-key") or headers.get(CELL_HEADER)

        async def watched_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and key is not None:
                report(f"{key.decode()}.disconnected")
            return message

        await django_application(scope, watched_receive, send)

    return app
