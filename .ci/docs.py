"""Build and check the documentation site. Called by `.ci/docs`; run `bash .ci/docs --help` for the options.

Steps, each failing the run on a problem:
  export   `nbdev-export` leaves the library as committed (the notebooks are the source)
  pages    every page notebook exists, every library module has its notebook, the sidebar lists every notebook
  doc      every public name (`__all__` of each module, and each patched `Learner` method) has a docstring
  envs     the home page's table of tested versions is settings.ini's `test_envs` (`--fix` rewrites it), and the
           declared minimum Python, torch and fastai and setup.py's classifiers are what those environments test
  test     `nbdev-test` runs every notebook on the CPU (cells flagged `#| cuda` or `#| notest` are skipped)
  proc     nbdev's doc processing (`show_doc` for every exported name) runs, and every public name is shown
  readme   README.md has the home page's set-up commands, quick start and sections
  render   with Quarto installed: `nbdev-docs` renders the site, and every page has its HTML
"""
import argparse, fnmatch, hashlib, inspect, json, os, re, shutil, subprocess, sys, time, importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, LIB, LIB_NAME = ROOT/'nbs', ROOT/'fastxtend_compile', 'fastxtend_compile'
GUIDES = ['index', '10_guide', '11_troubleshooting', '12_benchmarks'] # Pages that aren't a library module
README_MUST = ['pip install -e ".[dev]"', 'pytest -q tests', 'load_digits', '.compile()', 'bash .ci/site', '_site/index.html']
CALLBACK_EVENTS = {'after_create', 'before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss',
                   'before_backward', 'after_cancel_backward', 'after_backward', 'before_step', 'after_cancel_step',
                   'after_step', 'after_cancel_batch', 'after_batch', 'after_cancel_train', 'after_train', 'before_validate',
                   'after_cancel_validate', 'after_validate', 'after_cancel_epoch', 'after_epoch', 'after_cancel_fit',
                   'after_fit', 'after_freeze'}

failures, warnings_ = [], []
def fail(step, msg): failures.append(f'[{step}] {msg}'); print(f'  FAIL {msg}', flush=True)
def warn(step, msg): warnings_.append(f'[{step}] {msg}'); print(f'  warning: {msg}', flush=True)
def head(step, what): print(f'== {step}: {what}', flush=True)

def run(cmd, **kwargs):
    print('  $ ' + ' '.join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kwargs)

def notebooks(): return sorted(p for p in NBS.glob('*.ipynb') if not p.name.startswith(('_', '.')))
def modules(): return sorted(p for p in LIB.glob('*.py') if not p.name.startswith('_'))

def source_nb(py:Path):
    "The notebook a generated module says it comes from"
    m = re.search(r'File to edit: \.\./nbs/(\S+\.ipynb)', py.read_text())
    return m and NBS/m[1]

def _lib_hash(p:Path):
    "Hash of a generated module, ignoring the cell ids in its `# %%` markers (random for notebooks saved without ids)"
    txt = re.sub(r'^(# %% .*?) #[0-9a-f]+$', r'\1', p.read_text(), flags=re.M)
    return hashlib.sha1(txt.encode()).hexdigest()

def lib_hashes(lib:Path=LIB): return {p.name: _lib_hash(p) for p in lib.glob('*.py')}

def step_export():
    head('export', 'nbdev-export of the notebooks gives the library as it is')
    import tempfile
    with tempfile.TemporaryDirectory() as tmp: # Export into a copy, so this check never rewrites the working tree
        skip = shutil.ignore_patterns('.git', '_proc', '_docs', '_site', '.venv*', '*.egg-info', '__pycache__', '.ipynb_checkpoints')
        shutil.copytree(ROOT, tmp, ignore=skip, dirs_exist_ok=True)
        print('  $ nbdev-export (in a copy of the repository)', flush=True)
        r = subprocess.run(['nbdev-export'], cwd=tmp, capture_output=True, text=True)
        if r.returncode: return fail('export', f'nbdev-export failed: {r.stderr.strip()[-2000:]}')
        exported = lib_hashes(Path(tmp)/LIB.name)
    here = lib_hashes()
    changed = sorted(k for k in here.keys() | exported.keys() if here.get(k) != exported.get(k))
    if changed: fail('export', f"the library is out of date with the notebooks: nbdev-export changes {', '.join(changed)}. "
                               "Run `nbdev-export` and commit the result.")

def _load_yaml(p):
    import yaml
    return yaml.safe_load(p.read_text())

def _sidebar_patterns(items):
    for it in items or []:
        if isinstance(it, str): yield it
        elif isinstance(it, dict):
            if 'href' in it: yield it['href']
            c = it.get('contents') or it.get('auto')
            if isinstance(c, str): yield c
            else: yield from _sidebar_patterns(c)

def step_pages():
    head('pages', 'page notebooks, module notebooks, sidebar')
    for name in GUIDES:
        if not (NBS/f'{name}.ipynb').exists(): fail('pages', f'nbs/{name}.ipynb is missing')
    for py in modules():
        nb = source_nb(py)
        if nb is None: fail('pages', f'{py.relative_to(ROOT)} does not say which notebook it is generated from')
        elif not nb.exists(): fail('pages', f'{py.relative_to(ROOT)} comes from {nb.relative_to(ROOT)}, which is missing')
    for f in ['_quarto.yml', 'sidebar.yml', 'styles.css']:
        if not (NBS/f).exists(): fail('pages', f'nbs/{f} is missing')
    try: quarto, sidebar = _load_yaml(NBS/'_quarto.yml'), _load_yaml(NBS/'sidebar.yml')
    except Exception as e: return fail('pages', f'nbs/_quarto.yml or nbs/sidebar.yml is not valid YAML: {e}')
    if 'sidebar.yml' not in (quarto.get('metadata-files') or []): fail('pages', "nbs/_quarto.yml doesn't load sidebar.yml")
    pats = list(_sidebar_patterns(sidebar['website']['sidebar']['contents']))
    for nb in notebooks():
        if not any(fnmatch.fnmatch(nb.name, p.lstrip('/')) for p in pats):
            fail('pages', f'nbs/{nb.name} is not in nbs/sidebar.yml, so it has no place in the site navigation')
    for p in pats:
        if '*' not in p and not (NBS/p).exists(): fail('pages', f'nbs/sidebar.yml lists {p}, which does not exist')
    from nbdev.config import get_config
    if not get_config().custom_sidebar:
        warn('pages', 'pyproject.toml has no `custom_sidebar = true` under [tool.nbdev]: nbdev-docs will replace '
                      'nbs/sidebar.yml with a flat list of pages')

def _own_doc(obj, name):
    "`obj`'s own docstring: not inherited, not the signature a dataclass writes for itself"
    doc = obj.__dict__.get('__doc__') if inspect.isclass(obj) else getattr(obj, '__doc__', None)
    if isinstance(obj, property): doc = obj.__doc__ or (obj.fget and obj.fget.__doc__)
    if doc and inspect.isclass(obj) and doc.startswith(f'{obj.__name__}('): doc = None # dataclass's default
    return (doc or '').strip()

def public_api():
    "(qualified name, object) for every `__all__` name of every module and every patched method"
    sys.path.insert(0, str(ROOT))
    res = []
    modidx = importlib.import_module(f'{LIB_NAME}._modidx').d['syms']
    for py in modules():
        mod = importlib.import_module(f'{LIB_NAME}.{py.stem}')
        names = getattr(mod, '__all__', None)
        if names is None: fail('doc', f'{mod.__name__} has no __all__'); continue
        for n in names: res.append((f'{mod.__name__}.{n}', getattr(mod, n)))
        for key in modidx.get(mod.__name__, {}):
            parts = key[len(mod.__name__)+1:].split('.')
            if len(parts) != 2 or parts[0] in names or parts[0].startswith('_') or parts[1].startswith('_'): continue
            owner = getattr(mod, parts[0], None)
            if getattr(owner, '__module__', None) == mod.__name__: continue # A private class's method, not a patch
            if owner is not None and hasattr(owner, parts[1]): res.append((f'{mod.__name__}.{".".join(parts)}', getattr(owner, parts[1])))
    return res

def step_doc():
    head('doc', 'every public name has a docstring')
    api = public_api()
    for qn, obj in api:
        if not (inspect.isclass(obj) or callable(obj)): continue # constants
        if not _own_doc(obj, qn): fail('doc', f'{qn} has no docstring')
        if inspect.isclass(obj) and obj.__module__.startswith(LIB_NAME):
            for k, v in vars(obj).items():
                if k.startswith('_') or k in CALLBACK_EVENTS or not (inspect.isfunction(v) or isinstance(v, property)): continue
                if not _own_doc(v, k): warn('doc', f'{qn}.{k} has no docstring')
    print(f'  {len(api)} public names checked', flush=True)
    return api

def step_test(n_workers):
    head('test', 'nbdev-test runs every notebook on the CPU, each in a process of its own')
    # One process per notebook: a notebook that patches fastai (`@patch` in 03_patches) would otherwise leak its
    # patches into the next notebook nbdev-test runs in the same worker
    from concurrent.futures import ThreadPoolExecutor
    def test(nb):
        t = time.time()
        r = subprocess.run(['nbdev-test', str(nb)], cwd=ROOT,
                           capture_output=True, text=True)
        return nb, r, time.time() - t
    t = time.time()
    with ThreadPoolExecutor(n_workers) as ex:
        # Longest first (by size, saved outputs included), so the two workers finish together
        for nb, r, secs in ex.map(test, sorted(notebooks(), key=lambda p: -p.stat().st_size)):
            print(f'  {nb.name}: {"ok" if r.returncode == 0 else "FAILED"} in {secs:.0f}s', flush=True)
            if r.returncode:
                print('\n'.join('    ' + l for l in (r.stdout + r.stderr).strip().splitlines()[-40:]), flush=True)
                fail('test', f'nbdev-test failed on nbs/{nb.name} (see above)')
    print(f'  {time.time()-t:.0f}s in all', flush=True)

def _shown(cells):
    "Names `show_doc` rendered in processed notebook cells"
    res = set()
    for c in cells:
        for o in c.get('outputs', []):
            md = ''.join(o.get('data', {}).get('text/markdown', ''))
            res.update(re.findall(r'^#+ (\S+)\s*$', md, flags=re.M))
    return res

def step_proc(api):
    head('proc', "nbdev's doc processing, and a rendered entry for every public name")
    os.chdir(ROOT)
    from nbdev.doclinks import _build_modidx
    _build_modidx()
    # Each notebook in a process of its own, as nbdev-test runs them: processing runs a notebook's exported cells, and a
    # page's `@patch` (`Learner.compile` making the page's own `CompilerCallback` class) must not reach the next page
    code = "import sys; from nbdev.serve import proc_nbs; proc_nbs(sys.argv[1], n_workers=1, file_glob=sys.argv[2])"
    run1 = lambda nb: subprocess.run([sys.executable, '-c', code, str(NBS), nb.name], cwd=ROOT, capture_output=True, text=True)
    # One at a time: each `proc_nbs` restages the shared `_proc/_quarto.yml` and removes what it takes for stale, so two at
    # once now and then fail on a file the other removed
    results = [run1(nb) for nb in notebooks()]
    for nb,r in zip(notebooks(), results):
        if r.returncode: return fail('proc', f'processing nbs/{nb.name} failed: {r.stderr.strip()[-3000:]}')
    cache = ROOT/'_proc'
    for nb in notebooks():
        out = cache/nb.name
        if not out.exists(): fail('proc', f'nbs/{nb.name} was not processed into {out.relative_to(ROOT)}')
    shown = {}
    for py in modules():
        nb = source_nb(py)
        if nb and (cache/nb.name).exists(): shown[py.stem] = _shown(json.loads((cache/nb.name).read_text())['cells'])
    for qn, obj in api:
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)): continue
        mod, _, name = qn[len(LIB_NAME)+1:].partition('.')
        if mod in shown and name not in shown[mod]:
            fail('proc', f'{qn} has no show_doc entry on its page ({mod}): export it from a cell of its own, or add `show_doc({name})`')
    return cache

def _readme_lines():
    "Headings and code lines of the home page that README.md must contain"
    nb = json.loads((NBS/'index.ipynb').read_text())
    lines = []
    for c in nb['cells']:
        src = ''.join(c['source'])
        if c['cell_type'] == 'markdown': lines += re.findall(r'^(##+ .+)$', src, flags=re.M)
        elif not re.search(r'^\s*#\|\s*(hide|include:\s*false)', src, flags=re.M):
            lines += [l for l in src.splitlines() if l.strip() and not l.lstrip().startswith('#|')]
    return lines

def step_envs(fix):
    head('envs', "the home page's table of tested versions, and the declared minimums, are settings.ini's test_envs")
    sys.path.insert(0, str(ROOT/'.ci'))
    import envs
    for msg in envs.sync_index(fix) + envs.declared_problems(): fail('envs', msg)

def step_readme(fix):
    head('readme', 'README.md has the home page\'s set-up, quick start and sections')
    if fix:
        if shutil.which('quarto'): run(['nbdev-readme'])
        else:
            sys.path.insert(0, str(ROOT/'.ci'))
            from readme import write_readme
            write_readme(ROOT/'_proc'/'index.ipynb', ROOT/'README.md', NBS)
            print('  wrote README.md from the processed nbs/index.ipynb (Quarto is not installed)')
    text = (ROOT/'README.md').read_text()
    for s in README_MUST:
        if s not in text: fail('readme', f'README.md does not contain {s!r}')
    missing = [l for l in _readme_lines() if l.strip() not in text]
    if missing: fail('readme', f'README.md is out of date with nbs/index.ipynb ({len(missing)} lines differ, first: '
                               f'{missing[0].strip()!r}). Run `bash .ci/docs --fix` and commit README.md.')

def step_render(require):
    head('render', 'Quarto renders the site')
    if not shutil.which('quarto'):
        msg = ('Quarto is not installed, so the site was not rendered. The `quarto-cli` package on PyPI downloads Quarto '
               'from GitHub while it builds, which fails without access to GitHub. For a rough look at the pages, '
               '`python .ci/preview.py` renders them with pandoc.')
        return fail('render', msg) if require else warn('render', msg)
    if run(['nbdev-docs']).returncode: return fail('render', 'nbdev-docs failed (see above)')
    from nbdev.config import get_config
    docs = get_config().doc_path
    for nb in notebooks():
        proc = json.loads((ROOT/'_proc'/nb.name).read_text())
        m = re.search(r'^output-file:\s*(\S+)', ''.join(proc['cells'][0]['source']), flags=re.M)
        html = docs/(m[1] if m else nb.with_suffix('.html').name)
        if not html.exists(): fail('render', f'nbs/{nb.name} has no page: {html.relative_to(ROOT)} is missing')

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--fix', action='store_true', help="rewrite nbs/index.ipynb's table of tested versions from settings.ini, and README.md from nbs/index.ipynb, before checking them")
    p.add_argument('--no-test', action='store_true', help='skip nbdev-test (when CI runs it elsewhere)')
    p.add_argument('--no-proc', action='store_true', help="skip nbdev's doc processing (when CI builds the site, whose check "
                   'finds an entry for every public name on the rendered pages)')
    p.add_argument('--require-quarto', action='store_true', default=os.environ.get('DOCS_REQUIRE_QUARTO') == '1',
                   help='fail instead of warning when Quarto is not installed (also: DOCS_REQUIRE_QUARTO=1)')
    p.add_argument('--workers', type=int, default=2, help='notebooks tested in parallel')
    a = p.parse_args()
    t = time.time()
    step_export()
    step_pages()
    api = step_doc()
    step_envs(a.fix)
    if not a.no_test: step_test(a.workers)
    if not a.no_proc or a.fix: step_proc(api) # --fix writes README.md from the processed home page
    step_readme(a.fix)
    step_render(a.require_quarto)
    print(f'\ndocs: {len(failures)} problem(s), {len(warnings_)} warning(s), {time.time()-t:.0f}s')
    for w in warnings_: print('  warning', w)
    for f in failures: print('  FAIL', f)
    sys.exit(1 if failures else 0)

if __name__ == '__main__': main()
