"""Check the built site (`_site/`) in headless Chromium. Called by `.ci/site`; `python .ci/site_check.py [SITE]`.

Serves the site on localhost and opens every built page in Debian's Chromium, driven through the DevTools protocol
over a pipe (no driver, no download), then fails on:
  pages     a notebook in `nbs/` without its page, a page that doesn't load, a file it loads (style, script, image)
            that is missing, or a JavaScript error
  links     an internal link (`href` of every `<a>` on every page, as the browser resolves it) to a page or file that
            doesn't exist, or to an anchor that the target page doesn't have
  api       a public name (each module's `__all__`, and the methods the package patches onto other classes) without
            its section on the page nbdev gives it (`_modidx`), or a section without its signature, docstring, or a
            parameter table listing every parameter (an `Enum`'s table lists its members)
Saves a screenshot (1280x2000) of every page of the navigation into `SITE/_screenshots/`.
"""
import base64, enum, functools, http.server, importlib, inspect, json, os, shutil, subprocess, sys, tempfile, threading, time
from pathlib import Path
from queue import Queue, Empty
from urllib.parse import urlsplit, unquote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'.ci'))
sys.path.insert(0, str(ROOT))

failures = []
def fail(step, msg): failures.append(f'[{step}] {msg}'); print(f'  FAIL [{step}] {msg}', flush=True)

# ---------------------------------------------------------------------------------------------------------------------
# Chromium through the DevTools protocol, over --remote-debugging-pipe (fd 3: commands in, fd 4: replies out)

class Chromium:
    def __init__(self, exe, timeout=30, start_timeout=180):
        self.timeout, self.start_timeout, self.ids, self.replies, self.events = timeout, start_timeout, 0, {}, Queue()
        self.profile = tempfile.mkdtemp(prefix='site-check-chromium-')
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()
        def fds(): # In the child: fd 3 and 4, whatever numbers the pipes have
            a, b = os.dup(cmd_r), os.dup(out_w)
            os.dup2(a, 3); os.dup2(b, 4)
        args = [exe, '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                '--disable-background-networking', '--disable-component-update', '--disable-sync', '--hide-scrollbars',
                f'--user-data-dir={self.profile}', '--remote-debugging-pipe', '--window-size=1280,2000', 'about:blank']
        # close_fds=False keeps the fds 3 and 4 that `fds` makes (Python's own fds are not inherited: PEP 446)
        self.proc = subprocess.Popen(args, preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(cmd_r); os.close(out_w)
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start() # Drain Chromium's log
        # Its first answer waits for Chromium to start: on a loaded machine (CI's legs, two at a time on 2 cores) that
        # took over 30 s once, so the start has a wait of its own
        self.version = self.send('Browser.getVersion', wait=self.start_timeout)['product']
        tid = self.send('Target.createTarget', url='about:blank')['targetId']
        self.session = self.send('Target.attachToTarget', targetId=tid, flatten=True)['sessionId']

    def _read(self):
        buf = b''
        while chunk := os.read(self.out_r, 1 << 20):
            buf += chunk
            *msgs, buf = buf.split(b'\0')
            for m in msgs:
                msg = json.loads(m)
                if 'id' in msg:
                    with self.cond: self.replies[msg['id']] = msg; self.cond.notify_all()
                else: self.events.put(msg)
        with self.cond: self.replies[None] = 'closed'; self.cond.notify_all()

    def send(self, method, session=False, wait=None, **params):
        "Call `method` and return its result, waiting `wait` seconds for it (`None`: `timeout`)"
        wait = self.timeout if wait is None else wait
        self.ids += 1
        i, msg = self.ids, {'id': self.ids, 'method': method, 'params': params}
        if session: msg['sessionId'] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b'\0')
        with self.cond:
            if not self.cond.wait_for(lambda: i in self.replies or None in self.replies, wait):
                raise TimeoutError(f'Chromium did not answer {method} in {wait}s')
            if i not in self.replies: raise RuntimeError(f'Chromium exited (answering {method})')
            r = self.replies.pop(i)
        if 'error' in r: raise RuntimeError(f'{method}: {r["error"].get("message")}')
        return r.get('result', {})

    def page(self, method, **params): return self.send(method, session=True, **params)

    def drain(self):
        res = []
        while True:
            try: res.append(self.events.get_nowait())
            except Empty: return res

    def open(self, url):
        "Load `url`; return (error, events seen while loading)"
        self.drain()
        r = self.page('Page.navigate', url=url)
        if r.get('errorText'): return r['errorText'], self.drain()
        events, end = [], time.time() + self.timeout
        while time.time() < end:
            try: e = self.events.get(timeout=end - time.time())
            except Empty: break
            events.append(e)
            if e.get('method') == 'Page.loadEventFired': break
        else: return f'no load event in {self.timeout}s', events
        time.sleep(0.3) # Late subresource errors and script exceptions
        return None, events + self.drain()

    def js(self, expr):
        r = self.page('Runtime.evaluate', expression=expr, returnByValue=True, awaitPromise=True)
        if 'exceptionDetails' in r: raise RuntimeError(f'script failed: {r["exceptionDetails"]}')
        return r['result'].get('value')

    def screenshot(self, path):
        path.write_bytes(base64.b64decode(self.page('Page.captureScreenshot', format='png')['data']))

    def close(self):
        try: self.send('Browser.close')
        except Exception: pass
        try: self.proc.wait(10)
        except subprocess.TimeoutExpired: self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

# What each page holds, read from the DOM the browser built
PAGE_JS = r"""(() => {
  const api = {};
  for (const h of document.querySelectorAll('article .doc-heading')) {
    const level = +h.tagName[1], sec = {sig: false, doc: '', params: [], table: false};
    for (let el = h.nextElementSibling; el; el = el.nextElementSibling) {
      if (el.tagName === 'HR' || (/^H[1-6]$/.test(el.tagName) && +el.tagName[1] <= level)) break;
      if (!sec.sig && el.querySelector('code') && el.matches('.highlight, pre, div.language-python')) { sec.sig = true; continue; }
      if (el.tagName === 'P' && !sec.doc && !sec.table) sec.doc = el.innerText.trim();
      const t = el.tagName === 'TABLE' ? el : el.querySelector('table');
      if (t && !sec.table) { sec.table = true; sec.params = [...t.querySelectorAll('tbody tr')].map(r => r.cells[0].innerText.trim()); }
    }
    api[h.id] = sec;
  }
  const ids = [...document.querySelectorAll('[id]')].map(e => e.id).concat([...document.querySelectorAll('a[name]')].map(e => e.name));
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const images = [...document.images].filter(i => i.complete && i.naturalWidth === 0).map(i => i.src);
  return {title: document.title, h1: (document.querySelector('article h1') || {}).innerText || '', ids, links, api,
          broken_images: images, text: document.body.innerText.length};
})()"""

# ---------------------------------------------------------------------------------------------------------------------

def serve(site:Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a): pass
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f'http://127.0.0.1:{srv.server_address[1]}/'

def nav_pages(site:Path):
    "Pages of the site's navigation, in order: the sidebar links of the home page"
    from html.parser import HTMLParser
    class P(HTMLParser):
        def __init__(self): super().__init__(); self.hrefs = []
        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == 'a' and 'md-nav__link' in (a.get('class') or '') and a.get('href') and '#' not in a['href']: self.hrefs.append(a['href'])
    p = P(); p.feed((site/'index.html').read_text())
    return list(dict.fromkeys(['index.html', *(h.lstrip('./') for h in p.hrefs)]))

def api_expectations():
    "(qualified name, page, anchor, parameter names, has docstring) for every public name that is a class or function"
    import docs
    api = docs.public_api()
    syms = {k: v for m in importlib.import_module('fastxtend_compile._modidx').d['syms'].values() for k, v in m.items()}
    res = []
    for qn, obj in api:
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj) or callable(obj)): continue
        loc = syms.get(qn)
        page, _, anchor = loc[0].partition('#') if loc else (None, '', qn.split('.', 2)[-1].lower())
        if inspect.isclass(obj) and issubclass(obj, enum.Enum): params = list(obj.__members__) # Its table lists members
        else:
            try: params = [n for n in inspect.signature(obj).parameters if n != 'self']
            except (TypeError, ValueError): params = []
        res.append((qn, page, anchor, params, bool(docs._own_doc(obj, qn))))
    return res

def undocumented_params():
    "{qualified name: parameters without an inline comment (`docments`)} of every public function and class"
    import docs
    from fastcore.docments import docments
    res = {}
    for qn, obj in docs.public_api():
        if not callable(obj) or inspect.isclass(obj) and issubclass(obj, enum.Enum): continue
        try: d = docments(obj, full=True)
        except Exception: continue
        ps = [k for k, v in d.items() if k not in ('self', 'return', 'args', 'kwargs', 'kwds') and not v.get('docment')]
        if ps: res[qn] = ps
    return res

def main():
    site = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT/'_site').resolve()
    t0 = time.time()
    if not (site/'index.html').exists(): sys.exit(f'site check: {site}/index.html is missing: build the site first (bash .ci/site)')
    exe = os.environ.get('CHROMIUM') or shutil.which('chromium') or '/usr/bin/chromium'
    if not Path(exe).exists(): sys.exit('site check: Chromium is not installed (apt-get install -y chromium)')
    shots = site/'_screenshots'
    shutil.rmtree(shots, ignore_errors=True); shots.mkdir()

    print('== pages: every notebook has its page', flush=True)
    import docs
    from nbdev.doclinks import nbpath2html
    for nb in docs.notebooks():
        if not (site/nbpath2html(nb).name).exists(): fail('pages', f'nbs/{nb.name} has no page: {nbpath2html(nb).name} is missing')
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob('*.html') if not p.relative_to(site).parts[0].startswith('_'))
    nav = nav_pages(site)
    for p in nav:
        if p not in pages: fail('pages', f'the navigation links to {p}, which is missing')

    srv, base = serve(site)
    browser = Chromium(exe)
    print(f'== open {len(pages)} pages in {browser.version}, on {base}', flush=True)
    browser.page('Page.enable'); browser.page('Network.enable'); browser.page('Runtime.enable')
    browser.page('Emulation.setDeviceMetricsOverride', width=1280, height=2000, deviceScaleFactor=1, mobile=False)
    seen = {}
    try:
        for p in pages:
            if p == '404.html': continue # Material's 404 page is for a server with `site_url`: its links are absolute
            err, events = browser.open(base + p)
            if err: fail('pages', f'{p} did not load: {err}'); continue
            for e in events:
                m, prm = e.get('method'), e.get('params', {})
                if m == 'Network.responseReceived' and prm['response']['status'] >= 400:
                    fail('pages', f'{p} loads {prm["response"]["url"]}: HTTP {prm["response"]["status"]}')
                elif m == 'Network.loadingFailed' and not prm.get('canceled'):
                    fail('pages', f'{p}: a resource failed to load: {prm.get("errorText")}')
                elif m == 'Runtime.exceptionThrown':
                    fail('pages', f'{p}: JavaScript error: {prm["exceptionDetails"].get("exception", {}).get("description") or prm["exceptionDetails"].get("text")}')
            info = browser.js(PAGE_JS)
            seen[p] = info
            for src in info['broken_images']: fail('pages', f'{p}: image {src} did not load')
            if info['text'] < 200: fail('pages', f'{p} is (nearly) empty')
            if p in nav:
                browser.screenshot(shots/(Path(p).stem + '.png'))
            print(f'  {p}: "{info["h1"]}", {len(info["links"])} links, {len(info["api"])} API sections', flush=True)
    finally:
        browser.close()
        srv.shutdown()

    print('== links: every internal link, anchors included', flush=True)
    origin, n = urlsplit(base), 0
    for p, info in seen.items():
        for href in dict.fromkeys(info['links']):
            u = urlsplit(href)
            if (u.scheme, u.netloc) != (origin.scheme, origin.netloc): continue
            n += 1
            path = unquote(u.path).lstrip('/') or 'index.html'
            if path.endswith('/'): path += 'index.html'
            if not (site/path).is_file(): fail('links', f'{p} links to {path}, which does not exist'); continue
            if u.fragment and path in seen and unquote(u.fragment) not in seen[path]['ids']:
                fail('links', f'{p} links to {path}#{u.fragment}, but {path} has no such anchor')
            elif u.fragment and path.endswith('.html') and path not in seen: fail('links', f'{p} links to {path}, which was not checked')
    print(f'  {n} internal links on {len(seen)} pages', flush=True)

    print('== api: a section with signature, docstring and parameter table for every public name', flush=True)
    exp = api_expectations()
    for qn, page, anchor, params, has_doc in exp:
        where = [page] if page else [p for p in seen if anchor in seen[p]['api']]
        sec = next((seen[w]['api'][anchor] for w in where if w in seen and anchor in seen[w]['api']), None)
        if sec is None: fail('api', f'{qn} has no section on {page or "any page"} (anchor #{anchor})'); continue
        if not sec['sig']: fail('api', f'{qn} ({page}#{anchor}) shows no signature')
        if has_doc and not sec['doc']: fail('api', f'{qn} ({page}#{anchor}) shows no docstring')
        if params and not sec['table']: fail('api', f'{qn} ({page}#{anchor}) has parameters but no parameter table')
        elif params:
            missing = [x for x in params if x not in {c.lstrip('*') for c in sec['params']}]
            if missing: fail('api', f'{qn} ({page}#{anchor}): the parameter table lacks {", ".join(missing)}')
    print(f'  {len(exp)} public names', flush=True)
    undoc = undocumented_params()
    if undoc: # Not a failure (yet): the table lists them, with an empty Details column
        print(f'  note: {sum(map(len, undoc.values()))} parameters of {len(undoc)} public names have no inline comment, so '
              'their Details are empty: ' + '; '.join(f'{k.split(".", 1)[1]}({", ".join(v)})' for k, v in undoc.items()), flush=True)

    print(f'\nsite check: {len(failures)} problem(s), {len(seen)} pages, screenshots in {shots}, {time.time()-t0:.0f}s')
    for f in failures: print('  FAIL', f)
    sys.exit(1 if failures else 0)

if __name__ == '__main__': main()
