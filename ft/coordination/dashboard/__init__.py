"""The lighthouse dashboard: one self-contained HTML page (no CDN, no outside fetch).

The page polls ``/api/status`` every second and renders the current quorum, why the next one
is or is not ready, heartbeat ages (dead members marked), and a kill button per member.
Its kill requests carry the header ``X-FT-Request: 1`` and a JSON body, without which the
lighthouse refuses them (a page of another site cannot send that header). Where the dashboard
needs a credential, the page signs in with the login ticket of a login link (its fragment,
``#login=<ticket>``: ``python -m ft.utils.dashboard_login``), or asks for one, and the session
then rests on an HttpOnly cookie; the page never holds the job secret. The server:
:mod:`ft.coordination.dashboard.server`.
"""

from pathlib import Path

_PAGE = Path(__file__).with_name("index.html")


def page_html() -> str:
    return _PAGE.read_text(encoding="utf-8")
