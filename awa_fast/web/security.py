"""The dashboard's access rules: an admin token for every action, CSRF for browsers.

- Reads (pages and ``GET /api/...``) are open to whoever can reach the
  address, which is loopback unless ``--bind`` says otherwise.
- Every state-changing request (``POST``) needs the admin token: API clients
  send ``Authorization: Bearer <token>``; a browser signs in once at
  ``/login`` and gets an HttpOnly, SameSite=Strict session cookie, and each
  form also carries a CSRF value bound to that session. A cross-site form
  post has neither, and a request whose ``Origin`` is another site is
  refused outright.
- The token lives in a file created 0600 on first start (``--token-file``,
  default ``$AWA_FAST_HOME/dashboard.token``), opened without following
  symlinks and refused when another user can read or write it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import secrets
import stat

from awa_fast.errors import ConfigError

SESSION_COOKIE = "awa_fast_session"


def load_or_create_token(path: pathlib.Path) -> str:
    """The admin token in ``path``; created (0600, 32 random bytes) when the file does not exist."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        token = secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:  # another process made it first: read theirs
            return load_or_create_token(path)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    except OSError as exc:
        raise ConfigError(f"cannot open the dashboard token file {path} ({exc.strerror}); "
                          "it must be a regular file, not a symlink") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the dashboard token file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"the dashboard token file {path} belongs to uid {st.st_uid}, not to you; "
                              "remove it or pass --token-file")
        if st.st_mode & 0o077:
            raise ConfigError(f"the dashboard token file {path} is readable or writable by others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        token = f.read().strip()
    if len(token) < 16:
        raise ConfigError(f"the dashboard token in {path} is shorter than 16 characters; "
                          "delete the file to have a new one generated")
    return token


class Guard:
    """Checks tokens, session cookies and CSRF values for one dashboard instance."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def _mac(self, purpose: str) -> str:
        return hmac.new(self._token, purpose.encode(), hashlib.sha256).hexdigest()

    def token_ok(self, candidate: str | None) -> bool:
        """True when ``candidate`` is the admin token (constant-time)."""
        return candidate is not None and hmac.compare_digest(candidate.strip().encode(), self._token)

    def new_session(self) -> str:
        """A fresh session id, signed: ``<random>.<mac>``."""
        sid = secrets.token_urlsafe(18)
        return f"{sid}.{self._mac('session:' + sid)}"

    def session_ok(self, cookie: str | None) -> bool:
        """True for a session cookie this dashboard signed."""
        if not cookie or "." not in cookie:
            return False
        sid, mac = cookie.rsplit(".", 1)
        return hmac.compare_digest(mac, self._mac("session:" + sid))

    def csrf_for(self, cookie: str | None) -> str:
        """The CSRF value forms must carry in this session ('' without a session)."""
        if not self.session_ok(cookie):
            return ""
        return self._mac("csrf:" + str(cookie))

    def csrf_ok(self, cookie: str | None, value: str | None) -> bool:
        """True when ``value`` is this session's CSRF value."""
        expected = self.csrf_for(cookie)
        return bool(expected) and value is not None and hmac.compare_digest(expected, value)
