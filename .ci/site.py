"""Build the documentation site from `nbs/` into `_site/` with MkDocs (Material), without Quarto. Called by `.ci/site`.

Steps, each failing the run on a problem:
  clean    the source notebooks hold no execution metadata or timestamps, and no cell over 6,000 characters
  execute  every notebook runs on the CPU, each in a process of its own, as `nbdev-test` runs it (cells flagged with
           `tst_flags`, `#| notest` and `#| cuda`, are skipped); the outputs go to a build directory, never to `nbs/`
  process  nbdev's doc processing (the processors `nbdev-docs` uses) turns each executed notebook into a page notebook:
           front matter, `show_doc` for every exported name, hidden cells removed, links to documented names
  convert  each page notebook becomes a markdown page: code, outputs (text, markdown, HTML, images), Quarto's cell
           options (`echo`, `output`, `include`, `code-fold`), and the API entries with signature and parameter table
  mkdocs   `mkdocs build --strict` renders the pages; the navigation is `nbs/sidebar.yml`'s, the page titles are the
           notebooks' title cells, the styles `nbs/styles.css` (Quarto's) and `.ci/site.css`

The pages, their titles and their order come from `nbs/sidebar.yml` and the notebooks; the API from the code.
"""
import argparse, base64, enum, inspect, json, os, re, shutil, subprocess, sys, tempfile, time
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, CI = ROOT/'nbs', ROOT/'.ci'
_ansi = re.compile(r'\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])')

def notebooks(): return sorted(p for p in NBS.glob('*.ipynb') if not p.name.startswith(('_', '.')))

# ---------------------------------------------------------------------------------------------------------------------
# show_doc: nbdev's heading and docstring, a signature without the parameter comments, and a parameter table from them

def _fmt_sig(name, parts, ret, width=92):
    "`name(parts...)ret`, on one line if it fits, else one line per run of parameters that fits `width`"
    one = f'{name}({", ".join(parts)}){ret}'
    if len(one) <= width: return one
    lines, cur = [], ''
    for p in parts:
        if cur and len(cur) + len(p) + 2 > width - 4: lines.append(cur + ','); cur = ''
        cur = f'{cur}, {p}' if cur else p
    if cur: lines.append(cur)
    return f'{name}(\n' + '\n'.join('    ' + l for l in lines) + f'\n){ret}'

def _cell(s, code=False):
    "A table cell's text on one line, as code or with the pipes outside code spans escaped (Python-Markdown's tables)"
    s = ' '.join(str(s).split())
    if code: return f'`{s}`'
    return ''.join(p if i % 2 else p.replace('|', '\\|') for i, p in enumerate(re.split(r'(`[^`]*`)', s)))

def api_markdown(sym, name=None, title_level=3):
    "Markdown for `show_doc(sym)`: heading with nbdev's anchor, signature, docstring and the parameter table"
    from fastcore.docments import ShowDocRenderer, DocmentText, docments, _type_str, _fmt_default, _ital_first, empty
    from nbdev.doclinks import NbdevLookup
    r = ShowDocRenderer(sym, name=name, title_level=title_level)
    nm, sym = r.nm, r.sym
    md = '---\n\n'
    src = NbdevLookup().code(r.fn)
    if src and src.startswith('http'): md += f'[source]({src}){{ .doc-source target="_blank" }}\n\n'
    md += f'{"#"*title_level} {nm} {{ #{nm.lower()} .doc-heading }}\n\n'
    dm = {}
    if inspect.isclass(sym) and issubclass(sym, enum.Enum): # Its members, rather than `Enum`'s constructor
        bases = ', '.join(b.__name__ for b in sym.__mro__[1:] if b is not object and not b.__name__.startswith('_'))
        md += f'```python\nclass {nm}({bases})\n```\n\n'
        if r.docs: md += _ital_first(r.docs) + '\n\n'
        rows = ['| Member | Value |', '|---|---|'] + [f'| `{k}` | {_cell(repr(v.value), code=True)} |' for k, v in sym.__members__.items()]
        return md + '<div class="doc-params" markdown>\n\n' + '\n'.join(rows) + '\n\n</div>\n'
    if isinstance(r.dm, DocmentText):
        dm = {k: v for k, v in r.dm.dm.items() if k != 'self'}
        parts = [p for p, _ in r.dm.params]
        ret = dm.get('return', {})
        ret_s = f' -> {_type_str(ret["anno"])}' if ret.get('anno', empty) is not empty and not inspect.isclass(sym) else ''
        if r.sig is not None or parts: md += f'```python\n{_fmt_sig(nm, parts, ret_s)}\n```\n\n'
    if r.docs: md += _ital_first(r.docs) + '\n\n'
    params = {k: v for k, v in dm.items() if k != 'return'}
    if params:
        cols = {'anno': 'Type', 'default': 'Default', 'docment': 'Details'}
        cols = {k: v for k, v in cols.items() if any(d.get(k, empty) not in (empty, None) for d in params.values())} or {'docment': 'Details'}
        def val(d, k):
            v = d.get(k, empty)
            if v is empty or v is None and k == 'docment': return ''
            if k == 'anno': return _cell(_type_str(v), code=True)
            if k == 'default': return _cell(_fmt_default(v), code=True)
            return _cell(v)
        rows = ['| Parameter | ' + ' | '.join(cols.values()) + ' |', '|' + '---|' * (len(cols) + 1)]
        for k, d in params.items():
            pre = '*' if d.get('kind') == inspect.Parameter.VAR_POSITIONAL else '**' if d.get('kind') == inspect.Parameter.VAR_KEYWORD else ''
            rows.append(f'| `{pre}{k}` | ' + ' | '.join(val(d, c) for c in cols) + ' |')
        if dm.get('return', {}).get('docment'):
            rows.append('| **Returns** | ' + ' | '.join(val(dm['return'], c) if c != 'default' else '' for c in cols) + ' |')
        md += '<div class="doc-params" markdown>\n\n' + '\n'.join(rows) + '\n\n</div>\n'
    return md

class SiteRenderer:
    "Stands in for nbdev's `BasicMarkdownRenderer` in `show_doc`"
    def __init__(self, sym, name=None, title_level=3): self.args = (sym, name, title_level)
    def _repr_markdown_(self): return api_markdown(*self.args)
    def __repr__(self): return f'show_doc({self.args[1] or getattr(self.args[0], "__qualname__", self.args[0])})'

def use_site_renderer():
    import nbdev.showdoc
    nbdev.showdoc.BasicMarkdownRenderer = SiteRenderer # `show_doc` looks it up when called

# ---------------------------------------------------------------------------------------------------------------------
# execute and process one notebook (in a process of its own: 03_patches patches fastai, as nbdev-test's notes say)

def execute_and_process(src:Path, dst:Path, reuse=False):
    """Execute `src` with a `show_doc` cell after each exported definition (nbdev's `add_show_docs`), then process it
    with the rest of nbdev's doc processors. Their `exec_show_docs`, which would run the notebook's exported and import
    cells a second time for the `show_doc` outputs, has nothing left to do."""
    os.environ['IN_TEST'] = '1' # As nbdev-test and nbdev's doc processing set it
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT)) # The package of this checkout
    from fastcore.nbio import write_nb, read_nb
    from nbdev.config import get_config
    from nbdev.processors import FilterDefaults, add_show_docs, exec_show_docs
    use_site_renderer()
    cfg = get_config()
    executed = dst.parent.parent/'executed'/dst.name # Named as in nbs/: nbdev names the page after the notebook
    if not (reuse and executed.exists()): execute(src, executed, cfg)
    class Procs(FilterDefaults): # With --reuse, `exec_show_docs` runs the `show_doc` cells again, for a changed renderer
        def base_procs(self): return [p for p in super().base_procs() if reuse or p not in (add_show_docs, exec_show_docs)]
    os.chdir(src.parent) # nbdev processes a notebook from its own folder
    nb = read_nb(executed)
    if reuse: nb.cells = [c for c in nb.cells if not c.get('metadata', {}).get('site_show_doc')] # Added again below
    Procs()(nb)
    write_nb(nb, dst)

def execute(src, executed, cfg):
    "Run `src` as `nbdev-test` does, with its `show_doc` cells added, and save it with its outputs to `executed`"
    from fastcore.nbio import write_nb
    from fastcore.xtras import working_directory
    from execnb.shell import CaptureShell
    from nbdev.process import NBProcessor
    from nbdev.processors import add_show_docs
    from nbdev.test import _skip_cell
    nb = NBProcessor(src, procs=[add_show_docs], rm_directives=False, process=True).nb
    for c in nb.cells:
        if getattr(c, 'has_sd', False): c.metadata['site_show_doc'] = True
    skip = _skip_cell(nb, cfg.get('tst_flags', '').split())
    k = CaptureShell(src, profile=bool(cfg.get('exec_profile')))
    k.run('from nbdev.showdoc import show_doc')
    try:
        with working_directory(src.parent): k.run_all(nb, exc_stop=True, preproc=skip, cell_timeout=600)
    except Exception:
        sys.stderr.write(k.prettytb(fname=src) or '')
        raise
    for c in nb.cells: # A skipped cell keeps no outputs saved in nbs/: the page shows what this run produced
        if c.cell_type == 'code' and skip(c): c.outputs = []
    executed.parent.mkdir(exist_ok=True)
    write_nb(nb, executed)

# ---------------------------------------------------------------------------------------------------------------------
# convert a processed notebook into a markdown page

def _src(x): return ''.join(x) if isinstance(x, list) else (x or '')

MAX_CELL = 6000 # Characters a notebook cell may hold: a longer class is split over cells by method
_STAMP = re.compile(r'\d{4}-\d\d-\d\dT\d\d:\d\d') # An ISO timestamp, as Jupyter's execution records write them

def source_problems(nb:Path)->list:
    "What keeps the source notebook `nb` from being clean: execution records or timestamps in its metadata, long cells"
    d, res = json.loads(nb.read_text()), []
    if _STAMP.search(json.dumps(d.get('metadata', {}))): res.append(f'nbs/{nb.name}: its metadata holds a timestamp')
    for i, c in enumerate(d['cells']):
        meta = json.dumps(c.get('metadata', {}))
        if 'execution' in c.get('metadata', {}) or _STAMP.search(meta): res.append(f'nbs/{nb.name}: cell {i} has execution metadata')
        if (n := len(_src(c['source']))) > MAX_CELL: res.append(f'nbs/{nb.name}: cell {i} has {n:,} characters, over {MAX_CELL:,}')
    return res

def _opts(src):
    "Quarto cell options (`#| key: value`) at the top of `src`, and the source without them"
    opts, lines = {}, src.splitlines()
    while lines and re.match(r'^#\|', lines[0]):
        m = re.match(r'^#\|\s*([\w-]+)\s*:\s*(.*?)\s*$', lines.pop(0))
        if m: opts[m[1]] = m[2].strip('"\'')
    return opts, '\n'.join(lines).strip('\n')

def _fence(code, lang=''):
    ticks = '`' * max(3, max((len(m) for m in re.findall(r'`{3,}', code)), default=0) + 1)
    return f'{ticks}{lang}\n{code}\n{ticks}'

_list_item = re.compile(r'^(\s*)([-*+]|\d+[.)])\s+\S')
_fence_re = re.compile(r'^\s*(`{3,}|~{3,})')

def fix_markdown(md):
    """Python-Markdown wants a blank line before a list, table, fence or heading that follows a paragraph, and four
    spaces of indent for a nested list; Quarto's pandoc doesn't. Adds the blank lines and the indent (outside fences)."""
    out, fence, in_list, prev_blank, indents = [], None, False, True, []
    for line in md.splitlines():
        m = _fence_re.match(line)
        if fence:
            out.append(line)
            if m and m[1][0] == fence[0] and len(m[1]) >= len(fence): fence = None
            continue
        blank = not line.strip()
        li = _list_item.match(line)
        if m: fence = m[1]
        if li:
            ind = len(li[1])
            if not in_list: indents = []
            while indents and indents[-1] > ind: indents.pop()
            if not indents or indents[-1] < ind: indents.append(ind)
            line = ' ' * (4 * (len(indents) - 1)) + line.lstrip() if ind else line
        needs_blank = (m or li and not in_list or line.startswith('|') and out and not out[-1].startswith('|')
                       or line.startswith('#') and not line.startswith('#|'))
        if needs_blank and out and not prev_blank: out.append('')
        if li: in_list = True
        elif not blank and prev_blank and not line.startswith(' '): in_list = False
        out.append(line)
        prev_blank = blank
    return '\n'.join(out)

def demote_headings(md):
    "`md` with every `#` heading outside code fences one level lower"
    out, fence = [], None
    for line in md.splitlines():
        m = _fence_re.match(line)
        if fence:
            if m and m[1][0] == fence[0] and len(m[1]) >= len(fence): fence = None
        elif m: fence = m[1]
        elif re.match(r'^#{1,5} ', line): line = '#' + line
        out.append(line)
    return '\n'.join(out)

class Page:
    def __init__(self, nb:Path, proc:Path):
        self.nb, self.proc = nb, proc
        self.cells = json.loads(proc.read_text())['cells']
        self.fm = {}
        if self.cells and self.cells[0]['cell_type'] == 'raw' and _src(self.cells[0]['source']).startswith('---'):
            import yaml
            self.fm = yaml.safe_load(_src(self.cells.pop(0)['source']).strip().strip('-')) or {}
        self.html = self.fm.get('output-file', nb.with_suffix('.html').name)
        self.md = Path(self.html).with_suffix('.md').name
        self.title = str(self.fm.get('title', nb.stem))

class Converter:
    def __init__(self, pages, docs:Path):
        self.pages, self.docs, self.problems = pages, docs, []
        self.by_html = {p.html: p for p in pages} | {p.nb.name: p for p in pages}
        self.api = {p.md: {m for c in p.cells for o in c.get('outputs', [])
                           for m in re.findall(r'\{ #(\S+) \.doc-heading \}', _src(o.get('data', {}).get('text/markdown')))}
                    for p in pages} # The anchors of the `show_doc` sections of each page

    def link(self, url, page):
        "A page's link, for MkDocs: nbdev's `/page.html#anchor` and `page.html` become `page.md`; repo files are copied in"
        if re.match(r'^([a-z][\w+.-]*:|#|//)', url, flags=re.I) or not url: return url
        path, _, frag = url.partition('#')
        path = path.lstrip('/')
        frag = f'#{frag}' if frag else ''
        if path in self.by_html:
            md = self.by_html[path].md
            # nbdev links every `Class.method` it knows to `#class.method`; without a `show_doc` of its own, to `#class`
            if frag and (f := self.entry(path, frag[1:])): frag = '#' + f
            return md + frag
        for base in (NBS, ROOT): # A link written for the README (nbs/index.ipynb is README.md) is relative to the root
            f = (base/path).resolve()
            if path and f.is_file() and f.is_relative_to(ROOT) and not any(s.startswith('.') for s in f.relative_to(ROOT).parts):
                rel = f.relative_to(ROOT).as_posix() # Where it is in the repository is where it is in the site
                (self.docs/rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, self.docs/rel)
                return rel + frag
        self.problems.append(f'{page.nb.name}: link to {url}, which is neither a page nor a file of the repository')
        return url

    def entry(self, path, name)->str|None:
        "The anchor of page `path`'s `show_doc` entry for `name`, or for the class `name` is a method of; None without one"
        names = self.api[self.by_html[path].md]
        while name not in names and '.' in name: name = name.rpartition('.')[0]
        return name if name in names else None

    def doclink(self, m)->str:
        "nbdev's link to a name (`[`name`](page.html#name)`), or the plain code where the page has no entry for it"
        path, _, frag = m[3].lstrip('/').partition('#')
        if frag != m[2].lower() or path not in self.by_html or self.entry(path, frag): return m[0]
        return m[1]

    def links(self, md, page):
        # nbdev links every name its index knows; a name without an entry on its page (a private helper, a parameter
        # named as a function is) stays plain code
        md = re.sub(r'\[(`([\w.]+)`)\]\(([^)\s#]+#[\w.]+)\)', self.doclink, md)
        md = re.sub(r'(\]\()([^)\s]+)((?:\s+"[^"]*")?\))', lambda m: m[1] + self.link(m[2], page) + m[3], md)
        return re.sub(r'((?:href|src)=")([^"]+)(")', lambda m: m[1] + self.link(m[2], page) + m[3], md)

    def output(self, o, page, asis):
        t = o.get('output_type')
        if t == 'stream':
            txt = _ansi.sub('', _src(o.get('text'))).rstrip()
            return txt and f'<div class="cell-output cell-output-{o.get("name", "stdout")}" markdown>\n\n{_fence(txt, "text")}\n\n</div>'
        if t == 'error':
            tb = _ansi.sub('', '\n'.join(o.get('traceback') or [f'{o.get("ename")}: {o.get("evalue")}']))
            return f'<div class="cell-output cell-output-error" markdown>\n\n{_fence(tb, "text")}\n\n</div>'
        data = o.get('data', {})
        for mime, ext in (('image/png', 'png'), ('image/jpeg', 'jpg'), ('image/gif', 'gif')):
            if mime in data:
                self.n_img += 1
                f = Path(f'{Path(page.md).stem}_files')/f'figure-{self.n_img}.{ext}'
                (self.docs/f).parent.mkdir(exist_ok=True)
                (self.docs/f).write_bytes(base64.b64decode(_src(data[mime])))
                w = (o.get('metadata', {}).get(mime) or {}).get('width')
                attrs = f'{{ width="{w}" }}' if w else ''
                return f'<div class="cell-output cell-output-display" markdown>\n\n![]({f.as_posix()}){attrs}\n\n</div>'
        if 'image/svg+xml' in data:
            return f'<div class="cell-output cell-output-display">\n{_src(data["image/svg+xml"])}\n</div>'
        if 'text/markdown' in data:
            md = fix_markdown(self.links(_src(data['text/markdown']), page)).strip()
            if not asis and re.search(r'^# ', md, flags=re.M): # A page has one title: a displayed document's go a level down
                md = demote_headings(md)
            return md if asis else f'<div class="cell-output cell-output-display" markdown>\n\n{md}\n\n</div>'
        if 'text/html' in data:
            html = self.links(_src(data['text/html']), page).strip()
            html = re.sub(r'\n\s*\n', '\n', html) # A blank line would end the raw HTML block
            return f'<div class="cell-output cell-output-display">\n{html}\n</div>'
        if 'text/plain' in data:
            txt = _ansi.sub('', _src(data['text/plain'])).rstrip()
            return txt and f'<div class="cell-output cell-output-display" markdown>\n\n{_fence(txt, "text")}\n\n</div>'
        return ''

    def code_cell(self, c, page):
        opts, src = _opts(_src(c.get('source')))
        if opts.get('include') == 'false': return ''
        outs = [] if opts.get('output') == 'false' else c.get('outputs', [])
        if re.match(r'\s*show_doc\(', src): outs = [o for o in outs if o.get('output_type') != 'stream'] # Warnings of imports
        outs = [s for s in (self.output(o, page, opts.get('output') == 'asis') for o in outs) if s]
        parts = []
        if opts.get('echo') != 'false' and src.strip():
            code = _fence(src, 'python')
            fold = opts.get('code-fold')
            if fold in ('true', 'show'):
                summary = opts.get('code-summary', 'Code')
                code = f'???{"+" if fold == "show" else ""} note "{summary}"\n\n' + '\n'.join('    ' + l for l in code.splitlines())
            parts.append(code)
        if not parts and not outs: return ''
        if opts.get('output') == 'asis' and not parts: return '\n\n'.join(outs)
        return '<div class="cell" markdown>\n\n' + '\n\n'.join(parts + outs) + '\n\n</div>'

    def convert(self, page):
        self.n_img = 0
        md = [f'---\ntitle: {json.dumps(page.title)}\n' + (f'description: {json.dumps(str(page.fm["description"]))}\n'
              if page.fm.get('description') else '') + '---', f'# {page.title}']
        if page.fm.get('description'):
            md.append(f'<div class="description" markdown>\n\n{self.links(str(page.fm["description"]), page)}\n\n</div>')
        for c in page.cells:
            src = _src(c.get('source'))
            if c['cell_type'] == 'markdown':
                if src.strip().startswith('<!-- WARNING: THIS FILE WAS AUTOGENERATED'): continue
                md.append(fix_markdown(self.links(src, page)))
            elif c['cell_type'] == 'code': md.append(self.code_cell(c, page))
            elif c['cell_type'] == 'raw' and src.strip(): md.append(src) # Raw cells are markdown or HTML for Quarto
        (self.docs/page.md).write_text('\n\n'.join(s for s in md if s.strip()) + '\n')

# ---------------------------------------------------------------------------------------------------------------------
# navigation from nbs/sidebar.yml, and the MkDocs configuration

def nav_from_sidebar(pages, problems):
    import yaml
    sidebar = yaml.safe_load((NBS/'sidebar.yml').read_text())['website']['sidebar']['contents']
    by_nb, listed = {p.nb.name: p for p in pages}, set()
    def entries(items):
        if isinstance(items, str): items = [items]
        res = []
        for it in items or []:
            if isinstance(it, dict) and ('section' in it or 'contents' in it or 'auto' in it):
                sub = entries(it.get('contents') or it.get('auto'))
                if sub: res.append({str(it.get('section', it.get('text', ''))): sub})
                continue
            href, text = (it, None) if isinstance(it, str) else (it.get('href'), it.get('text'))
            if not href: continue
            names = sorted(n for n in by_nb if fnmatch(n, href.lstrip('/'))) if '*' in href else [href.lstrip('/')]
            for n in names:
                if n not in by_nb: problems.append(f'nbs/sidebar.yml lists {href}, which is not a notebook in nbs/'); continue
                listed.add(n)
                res.append({text: by_nb[n].md} if text else by_nb[n].md) # MkDocs takes the title from the page
        return res
    nav = entries(sidebar)
    for n in sorted(set(by_nb) - listed): problems.append(f'nbs/{n} is not in nbs/sidebar.yml, so the site has no place for it')
    return nav

def mkdocs_config(pages, nav, docs:Path, out:Path):
    from nbdev.config import get_config
    import yaml
    cfg = get_config()
    quarto = yaml.safe_load((NBS/'_quarto.yml').read_text()) or {}
    home = next((p for p in pages if p.md == 'index.md'), None)
    css = []
    for f in [*quarto.get('format', {}).get('html', {}).get('css', '').split(), CI/'site.css']:
        f = NBS/f if not isinstance(f, Path) else f
        shutil.copy2(f, docs/f.name); css.append(f.name)
    conf = dict(
        site_name=str(cfg.get('title') or cfg.lib_name),
        site_description=str(home.fm.get('description', '')) if home else '',
        docs_dir=str(docs), site_dir=str(out), use_directory_urls=False, strict=True, nav=nav,
        theme=dict(name='material', font=False, # No fonts fetched from Google: system fonts
                   features=['navigation.sections', 'navigation.top', 'toc.integrate', 'search.highlight', 'content.code.copy'],
                   palette=[dict(scheme='default', primary='blue', accent='blue')]),
        plugins=['search'] if (quarto.get('website', {}).get('navbar', {}) or {}).get('search', True) else [],
        extra_css=css,
        markdown_extensions=['attr_list', 'md_in_html', 'tables', 'admonition', 'footnotes', 'pymdownx.details',
                             'pymdownx.superfences', {'pymdownx.highlight': {'use_pygments': True}},
                             {'toc': {'permalink': True, 'toc_depth': 3}}],
        validation=dict(omitted_files='info', absolute_links='warn', unrecognized_links='warn', anchors='warn'),
    )
    if cfg.get('git_url', '').startswith('http'): conf['repo_url'] = cfg.git_url
    p = docs.parent/'mkdocs.yml'
    p.write_text(yaml.safe_dump(conf, sort_keys=False))
    return p

# ---------------------------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=str(ROOT/'_site'), help='where the site goes (default: _site/)')
    ap.add_argument('--workers', type=int, default=2, help='notebooks executed in parallel')
    ap.add_argument('--build-dir', help='keep the executed notebooks and the markdown here (default: a temporary directory)')
    ap.add_argument('--reuse', action='store_true', help='with --build-dir: reuse the notebooks it executed before (for work on the site itself)')
    ap.add_argument('--one', nargs=2, metavar=('NB', 'DST'), help=argparse.SUPPRESS) # A worker: execute and process NB
    a = ap.parse_args()
    if a.one: return execute_and_process(Path(a.one[0]).resolve(), Path(a.one[1]).resolve(), a.reuse)

    if (problems := [p for nb in notebooks() for p in source_problems(nb)]):
        sys.exit('site: ' + '\n  '.join(['the notebooks are not clean (clear their execution metadata; split long cells):', *problems]))
    t0 = time.time()
    tmp = Path(a.build_dir).resolve() if a.build_dir else Path(tempfile.mkdtemp(prefix='site-'))
    if a.reuse: shutil.rmtree(tmp/'docs', ignore_errors=True)
    elif tmp.exists():
        if any(tmp.iterdir()) and not (tmp/'proc').exists(): sys.exit(f'site: {tmp} is not empty and not a build directory')
        shutil.rmtree(tmp)
    (tmp/'proc').mkdir(parents=True, exist_ok=True); (tmp/'docs').mkdir()
    out = Path(a.out).resolve()
    from concurrent.futures import ThreadPoolExecutor
    def work(nb):
        t = time.time()
        r = subprocess.run([sys.executable, __file__, '--one', str(nb), str(tmp/'proc'/nb.name), *(['--reuse'] if a.reuse else [])], cwd=ROOT,
                           capture_output=True, text=True)
        return nb, r, time.time() - t
    print(f'== execute and process: {len(notebooks())} notebooks, {a.workers} at a time, into {tmp}', flush=True)
    failed = []
    with ThreadPoolExecutor(a.workers) as ex: # Longest first (by size), so the workers finish together
        for nb, r, secs in ex.map(work, sorted(notebooks(), key=lambda p: -p.stat().st_size)):
            print(f'  {nb.name}: {"ok" if r.returncode == 0 else "FAILED"} in {secs:.0f}s', flush=True)
            if r.returncode:
                print('\n'.join('    ' + l for l in (r.stdout + r.stderr).strip().splitlines()[-40:]), flush=True)
                failed.append(nb.name)
    if failed: sys.exit(f'site: executing or processing failed for {", ".join(failed)} (see above)')

    print(f'== convert to markdown ({time.time()-t0:.0f}s)', flush=True)
    pages = [Page(nb, tmp/'proc'/nb.name) for nb in notebooks()]
    conv = Converter(pages, tmp/'docs')
    for p in pages: conv.convert(p)
    problems = conv.problems
    nav = nav_from_sidebar(pages, problems)
    if problems: sys.exit('site: ' + '\n  '.join(['problems with the pages:', *problems]))
    conf = mkdocs_config(pages, nav, tmp/'docs', out)

    print(f'== mkdocs build --strict into {out} ({time.time()-t0:.0f}s)', flush=True)
    if out.exists(): shutil.rmtree(out)
    r = subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict', '-q', '-f', str(conf)], cwd=tmp,
                       env=os.environ | {'NO_MKDOCS_2_WARNING': '1'})
    if r.returncode: sys.exit(f'site: mkdocs build failed (the markdown it read is in {tmp}; pass --build-dir to keep it)')
    if not a.build_dir: shutil.rmtree(tmp)
    print(f'site: {len(pages)} pages in {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}, {time.time()-t0:.0f}s', flush=True)

if __name__ == '__main__': main()
