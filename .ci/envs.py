"""The environments CI tests: `test_envs` in settings.ini, one a line. `.ci/run` runs them; `.ci/docs` writes the README's
table of tested versions from them and checks that settings.ini and setup.py declare what they test.

  python .ci/envs.py run [NAME ...]   test each environment (default: all) in turn, the next one set up meanwhile;
                                      each one's log goes to .venv-NAME.log, and a summary with the durations follows;
                                      each environment is removed once tested (`--keep` keeps them), so the disk holds
                                      no more than two of them (~6 GB each) at once
  python .ci/envs.py setup NAME       make .venv-NAME: its Python (found on PATH or through pyenv), its torch, torchvision,
                                      fastai and the package's requirements (through uv), then the README's set-up command
                                      in it; check the versions it got
  python .ci/envs.py test NAME        in .venv-NAME: the README's test command, with `--slow` where the environment runs
                                      every test, and its 40 slowest tests; then, in the newest,
                                      the docs checks, the site (which runs every notebook) and the benchmark
  python .ci/envs.py table            the README's table of tested versions

Each environment installs with pip's configuration files and constraints left out (`PIP_CONFIG_FILE=/dev/null`), so a
machine that caps a package (torch, say) installs what settings.ini asks for all the same. A package named without a
version is the newest release the package index offers, and setting up fails if pip installed another.
"""
import argparse, configparser, glob, json, os, re, shutil, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The README's set-up and test commands, which .ci/run checks it shows, and passes here
SETUP, TESTS = os.environ.get('CI_SETUP', 'pip install -e ".[dev]"'), os.environ.get('CI_TESTS', 'pytest -q tests')
PKGS = ('torch', 'torchvision', 'fastai')
TABLE_CELL = 'e5a7c2d1' # The id of nbs/index.ipynb's cell with the table of tested versions

def settings():
    cfg = configparser.ConfigParser(delimiters=['='])
    cfg.read(ROOT/'settings.ini')
    return cfg['DEFAULT']

class Env:
    "One line of `test_envs`: name, Python, torch, torchvision and fastai requirements, and which tests run"
    def __init__(self, line:str, last:bool):
        name, self.python, *reqs, self.tests = line.split()
        self.name, self.last = name, last
        self.reqs = dict(zip(PKGS, reqs))
        for k, r in self.reqs.items():
            if not re.fullmatch(rf'{k}(==[\w.+]+)?', r): raise ValueError(f'test_envs, {name}: {r!r} is not `{k}` or `{k}==VERSION`')
        if self.tests not in ('all', 'default'): raise ValueError(f"test_envs, {name}: tests are 'all' or 'default', not {self.tests!r}")
        self.venv = ROOT/f'.venv-{name}'
        self.log = ROOT/f'.venv-{name}.log'

    def pin(self, pkg): return self.reqs[pkg].partition('==')[2] or None
    @property
    def site(self): return self.last # The newest environment builds the site from its notebooks and runs the bench
    def __repr__(self): return f'{self.name} (Python {self.python}, {", ".join(self.reqs.values())}, {self.tests} tests)'

def envs():
    lines = [l for l in settings()['test_envs'].splitlines() if l.strip()]
    return [Env(l, i == len(lines) - 1) for i, l in enumerate(lines)]

def get_env(name):
    for e in envs():
        if e.name == name: return e
    sys.exit(f"envs: no environment {name!r} in settings.ini's test_envs ({', '.join(e.name for e in envs())})")

def _vkey(v): return tuple(int(x) for x in v.split('.'))

# ---------------------------------------------------------------------------------------------------------------------
# the README's table, and what settings.ini and setup.py declare

def table()->str:
    "Markdown: the tested versions, one environment a row"
    def ver(e, pkg): return e.pin(pkg) or 'newest'
    runs = {'all': 'every test', 'default': 'the default set'}
    rows = ['| Python | torch | torchvision | fastai | Tested |', '|---|---|---|---|---|']
    for e in envs():
        rows.append(f'| {e.python} | {ver(e, "torch")} | {ver(e, "torchvision")} | {ver(e, "fastai")} | {runs[e.tests]}'
                    f'{" and notebook" if e.site else ""} |')
    return '\n'.join(rows)

def table_cell()->str:
    "The source of nbs/index.ipynb's cell that shows the table"
    return ('`bash .ci/run`, the CI, tests these versions together, each row (`settings.ini`\'s `test_envs`) in a virtual\n'
            'environment of its own:\n\n' + table() + '\n\n'
            "*newest* is PyPI's newest release when CI runs, whatever the machine's `pip` configuration caps. The first row is\n"
            'the oldest of each that the package supports. What needs a newer torch says so and is skipped with the reason:\n'
            '`precompile=True` needs torch 2.15.')

def declared_problems()->list:
    "Where settings.ini's requirements and setup.py's classifiers disagree with the oldest environment tested"
    cfg, res = settings(), []
    es = envs()
    pys = sorted({e.python for e in es}, key=_vkey)
    if cfg['min_python'] != pys[0]: res.append(f"settings.ini: min_python is {cfg['min_python']}, the oldest Python tested {pys[0]}")
    reqs = dict(re.match(r'([\w-]+)(.*)', r).groups() for r in cfg['requirements'].split())
    for pkg in ('torch', 'fastai'):
        oldest = min((e.pin(pkg) for e in es if e.pin(pkg)), key=lambda v: _vkey(v.split('+')[0]))
        if reqs.get(pkg) != f'>={_short(oldest)}':
            res.append(f"settings.ini: requirements say {pkg}{reqs.get(pkg, '')}, the oldest tested is {pkg}=={oldest}")
    kw = setup_kwargs()
    classified = [c.rpartition(' :: ')[2] for c in kw['classifiers'] if re.fullmatch(r'Programming Language :: Python :: \d+\.\d+', c)]
    if classified != pys: res.append(f"setup.py: its classifiers name Python {', '.join(classified)}, CI tests {', '.join(pys)}")
    if kw['python_requires'] != f'>={pys[0]}': res.append(f"setup.py: python_requires is {kw['python_requires']}, CI tests {pys[0]} and newer")
    return res

def setup_kwargs()->dict:
    "What setup.py passes to `setuptools.setup` (run with a stand-in for setuptools, which a virtual environment may lack)"
    code = ('import json, sys, types; st = types.ModuleType("setuptools"); kw = {}; st.setup = kw.update; '
            'st.find_packages = lambda *a, **k: []; sys.modules["setuptools"] = st; '
            'exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__name__": "__main__"}); '
            'print(json.dumps({k: kw[k] for k in ("classifiers", "python_requires")}))')
    return json.loads(subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True).stdout)

def _short(v): # torch 2.11.0 is required as torch>=2.11; fastai 2.8.9 as fastai>=2.8.9
    parts = v.split('+')[0].split('.')
    return '.'.join(parts[:2]) if parts[2:] == ['0'] else '.'.join(parts)

def sync_index(fix:bool)->list:
    "Problems with nbs/index.ipynb's table of tested versions; with `fix`, rewrite it from settings.ini"
    p = ROOT/'nbs'/'index.ipynb'
    nb = json.loads(p.read_text())
    cell = next((c for c in nb['cells'] if c.get('id') == TABLE_CELL), None)
    if cell is None: return [f'nbs/index.ipynb has no cell {TABLE_CELL!r} for the table of tested versions (settings.ini test_envs)']
    want = table_cell()
    if ''.join(cell['source']) == want: return []
    if not fix: return ['nbs/index.ipynb: the table of tested versions differs from settings.ini test_envs: run `bash .ci/docs --fix`']
    cell['source'] = want.splitlines(keepends=True)
    p.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    print('  rewrote the table of tested versions in nbs/index.ipynb from settings.ini', flush=True)
    return []

# ---------------------------------------------------------------------------------------------------------------------
# set up and test one environment

def find_python(ver:str)->str:
    "A Python `ver` interpreter: `pythonVER` on PATH, else pyenv's newest `ver.*`"
    cands = [shutil.which(f'python{ver}')]
    root = subprocess.run(['pyenv', 'root'], capture_output=True, text=True).stdout.strip() if shutil.which('pyenv') else ''
    root = root or os.path.expanduser('~/.pyenv')
    cands += sorted(glob.glob(f'{root}/versions/{ver}.*/bin/python'), key=lambda p: _vkey(p.split('/')[-3]), reverse=True)
    for c in cands:
        if not c: continue
        r = subprocess.run([c, '-c', 'import sys; print("%d.%d" % sys.version_info[:2])'], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == ver: return c
    sys.exit(f'envs: no Python {ver} here (neither python{ver} on PATH nor pyenv install {ver})')

def pip_env(venv:Path|None=None)->dict:
    "The environment for pip and the tests: pip's configuration files and constraints left out; `venv` first on PATH"
    env = {k: v for k, v in os.environ.items() if k not in ('PIP_CONSTRAINT', 'PIP_BUILD_CONSTRAINT', 'PYTHONPATH')}
    env['PIP_CONFIG_FILE'] = os.devnull
    env.setdefault('PYTHONWARNINGS', 'ignore::FutureWarning')
    if venv:
        env['VIRTUAL_ENV'] = str(venv)
        env['PATH'] = f'{venv}/bin{os.pathsep}{env["PATH"]}'
    return env

def sh(cmd, env, **kw):
    "Run `cmd` (a shell line) from the checkout, echoed, and fail on an error"
    print(f'$ {cmd}', flush=True)
    t = time.time()
    r = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, **kw)
    if r.returncode: sys.exit(f'envs: failed ({r.returncode}): {cmd}')
    return time.time() - t

def pytest_counts(cmd, env)->tuple:
    "Run the pytest line `cmd` as `sh` does, its output passed on; its seconds and its closing line of counts"
    print(f'$ {cmd}', flush=True)
    t, last = time.time(), ''
    with subprocess.Popen(cmd, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            print(line, end='', flush=True)
            if re.search(r'\d+ (passed|failed|error)', line): last = line.strip(' =\n')
    if p.returncode: sys.exit(f'envs: failed ({p.returncode}): {cmd}\n  {last}')
    return time.time() - t, last

def newest_on_index(pkg, env)->str:
    "The newest release of `pkg` the package index offers the environment's Python"
    r = subprocess.run(['python', '-m', 'pip', 'index', 'versions', pkg], env=env, capture_output=True, text=True)
    m = re.match(rf'{pkg} \((\S+)\)', r.stdout.strip(), flags=re.I)
    if not m: sys.exit(f'envs: `pip index versions {pkg}` answered no version:\n{r.stdout}{r.stderr}')
    return m[1]

def installed(env)->dict:
    code = 'import sys, json, torch, torchvision, fastai, fastcore; print(json.dumps(dict(python="%d.%d" % sys.version_info[:2], ' \
           'torch=torch.__version__, torchvision=torchvision.__version__, fastai=fastai.__version__, fastcore=fastcore.__version__)))'
    return json.loads(subprocess.run(['python', '-c', code], env=env, capture_output=True, text=True, check=True).stdout)

def check_versions(e:Env, env)->dict:
    "The versions in `e`'s environment; fail where they are not what settings.ini asks for"
    got, bad = installed(env), []
    if got['python'] != e.python: bad.append(f"Python {got['python']}, not {e.python}")
    for pkg in PKGS:
        have = got[pkg].split('+')[0] # torch 2.11.0+cu130 is torch 2.11.0
        want = e.pin(pkg) or newest_on_index(pkg, env)
        if have != want.split('+')[0]:
            bad.append(f'{pkg} {got[pkg]}, not {want}' + ('' if e.pin(pkg) else ', the newest the package index offers'))
    print(f"{e.name}: Python {got['python']}, torch {got['torch']}, torchvision {got['torchvision']}, fastai {got['fastai']}, "
          f"fastcore {got['fastcore']}", flush=True)
    if bad: sys.exit(f'envs: {e.name} got ' + '; '.join(bad))
    return got

def setup(e:Env):
    "Make `e`'s virtual environment: its Python, its torch, torchvision and fastai, then the README's set-up command"
    if e.venv.exists(): shutil.rmtree(e.venv)
    subprocess.run([find_python(e.python), '-m', 'venv', str(e.venv)], check=True)
    env = pip_env(e.venv)
    # uv puts the environment's torch, torchvision and fastai and the package's own requirements in place: it fetches
    # and unpacks in parallel, and links from its cache (inside the environment, removed with it), where pip took 4-6
    # minutes an environment on two cores. The README's set-up command follows, and finds them installed
    env['UV_CACHE_DIR'] = str(e.venv/'uv-cache')
    sh('python -m pip install -q uv', env)
    # Compiled to bytecode as it installs, as pip's installs are: uv leaves that to the first import, and where Python may
    # not write it (`PYTHONDONTWRITEBYTECODE`), every process of the suite (test workers, compile workers, DDP ranks, the
    # notebooks' kernels) compiled torch's and fastai's sources again as it imported them
    sh('python -m uv pip install -q --compile-bytecode ' + ' '.join(e.reqs.values()) + ' -e ".[dev]"', env)
    sh(SETUP, env)
    return check_versions(e, env)

def test(e:Env):
    "In `e`'s environment: its tests, and in the newest the docs, site and benchmark; its versions, step times and counts"
    env = pip_env(e.venv)
    got = check_versions(e, env)
    # Every test where the environment runs them all, the slow ones (`--slow`) included; the 40 slowest named at the end
    tests_s, counts = pytest_counts(TESTS + (' --slow' if e.tests == 'all' else '') + ' --durations=40', env)
    times = {'tests': tests_s}
    if e.site:
        # The notebooks run in the site's build, which also checks that every public name has its entry on a page
        times['docs'] = sh('bash .ci/docs --no-test --no-proc', env)
        times['notebooks and site'] = sh('bash .ci/site', env)
        # The GPT-style workload's smoke jobs run every arm's code path, regional and nested compiles included
        times['bench'] = sh('python bench/bench.py --device cpu --smoke --workloads gpt --out "$(mktemp -d)"', env)
    return got, times, counts

# ---------------------------------------------------------------------------------------------------------------------

def run_all(names, keep=False):
    "Test each environment in turn, the next one set up meanwhile; each step a process of its own logging to .venv-NAME.log"
    # One at a time: two test runs beside each other on two cores took 38-49 minutes each for a suite that took 22 alone
    # (torch 2.11), as their processes (test workers, compile workers, DDP ranks) contend. The whole run takes about as
    # long either way; one at a time, each environment's times are its own. A set-up is mostly downloading and
    # unpacking: it runs beside the tests of the environment before
    es = [get_env(n) for n in names] if names else envs()
    free = shutil.disk_usage(ROOT).free / 2**30
    print(f'== {free:.0f} GB free on the disk of {ROOT}', flush=True)
    print(f'== {len(es)} environments, one at a time: ' + '; '.join(map(repr, es)), flush=True)
    def step(cmd, e):
        t = time.time()
        with open(e.log, 'a') as f:
            r = subprocess.run([sys.executable, __file__, cmd, e.name], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        return r.returncode, time.time() - t
    for e in es: e.log.write_text('')
    failed = []
    with ThreadPoolExecutor(1) as ex:
        setup = ex.submit(step, 'setup', es[0])
        for i, e in enumerate(es):
            (rc, setup_s), test_s = setup.result(), 0.
            if i + 1 < len(es): setup = ex.submit(step, 'setup', es[i + 1]) # Beside this one's tests: two on the disk at most
            if rc == 0: rc, test_s = step('test', e)
            if not keep: shutil.rmtree(e.venv, ignore_errors=True) # Its disk for the environment after the next
            lines = e.log.read_text().splitlines()
            summary = next((l for l in reversed(lines) if l.startswith(f'{e.name}: ')), '')
            print(f'\n== {e.name}: {"ok" if rc == 0 else "FAILED"}: set up in {setup_s/60:.1f} min, tested in {test_s/60:.1f} min '
                  f'({e.log.name})\n  {summary}', flush=True)
            print('\n'.join('  ' + l for l in lines[-(60 if rc else 8):]), flush=True)
            if rc: failed.append(e.name)
    if failed: sys.exit(f'envs: failed in {", ".join(failed)} (see above)')

def test_summary(e:Env):
    "Test `e`, then say on one line what it ran on, how long each step took, and its tests' counts"
    print(f'== {e!r}: test', flush=True)
    got, times, counts = test(e)
    print(f"{e.name}: Python {got['python']}, torch {got['torch']}, torchvision {got['torchvision']}, fastai {got['fastai']}: "
          + ', '.join(f'{k} {v/60:.1f} min' for k, v in times.items()) + f"; {e.tests} tests: {counts}", flush=True)

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('cmd', choices=['run', 'setup', 'test', 'table', 'names'])
    ap.add_argument('names', nargs='*')
    ap.add_argument('--keep', action='store_true', help='keep each environment once tested (run)')
    a = ap.parse_args()
    if a.cmd == 'table': print(table())
    elif a.cmd == 'names': print('\n'.join(e.name for e in envs()))
    elif a.cmd == 'run': run_all(a.names, a.keep)
    elif a.cmd == 'setup':
        for n in a.names: setup(get_env(n))
    elif a.cmd == 'test':
        for n in a.names: test_summary(get_env(n))

if __name__ == '__main__': main()
