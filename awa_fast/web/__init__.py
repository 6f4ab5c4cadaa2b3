"""``awa-fast serve``: the web dashboard and its JSON API (extra ``awa-fast[web]``).

Starlette for routing, Jinja2 templates (auto-escaped: job args are shown
as text, never as markup), one small script for the live charts, served by
uvicorn. Pages: overview, queues, jobs (list and detail), DLQ, periodic
schedules, runtime, storage. Every page has a JSON twin under ``/api``. Access rules are in
:mod:`awa_fast.web.security`: reads are open on the bound address (loopback
by default), every action needs the admin token, browsers also a CSRF value,
and ``read_only`` hides and refuses every action.
"""

from __future__ import annotations

import pathlib
import urllib.parse
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

try:
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, RedirectResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
    from starlette.templating import Jinja2Templates
except ImportError as exc:  # pragma: no cover - exercised by the extra's absence
    raise ImportError("the awa-fast dashboard needs its extra: pip install 'awa-fast[web]'") from exc

from awa_fast.web.backend import Backend, jsonable
from awa_fast.web.security import SESSION_COOKIE, Guard

JOB_STATES = ("available", "running", "waiting", "scheduled", "retryable", "completed", "failed", "cancelled", "dlq")
MAX_LIMIT = 1000

_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes browsers send Origin: null on form posts
    "Cache-Control": "no-store",
}


class Forbidden(Exception):
    """An action refused: read-only, missing token, bad CSRF value or a foreign Origin."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


def create_app(backend: Backend, *, token: str, read_only: bool = False) -> Starlette:
    """The dashboard as an ASGI application over ``backend``."""
    here = resources.files("awa_fast.web")
    templates = Jinja2Templates(directory=str(pathlib.Path(str(here)) / "templates"))
    guard = Guard(token)

    def page(request: Request, name: str, **ctx: Any) -> Response:
        cookie = request.cookies.get(SESSION_COOKIE)
        ctx.update(read_only=read_only, signed_in=guard.session_ok(cookie), csrf=guard.csrf_for(cookie),
                   schema=backend.storage.schema, msg=request.query_params.get("msg", ""), path=request.url.path)
        return _secure(templates.TemplateResponse(request, name, ctx))

    async def form_of(request: Request) -> dict[str, str]:
        body = (await request.body()).decode("utf-8", "replace")
        return {k: v[-1] for k, v in urllib.parse.parse_qs(body, keep_blank_values=True).items()}

    def authorize(request: Request, form: dict[str, str]) -> None:
        if read_only:
            raise Forbidden(403, "this dashboard is read-only (started with --read-only)")
        origin = request.headers.get("origin")
        if origin and origin != "null":
            o = urllib.parse.urlsplit(origin)
            if o.netloc != request.headers.get("host"):
                raise Forbidden(403, "cross-site request refused")
        elif origin == "null":
            raise Forbidden(403, "cross-site request refused")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            if guard.token_ok(auth[7:]):
                return
            raise Forbidden(401, "wrong admin token")
        cookie = request.cookies.get(SESSION_COOKIE)
        if not guard.session_ok(cookie):
            raise Forbidden(401, "sign in with the admin token first (see --token-file)")
        if not guard.csrf_ok(cookie, form.get("csrf") or request.headers.get("x-csrf-token")):
            raise Forbidden(403, "missing or wrong CSRF value; reload the page and try again")

    def action(
        fn: Callable[[Request, dict[str, str]], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            form = await form_of(request)
            try:
                authorize(request, form)
            except Forbidden as exc:
                if request.url.path.startswith("/api/"):
                    return _secure(JSONResponse({"error": exc.message}, status_code=exc.status))
                return _secure(Response(exc.message + "\n", status_code=exc.status, media_type="text/plain"))
            return await fn(request, form)
        return endpoint

    def back(to: str, msg: str) -> Response:
        return _secure(RedirectResponse(f"{to}?{urllib.parse.urlencode({'msg': msg})}", status_code=303))

    # -- pages ---------------------------------------------------------------------

    async def overview(request: Request) -> Response:
        return page(request, "overview.html", data=await run_in_threadpool(backend.overview))

    async def queues(request: Request) -> Response:
        return page(request, "queues.html", queues=await run_in_threadpool(backend.queues))

    async def jobs(request: Request) -> Response:
        f = _job_filters(request)
        found = await run_in_threadpool(lambda: backend.jobs(**f))
        return page(request, "jobs.html", jobs=found, filters=f, states=JOB_STATES,
                    next_before=found[-1]["job_id"] if len(found) == f["limit"] and found else None)

    async def job(request: Request) -> Response:
        info = await run_in_threadpool(backend.job, int(request.path_params["job_id"]))
        if info is None:
            return page(request, "missing.html", job_id=request.path_params["job_id"])
        return page(request, "job.html", job=info)

    async def dlq(request: Request) -> Response:
        queue = request.query_params.get("queue") or None
        return page(request, "dlq.html", entries=await run_in_threadpool(lambda: backend.dlq(queue=queue, limit=200)),
                    queue=queue or "")

    async def periodic(request: Request) -> Response:
        return page(request, "periodic.html", schedules=await run_in_threadpool(backend.schedules))

    async def runtime(request: Request) -> Response:
        return page(request, "runtime.html", data=await run_in_threadpool(backend.runtime))

    async def storage(request: Request) -> Response:
        return page(request, "storage.html", data=await run_in_threadpool(backend.rings))

    async def login_form(request: Request) -> Response:
        return page(request, "login.html")

    async def login(request: Request) -> Response:
        form = await form_of(request)
        if read_only:
            return back("/", "read-only: there is nothing to sign in for")
        if not guard.token_ok(form.get("token")):
            return _secure(Response("wrong admin token\n", status_code=401, media_type="text/plain"))
        resp = back("/", "signed in")
        resp.set_cookie(SESSION_COOKIE, guard.new_session(), httponly=True, samesite="strict", path="/")
        return resp

    async def logout(request: Request) -> Response:
        resp = back("/", "signed out")
        resp.delete_cookie(SESSION_COOKIE, path="/")
        return resp

    # -- actions -------------------------------------------------------------------

    @action
    async def job_cancel(request: Request, form: dict[str, str]) -> Response:
        job_id = int(request.path_params["job_id"])
        ok = await run_in_threadpool(backend.cancel, job_id)
        if request.url.path.startswith("/api/"):
            return _secure(JSONResponse({"job_id": job_id, "cancelled": ok}))
        return back(f"/jobs/{job_id}", "cancelled" if ok else "not cancelled: the job is already terminal")

    @action
    async def job_retry(request: Request, form: dict[str, str]) -> Response:
        job_id = int(request.path_params["job_id"])
        ok = await run_in_threadpool(backend.retry, job_id)
        if request.url.path.startswith("/api/"):
            return _secure(JSONResponse({"job_id": job_id, "retried": ok}))
        return back(f"/jobs/{job_id}", "queued to run again" if ok else "not retried: nothing to retry")

    @action
    async def dlq_retry(request: Request, form: dict[str, str]) -> Response:
        ids, queue = _ids_and_queue(form)
        n = await run_in_threadpool(backend.dlq_retry, ids, queue)
        if request.url.path.startswith("/api/"):
            return _secure(JSONResponse({"retried": n}))
        return back("/dlq", f"{n} DLQ job(s) queued to run again")

    @action
    async def dlq_purge(request: Request, form: dict[str, str]) -> Response:
        ids, queue = _ids_and_queue(form)
        api = request.url.path.startswith("/api/")
        if not api and form.get("confirm") != "yes":
            entries = await run_in_threadpool(lambda: backend.dlq(queue=queue, limit=MAX_LIMIT))
            if ids is not None:
                entries = [e for e in entries if e.get("job_id") in ids]
            return page(request, "purge_confirm.html", entries=entries, ids=form.get("job_ids", ""),
                        queue=queue or "")
        n = await run_in_threadpool(backend.dlq_purge, ids, queue)
        if api:
            return _secure(JSONResponse({"purged": n}))
        return back("/dlq", f"{n} DLQ job(s) purged")

    @action
    async def queue_pause(request: Request, form: dict[str, str]) -> Response:
        name = request.path_params["queue"]
        paused = request.path_params["verb"] == "pause"
        ok = await run_in_threadpool(backend.pause, name, paused)
        if request.url.path.startswith("/api/"):
            return _secure(JSONResponse({"queue": name, "paused": paused, "ok": ok}))
        return back("/queues", f"queue {name} {'paused' if paused else 'resumed'}")

    @action
    async def schedule_action(request: Request, form: dict[str, str]) -> Response:
        name, verb = request.path_params["name"], request.path_params["verb"]
        api = request.url.path.startswith("/api/")
        if verb in ("pause", "resume"):
            ok = await run_in_threadpool(backend.schedule_pause, name, verb == "pause")
            result: dict[str, Any] = {"name": name, "paused": verb == "pause", "ok": ok}
            text = f"schedule {name} {'paused' if verb == 'pause' else 'resumed'}"
        elif verb == "trigger":
            outcome, job_id = await run_in_threadpool(backend.schedule_trigger, name)
            ok = outcome != "inactive"
            result = {"name": name, "outcome": outcome, "job_id": job_id, "ok": ok}
            text = (f"schedule {name}: enqueued job {job_id}" if outcome == "fired"
                    else f"schedule {name}: {outcome}" + (f" (job {job_id} holds its unique key)" if job_id else ""))
        else:
            msg = f"unknown action {verb!r}: use pause, resume or trigger"
            if api:
                return _secure(JSONResponse({"error": msg}, status_code=404))
            return _secure(Response(msg + "\n", status_code=404, media_type="text/plain"))
        if not ok:
            text = f"no schedule {name!r}"
        if api:
            return _secure(JSONResponse(result, status_code=200 if ok else 404))
        return back("/periodic", text)

    # -- JSON twins ------------------------------------------------------------------

    def api(fn: Callable[[Request], Any]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return _secure(JSONResponse(jsonable(await run_in_threadpool(fn, request))))
        return endpoint

    def api_job(request: Request) -> Any:
        info = backend.job(int(request.path_params["job_id"]))
        return info if info is not None else {"error": "no such job (never existed or its history was pruned)"}

    routes = [
        Route("/", overview), Route("/queues", queues), Route("/jobs", jobs),
        Route("/jobs/{job_id:int}", job), Route("/dlq", dlq), Route("/periodic", periodic), Route("/runtime", runtime),
        Route("/storage", storage),
        Route("/login", login_form, methods=["GET"]), Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/jobs/{job_id:int}/cancel", job_cancel, methods=["POST"]),
        Route("/jobs/{job_id:int}/retry", job_retry, methods=["POST"]),
        Route("/dlq/retry", dlq_retry, methods=["POST"]), Route("/dlq/purge", dlq_purge, methods=["POST"]),
        Route("/queues/{queue}/{verb:str}", queue_pause, methods=["POST"]),
        Route("/periodic/{name}/{verb:str}", schedule_action, methods=["POST"]),
        Route("/api/overview", api(lambda r: backend.overview())),
        Route("/api/queues", api(lambda r: backend.queues())),
        Route("/api/jobs", api(lambda r: backend.jobs(**_job_filters(r)))),
        Route("/api/jobs/{job_id:int}", api(api_job)),
        Route("/api/dlq", api(lambda r: backend.dlq(queue=r.query_params.get("queue") or None,
                                                    limit=_limit(r)))),
        Route("/api/periodic", api(lambda r: backend.schedules())),
        Route("/api/periodic/{name}/{verb:str}", schedule_action, methods=["POST"]),
        Route("/api/runtime", api(lambda r: backend.runtime())),
        Route("/api/storage", api(lambda r: backend.rings())),
        Route("/api/jobs/{job_id:int}/cancel", job_cancel, methods=["POST"]),
        Route("/api/jobs/{job_id:int}/retry", job_retry, methods=["POST"]),
        Route("/api/dlq/retry", dlq_retry, methods=["POST"]), Route("/api/dlq/purge", dlq_purge, methods=["POST"]),
        Route("/api/queues/{queue}/{verb:str}", queue_pause, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(pathlib.Path(str(here)) / "static")), name="static"),
    ]
    return Starlette(routes=routes)


def _secure(resp: Response) -> Response:
    for k, v in _HEADERS.items():
        resp.headers.setdefault(k, v)
    return resp


def _limit(request: Request) -> int:
    try:
        n = int(request.query_params.get("limit", "100"))
    except ValueError:
        n = 100
    return max(1, min(n, MAX_LIMIT))


def _job_filters(request: Request) -> dict[str, Any]:
    qp = request.query_params
    state = qp.get("state") or None
    before = qp.get("before_id")
    return {"queue": qp.get("queue") or None, "kind": qp.get("kind") or None,
            "state": state if state in JOB_STATES else None, "limit": _limit(request),
            "before_id": int(before) if before and before.isdigit() else None}


def _ids_and_queue(form: dict[str, str]) -> tuple[list[int] | None, str | None]:
    raw = form.get("job_ids", "").replace(",", " ").split()
    ids = [int(x) for x in raw if x.isdigit()] or None
    return ids, form.get("queue") or None


def serve(backend: Backend, *, host: str, port: int, token: str, read_only: bool = False) -> None:
    """Run the dashboard with uvicorn until interrupted."""
    import uvicorn

    backend.start()
    try:
        uvicorn.run(create_app(backend, token=token, read_only=read_only), host=host, port=port,
                    log_level="warning", log_config=None,  # uvicorn's lines go through the CLI's handler
                    server_header=False, proxy_headers=False)
    finally:
        backend.close()
