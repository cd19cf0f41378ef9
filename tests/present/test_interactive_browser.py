r"""The interactive HTML report in a real headless Chromium, driven over the DevTools protocol.

Pure standard library: a minimal WebSocket client (RFC 6455, text frames) talks to the browser's
DevTools endpoint. Skips with a message where no Chromium is installed (``apt-get install chromium``).
"""
import base64
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import time

import numpy as np
import pytest
import torch

from captum_normattr.present.interactive import interactive_report_html, write_interactive_report


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


BROWSER = _browser()
NO_BROWSER = "no Chromium found (install Debian's `chromium` package to run the browser tests)"


class _WebSocket:
    r"""Just enough of RFC 6455 for the DevTools protocol: masked text frames out, frames in."""

    def __init__(self, url: str, timeout: float = 60.0):
        assert url.startswith("ws://")
        hostport, path = url[5:].split("/", 1)
        host, port = hostport.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        req = (f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the browser closed the connection during the handshake")
            head += chunk
        status, self.buf = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in status.split(b"\r\n")[0]:
            raise ConnectionError(f"websocket handshake refused: {status[:200]!r}")

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the browser closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text: str, opcode: int = 1) -> None:
        payload = text.encode() if isinstance(text, str) else text
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            if opcode == 9:  # ping
                self.send(data, opcode=10)
                continue
            if opcode == 8:
                raise ConnectionError("the browser closed the websocket")
            parts.append(data)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Chromium:
    r"""A headless Chromium with one page, attached over a flattened DevTools session."""

    def __init__(self, profile: str):
        self.proc = subprocess.Popen(
            [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--window-size=1200,900", f"--user-data-dir={profile}",
             "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = os.path.join(profile, "DevToolsActivePort")
        deadline = time.time() + 60
        while not (os.path.exists(port_file) and len(open(port_file).read().split()) >= 2):
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError(f"{BROWSER} did not start (exit code {self.proc.poll()})")
            time.sleep(0.1)
        port, path = open(port_file).read().split()[:2]
        self.ws = _WebSocket(f"ws://127.0.0.1:{port}{path}")
        self.next_id = 0
        self.events = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    def call(self, method, params=None, session=False, timeout=120.0):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)
        raise TimeoutError(method)

    def wait_event(self, name, timeout=120.0):
        for i, m in enumerate(self.events):
            if m.get("method") == name:
                return self.events.pop(i)
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = json.loads(self.ws.recv())
            if m.get("method") == name:
                return m
            self.events.append(m)
        raise TimeoutError(name)

    def js(self, expr):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, path):
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.call("Page.navigate", {"url": "file://" + os.path.abspath(path)}, session=True)
        self.wait_event("Page.loadEventFired")

    def hover_token(self, i):
        rect = self.js(f"(function(){{var e=document.querySelectorAll('#tokens span.tok')[{i}];e.scrollIntoView({{block:'center'}});"
                       f"var r=e.getBoundingClientRect();return [r.left+r.width/2,r.top+r.height/2];}})()")
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": rect[0], "y": rect[1]}, session=True)

    def errors(self):
        out = []
        for m in self.events:
            p = m.get("params", {})
            if m.get("method") == "Runtime.exceptionThrown":
                out.append(p["exceptionDetails"].get("text", "exception"))
            elif m.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(str(p.get("args")))
            elif m.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
        return out

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self):
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if BROWSER is None:
        pytest.skip(NO_BROWSER)
    for attempt in range(2):  # a start can fail once on a loaded machine: a fresh profile, once more
        try:
            b = _Chromium(str(tmp_path_factory.mktemp("chromium-profile")))
            break
        except RuntimeError as err:
            if attempt:
                pytest.skip(str(err))
    yield b
    b.close()


HOSTILE = ["<s>", "The", " <script>alert(1)</script>", ' "quoted"', " $x", "\n", "\x07bell", "&amp;", "</script>", " end"]


def _routes_json(tokens):
    from captum_normattr.attr.routes import InformationFlowRoutes
    from decoder_models import VOCAB, make_decoder

    model = make_decoder("llama", layers=2, seed=0)
    ids = torch.randint(3, VOCAB, (1, len(tokens)), generator=torch.Generator().manual_seed(0))
    return InformationFlowRoutes(model).attribute(ids, threshold=0.02, tokens=tokens).to_json()


def test_page_is_self_contained_escaped_and_validated():
    page = interactive_report_html(HOSTILE, {"m": np.eye(len(HOSTILE))}, title="<b>x</b>")
    data = page.split('id="report-data">')[1].split("</script>")[0]
    assert "<" not in data and ">" not in data and "&" not in data  # no token can close the element
    assert json.loads(data)["tokens"][5] == "\u21b5"
    assert "<title>&lt;b&gt;x&lt;/b&gt;</title>" in page
    assert "src=" not in page and "https:" not in page and "<link rel=\"stylesheet\"" not in page
    big = np.random.default_rng(0).random((300, 300))
    enc = json.loads(interactive_report_html(["t"] * 300, {"m": big}).split('id="report-data">')[1].split("</script>")[0])
    q = np.frombuffer(base64.b64decode(enc["methods"]["m"]["q"]), dtype=np.int8).reshape(300, 300)
    assert np.abs(q / 127 * np.array(enc["methods"]["m"]["scale"])[:, None] - big).max() <= big.max() / 254 + 1e-9
    with pytest.raises(ValueError, match="expected"):
        interactive_report_html(["a", "b"], {"m": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="last dimension"):
        interactive_report_html(["a", "b"], {"m": np.zeros((2, 3))})
    with pytest.raises(ValueError, match="layer map"):
        interactive_report_html(["a", "b"], {}, layer_maps={"x": np.zeros((2, 2))})


def test_report_loads_hovers_and_draws_routes(browser, tmp_path):
    t = len(HOSTILE)
    g = np.random.default_rng(0)
    alti = np.tril(g.random((t, t)))
    signed = g.normal(size=(3, t))  # one row per generated token: the last 3
    layers = g.random((2, t, t))
    path = write_interactive_report(str(tmp_path / "report.html"), HOSTILE, {"alti": alti, "alti-logit": signed},
                                    layer_maps={"ALTI": layers}, routes=_routes_json(HOSTILE), title="<b>demo</b>",
                                    sink_index=0)
    browser.open(path)
    assert browser.js("document.title") == "<b>demo</b>"
    assert browser.js("document.querySelectorAll('#tokens span.tok').length") == t
    # every token shown as text, with control characters made visible, nothing executed
    shown = browser.js("Array.from(document.querySelectorAll('#tokens span.tok')).map(function(e){return e.textContent})")
    assert shown[2] == HOSTILE[2] and shown[5] == "\u21b5" and shown[6] == "\\x07bell" and shown[8] == "</script>"
    assert browser.js("document.querySelectorAll('#tokens script').length") == 0
    # before any hover: the last row is selected, the tokens and the heat table are coloured
    assert browser.js("window.__report.state.row") == t - 1
    assert browser.js("window.__report.state.heat") == "table"
    assert browser.js("document.querySelectorAll('#heat-table tbody tr').length") == t
    assert browser.js("Array.from(document.querySelectorAll('#heat-table td')).filter(function(e){"
                      "return e.style.background !== ''}).length") > t
    assert browser.js("document.getElementById('summary').textContent").startswith("Top contributors")
    browser.hover_token(4)
    assert browser.js("window.__report.state.row") == 4
    label4 = browser.js("document.getElementById('row-label').textContent")
    bg4 = browser.js("Array.from(document.querySelectorAll('#tokens span.tok')).map(function(e){return e.style.background})")
    assert "row 4" in label4 and browser.js("document.querySelector('#tokens span.current').dataset.i") == "4"
    assert bg4[5:] == [""] * (t - 5) and any(bg4[1:5])  # causal row: only tokens up to 4 are coloured
    assert "var(--na-sink)" in bg4[0]  # the sink, left out of the scale by default, is grey
    browser.hover_token(9)
    assert browser.js("window.__report.state.row") == 9
    assert browser.js("document.querySelector('#tokens span.current').dataset.i") == "9"
    bg9 = browser.js("Array.from(document.querySelectorAll('#tokens span.tok')).map(function(e){return e.style.background})")
    assert bg9 != bg4
    # switch to the signed method with 3 rows (the last 3 tokens), then to the layer maps
    browser.js("var s=document.getElementById('method'); s.value='m:alti-logit'; s.dispatchEvent(new Event('change'))")
    assert browser.js("window.__report.rows()") == 3
    browser.hover_token(8)
    assert browser.js("window.__report.state.row") == 1
    browser.js("var s=document.getElementById('method'); s.value='l:ALTI'; s.dispatchEvent(new Event('change'))")
    assert browser.js("document.getElementById('layer-box').hidden") is False
    browser.js("var l=document.getElementById('layer'); l.value='1'; l.dispatchEvent(new Event('input'))")
    assert browser.js("window.__report.state.layer") == 1
    # the routes graph
    n_edges = browser.js("document.querySelectorAll('#routes-svg line.edge').length")
    assert n_edges == len(_routes_json(HOSTILE)["edges"]) and n_edges > 0
    labels = browser.js("Array.from(document.querySelectorAll('#routes svg text')).map(function(e){return e.textContent})")
    assert "\\x07bell" in labels and "emb" in labels and "out" in labels
    browser.js("var s=document.getElementById('method'); s.value='m:alti'; s.dispatchEvent(new Event('change'))")
    browser.hover_token(7)
    shot = browser.screenshot(str(tmp_path / "report.png"))
    assert os.path.getsize(shot) > 5000
    assert browser.errors() == []


def test_two_thousand_tokens(browser, tmp_path):
    t = 2000
    rnd = random.Random(0)
    tokens = ["".join(rnd.choice("abcdefgh <>&\"'$") for _ in range(rnd.randint(1, 6))) for _ in range(t)]
    g = np.random.default_rng(1)
    m = np.tril(g.random((t, t), dtype=np.float32))
    page = interactive_report_html(tokens, {"alti": m}, sink_index=0)
    assert len(page) < 8 * t * t  # quantised: about 1.4 bytes per entry
    path = tmp_path / "big.html"
    path.write_text(page, encoding="utf-8")
    t0 = time.time()
    browser.open(str(path))  # the load event comes after the page's script has drawn the heat map
    load_s = time.time() - t0
    assert browser.js("document.querySelectorAll('#tokens span.tok').length") == t
    assert browser.js("document.getElementsByTagName('*').length") < t + 200  # T token elements, never T^2
    # the whole map is drawn before any hover: a canvas, one pixel per number, coloured
    assert browser.js("window.__report.state.heat") == "canvas"
    coloured = browser.js("(function(){var c=document.getElementById('heat-canvas'),d=c.getContext('2d')"
                          ".getImageData(0,0,c.width,c.height).data,n=0;for(var i=0;i<d.length;i+=4){"
                          "if(d[i]<250||d[i+1]<250||d[i+2]<250){n++;}}return [c.width,c.height,n];})()")
    assert coloured[:2] == [t, t] and coloured[2] > t * t // 4  # the lower triangle, less the faint cells
    t1 = time.time()
    browser.hover_token(1500)
    assert browser.js("window.__report.state.row") == 1500
    hover_s = time.time() - t1
    assert browser.js("document.querySelector('#tokens span.current').dataset.i") == "1500"
    # the quantised row decodes to the map's values within int8 resolution
    vals = browser.js("Array.from(document.querySelectorAll('#tokens span.tok')).slice(0, 5).map(function(e){return parseFloat(e.title.split(': ').pop())})")
    scale = float(np.abs(m[1500]).max())
    assert np.allclose(vals, m[1500, :5], atol=scale / 127)
    browser.screenshot(str(tmp_path / "big.png"))
    assert browser.errors() == []
    print(f"2,000-token page: {len(page) / 1e6:.1f} MB, load and first paint {load_s:.2f} s, hover {hover_s:.3f} s")
    assert load_s < 60 and hover_s < 10, (load_s, hover_s)


def _pixels_near(png_path, rgb, tol=3):
    from PIL import Image

    im = np.asarray(Image.open(png_path).convert("RGB")).astype(int)
    return int((np.abs(im - np.array(rgb)).max(-1) <= tol).sum())


def test_colours_are_on_the_page_before_any_hover(browser, tmp_path):
    pytest.importorskip("PIL")
    from captum_normattr.present.colours import score_rgb

    toks = ["<s>", " The", " capital", " of", " France", " is", " Paris"]
    rows = np.array([[3.0, 0.5, 2.0, -0.2, 1.5, 0.1, 0.0],  # +max 2.0 once the sink (3.0) is left out
                     [1.0, -2.0, 0.4, 0.3, 1.0, 0.2, 0.0]])  # -max -2.0
    path = write_interactive_report(str(tmp_path / "p.html"), toks, {"ALTI-Logit": rows}, sink_index=0,
                                    model_name="tiny", first_generated=6, title="colours")
    browser.open(path)
    assert browser.js("window.__report.scale()") == pytest.approx(2.0)
    shot = browser.screenshot(str(tmp_path / "p.png"))  # no mouse event has been sent
    assert _pixels_near(shot, score_rgb(1.0)) > 50 and _pixels_near(shot, score_rgb(-1.0)) > 50
    assert _pixels_near(shot, score_rgb(0.75)) > 50  # 1.5 / 2.0: the cell of " France"
    # the cell text is readable: white on the dark cells, black on the light ones
    colours = browser.js("Array.from(document.querySelectorAll('#heat-table tbody tr')[0].querySelectorAll('td'))"
                         ".map(function(e){var s=getComputedStyle(e);return [s.backgroundColor,s.color]})")
    assert colours[2] == ["rgb(103, 0, 31)", "rgb(255, 255, 255)"]
    assert colours[5][1] == "rgb(0, 0, 0)"
    # the colour bar states the scale and the sink rule; the heading names the model, not a path
    assert browser.js("document.getElementById('bar-hi').textContent") == "+2.00"
    assert "left out of the scale" in browser.js("document.getElementById('legend').textContent")
    assert browser.js("document.getElementById('meta').textContent").startswith("model: tiny")
    assert browser.errors() == []


def _generate_record():
    return {"model": "/opt/hf/hub/models--Org--Tiny-LM/snapshots/0123abc", "prompt": "The capital",
            "prompt_length": 3, "sink_index": 0, "exclude_sink": False, "generated": [" of", " France"],
            "tokens": ["<s>", "The", "\u0120capital", "\u0120of", "\u0120France"],
            "token_text": ["<s>", "The", " capital", " of", " France"],
            "methods": {"ALTI-Logit": {"rows": [[0.2, -1.0, 0.5, 0.0, 0.0], [0.3, 0.4, 1.0, 0.6, 0.0]]}}}


def test_one_colour_convention_on_every_page(browser, tmp_path):
    from captum_normattr.cli.generate import render_html as generate_html
    from captum_normattr.present import colours
    from captum_normattr.present.report import TextExplanation, render_html

    pos, neg = colours.score_css(1.0), colours.score_css(-1.0)
    assert (pos, neg) == ("rgb(103, 0, 31)", "rgb(5, 48, 97)")
    ex = TextExplanation("a b c", ["[CLS]", "a", "b", "c"], {"DecompX": [0.1, 2.0, -2.0, 0.5]}, 0,
                         signed={"DecompX": True})
    pages = {
        "encoder": (render_html([ex]), "document.querySelectorAll('span.tok')[{}]", (1, 2)),
        "interactive": (interactive_report_html(["a", "b", "c"], {"m": [[0.5, 2.0, -2.0]]}),
                        "document.querySelectorAll('#heat-table td')[{}]", (1, 2)),
        "generate": (generate_html(_generate_record()), "document.querySelectorAll('#heat-table td')[{}]", (7, 1)),
    }
    from captum_normattr.attr.routes import RouteGraph
    from captum_normattr.present.interactive import routes_report_html

    pages["routes"] = (routes_report_html(RouteGraph.from_json(_routes_json(HOSTILE))), None, None)
    seen = {}
    for name, (page, cell, (i_pos, i_neg)) in ((k, (v[0], v[1], v[2] or (None, None))) for k, v in pages.items()):
        path = tmp_path / f"{name}.html"
        path.write_text(page, encoding="utf-8")
        browser.open(str(path))
        seen[name] = browser.js("(function(){var s=getComputedStyle(document.documentElement);return ["
                                "'--na-neg-max','--na-zero','--na-pos-max','--na-sink'].map(function(v){"
                                "return s.getPropertyValue(v).trim()})})()")
        if cell is not None:  # the +max and -max cells: the same RGB on every page
            assert browser.js(f"getComputedStyle({cell.format(i_pos)}).backgroundColor") == pos, name
            assert browser.js(f"getComputedStyle({cell.format(i_neg)}).backgroundColor") == neg, name
            assert browser.js(f"getComputedStyle({cell.format(i_pos)}).color") == "rgb(255, 255, 255)", name
        assert browser.errors() == [], name
    assert all(v == [colours.NEGATIVE_MAX, colours.ZERO, colours.POSITIVE_MAX, colours.SINK_GREY]
               for v in seen.values()), seen
    gen_page = pages["generate"][0]
    assert "Org/Tiny-LM" in gen_page and "/opt/hf" not in gen_page and "snapshots" not in gen_page


def test_route_graph_page(browser, tmp_path):
    from captum_normattr.attr.routes import RouteGraph
    from captum_normattr.present.interactive import write_routes_report

    g = RouteGraph.from_json(_routes_json(HOSTILE))
    path = tmp_path / "routes.html"
    write_routes_report(str(path), g)
    browser.open(str(path))
    assert browser.js("document.querySelectorAll('#routes-svg line.edge').length") == len(g.edges)
    assert browser.js("document.getElementById('method').value") == "m:route flow"
    browser.hover_token(len(HOSTILE) - 1)  # the explained (last) token: its row is the flow
    assert browser.js("window.__report.state.row") == 0
    assert browser.js("document.querySelectorAll('#tokens span.tok')[0].style.background") != ""
    # the column labels stay at the top of the graph's scrolling box
    labels = browser.js("Array.from(document.querySelectorAll('#routes .route-cols text.route-col')).map(function(e){return e.textContent})")
    assert "\\x07bell" in labels and len(labels) > 1
    browser.js("document.getElementById('routes').style.maxHeight='120px'; document.getElementById('routes').scrollTop=100000")
    tops = browser.js("[document.getElementById('routes').getBoundingClientRect().top,"
                      "document.querySelector('#routes .route-cols').getBoundingClientRect().top]")
    assert browser.js("document.getElementById('routes').scrollTop") > 0
    assert abs(tops[1] - tops[0]) <= 2, tops
    browser.screenshot(str(tmp_path / "routes.png"))
    assert browser.errors() == []


def test_image_panel_follows_the_hovered_token(browser, tmp_path):
    from captum_normattr.present.interactive_images import interactive_image_report_html

    t = len(HOSTILE)
    g = np.random.default_rng(3)
    signed = g.normal(size=(3, t))  # the last 3 tokens are the explained (generated) ones
    grid = g.normal(size=(3, 4, 6))
    grid[1, 0, 0] = np.nan
    img = (g.random((30, 40, 3)) * 255).astype(np.uint8)
    page = interactive_image_report_html(HOSTILE, {"alti-logit": signed}, img, {"alti-logit": grid},
                                         box=(0, 5, 30, 30), caption=HOSTILE[2], layer_maps={"ALTI": g.random((2, t, t))},
                                         first_generated=t - 3)
    path = tmp_path / "image.html"
    path.write_text(page, encoding="utf-8")
    browser.open(str(path))
    assert browser.js("document.getElementById('image-img').naturalWidth") == 40  # the data URI loaded
    assert browser.js("document.getElementById('image-canvas').width") == 40
    assert browser.js("document.getElementById('image-caption').textContent") == HOSTILE[2]
    canvas = "document.getElementById('image-canvas').toDataURL()"
    first = browser.js(canvas)
    assert browser.js("window.__image.current().row") == 2  # the last row, as the text, before any hover
    # a pixel inside the box is coloured, one left of the box (columns 0..4) is not
    px = "Array.from(document.getElementById('image-canvas').getContext('2d').getImageData(%d, %d, 1, 1).data)"
    assert browser.js(px % (20, 15))[3] == 255 and browser.js(px % (2, 15))[3] == 0
    browser.hover_token(t - 2)
    assert browser.js("window.__report.state.row") == 1 and browser.js("window.__image.current().row") == 1
    second = browser.js(canvas)
    assert second != first
    assert browser.js(px % (5, 1))[3] == 0  # the NaN cell of row 1: no score, transparent
    assert "explained token 1" in browser.js("document.getElementById('image-info').textContent")
    browser.js("var s=document.getElementById('image-sum'); s.checked=true; s.dispatchEvent(new Event('change'))")
    assert browser.js("window.__image.current().row") == -1 and browser.js(canvas) not in (first, second)
    browser.js("var s=document.getElementById('method'); s.value='l:ALTI'; s.dispatchEvent(new Event('change'))")
    assert browser.js("document.getElementById('image-info').textContent") == "no image scores for this map"
    assert browser.js(px % (20, 15))[3] == 0
    assert browser.errors() == []
