"""Open ``adaptdist train --trace``'s ``trace.json`` in real trace viewers in headless Chromium and save screenshots
(issue 15 point 6). Outside CI: it needs Debian's ``chromium`` and, for the speedscope check, speedscope's static
build (``npm pack speedscope@1.25.0`` and untar it; its ``package/dist/release`` is ``--speedscope``).

    python benchmarks/check_trace_viewer.py RUN/trace.json --speedscope DIR --out DIR

Two viewers:

1. chrome://tracing. Recent Chromium redirects internal debug pages to chrome://debug-webuis-disabled unless the
   Local State pref ``internal_only_uis_enabled`` is true (what chrome://chrome-urls' "Enable internal debugging
   pages" button sets); the script writes that pref into a fresh ``--user-data-dir``. If the page then loads, the
   trace goes in through its Load button's file chooser (CDP ``Page.setInterceptFileChooserDialog`` and
   ``DOM.setFileInputFiles``) and a screenshot is taken. Debian's chromium (``disable/catapult.patch``) ships without
   the trace viewer: with the pref set chrome://tracing is no longer redirected but fails with ERR_FAILED; the script
   reports that and goes on (that loading path has not run here).
2. speedscope (an independent web viewer with a Trace Event Format importer, served from 127.0.0.1). The script
   loads the trace with ``#profileURL=``, records the browser console (speedscope logs every slice it cannot nest:
   "Tried to end X when Y was on the top of the stack", "Frame X was still open at end of profile"), checks that it
   lists one profile per (pid, tid) that has complete events, named from our ``process_name``/``thread_name``
   metadata, and saves one screenshot per profile (``n`` steps to the next one).

Perfetto's UI and trace_processor are not available offline here (the ``perfetto`` wheel downloads
trace_processor_shell at run time). Exit status 1 when a check fails. Chromium is driven over
``--remote-debugging-pipe`` (CDP on file descriptors 3 and 4), so only the standard library is needed.
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
from pathlib import Path

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--no-first-run", "--no-default-browser-check",
                  "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--window-size=1600,1000")


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


def check_chrome_tracing(chromium: str, trace: Path, work: Path, out: Path) -> dict:
    b = Browser(chromium, fresh_profile(work, "tracing"), work / "tracing.log")
    try:
        b.page("Page.navigate", {"url": "chrome://tracing"})
        b.pump(3)
        where = b.js("location.href + ' | ' + document.title + ' | ' + document.body.innerText.slice(0, 200)")
        if not where.startswith("chrome://tracing"):
            return {"viewer": "chrome://tracing", "ok": None, "opened": False, "page": where.replace("\n", " ")}
        b.page("Page.setInterceptFileChooserDialog", {"enabled": True})
        if not b.js(WALK_JS):
            return {"viewer": "chrome://tracing", "ok": False, "opened": True, "page": where, "error": "no Load button"}
        chooser = b.wait_event("Page.fileChooserOpened")
        b.page("DOM.setFileInputFiles", {"files": [str(trace)], "backendNodeId": chooser["params"]["backendNodeId"]})
        b.pump(5)
        shot = out / "chrome_tracing.png"
        b.screenshot(shot)
        errors = [c for c in b.console() if c[0] in ("error", "exception")]
        return {"viewer": "chrome://tracing", "ok": not errors, "opened": True, "screenshot": str(shot),
                "errors": errors}
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


def expected_profiles(doc: dict) -> list[str]:
    """speedscope's profile names for our trace: one per (pid, tid) with complete events,
    ``"<process_name> (pid P), <thread_name> (tid T)"``."""
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
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
        return {"viewer": "speedscope", "ok": ok, "unnamed_tracks": unnamed, "profiles_expected": want, "profiles_seen": seen,
                "screenshots": shots, "unnested_slices": unnested[:10], "n_unnested": len(unnested),
                "errors": errors, "imported_as": [t for _, t in console if t.startswith("Importing as")]}
    finally:
        b.close()
        srv.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="trace.json written by adaptdist train --trace")
    ap.add_argument("--speedscope", type=Path, help="speedscope's dist/release folder (npm pack speedscope)")
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
    (args.out / "result.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if all(r["ok"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
