"""A rough HTML preview of the docs pages without Quarto: `python .ci/preview.py [PAGE.ipynb ...]` (Debian: `apt-get install pandoc`).

Renders nbdev's processed notebooks (`_proc/`, written by `bash .ci/docs`) with pandoc (Debian's `pandoc` package) into
`_preview/`, applying what Quarto would of nbdev's cell options (`echo: false`, `output: asis`, `include: false`) and
`nbs/styles.css`. It is for reading the pages' content as a reader would, for instance in a headless browser's
screenshot; the real site is `nbdev-docs`, which needs Quarto.
"""
import json, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROC = ROOT/'_proc'
OUT = PROC/'_preview' # Inside _proc/, which git ignores

CSS = """body { max-width: 60rem; margin: 2rem auto; font-family: system-ui, sans-serif; line-height: 1.5; padding: 0 1rem; }
pre { background: #f6f8fa; padding: .6rem; overflow-x: auto; } code { font-size: .9em; }
table { border-collapse: collapse; margin: 1rem 0; } th, td { border: 1px solid #ddd; padding: .3rem .6rem; text-align: left; }
nav.pages { border-bottom: 1px solid #ddd; padding-bottom: .5rem; margin-bottom: 1rem; } nav.pages a { margin-right: 1rem; }
header .subtitle, p.subtitle { font-style: italic; opacity: .7; font-size: 1.2rem; }
"""

def _opts(src):
    return {m[1]: m[2].strip() for m in re.finditer(r'^#\|\s*([\w-]+):\s*(.*)$', src, flags=re.M)}

def _page(nb_path:Path, pages):
    nb = json.loads(nb_path.read_text())
    fm, cells = {}, []
    for c in nb['cells']:
        src = ''.join(c['source'])
        if c['cell_type'] == 'raw' and src.startswith('---'):
            import yaml
            fm = yaml.safe_load(src.strip().strip('-')) or {}
            continue
        if c['cell_type'] == 'code':
            o = _opts(src)
            if o.get('include') == 'false': continue
            c['source'] = '' if o.get('echo') == 'false' else re.sub(r'^#\|.*\n?', '', src, flags=re.M)
            # Markdown outputs (show_doc, `output: asis`) become markdown, as Quarto renders them
            md = [''.join(out['data']['text/markdown']) for out in c.get('outputs', []) if 'text/markdown' in out.get('data', {})]
            c['outputs'] = [out for out in c.get('outputs', []) if 'text/markdown' not in out.get('data', {})]
            if c['source'].strip() or c['outputs']: cells.append(c)
            cells += [dict(cell_type='markdown', metadata={}, source=m) for m in md]
            continue
        cells.append(c)
    nb['cells'] = cells
    tmp = OUT/(nb_path.stem + '.tmp.ipynb')
    tmp.write_text(json.dumps(nb))
    html = OUT/fm.get('output-file', nb_path.stem + '.html')
    meta = OUT/(nb_path.stem + '.meta.yml') # YAML, so the description's markdown (`code`) renders
    meta.write_text(json.dumps(dict(title=str(fm.get('title', nb_path.stem)), subtitle=str(fm.get('description', '')))))
    nav = ' '.join(f'<a href="{h}">{t}</a>' for h, t in pages)
    (OUT/'nav.html').write_text(f'<nav class="pages">{nav}</nav>')
    cmd = ['pandoc', str(tmp), '-f', 'ipynb+raw_html', '-t', 'html5', '-s', '--self-contained',
           '--css', str(OUT/'preview.css'), '--css', str(ROOT/'nbs'/'styles.css'), '-B', str(OUT/'nav.html'),
           '--metadata-file', str(meta), '-o', str(html)]
    subprocess.run(cmd, check=True, cwd=OUT)
    tmp.unlink(); meta.unlink()
    return html

def main(names):
    if not shutil.which('pandoc'): sys.exit('pandoc is not installed: apt-get install pandoc')
    if not PROC.exists(): sys.exit('_proc/ is missing: run `bash .ci/docs` first')
    OUT.mkdir(exist_ok=True)
    (OUT/'preview.css').write_text(CSS)
    nbs = [PROC/n for n in names] if names else sorted(PROC.glob('*.ipynb'))
    pages = []
    for p in sorted(PROC.glob('*.ipynb')):
        src = ''.join(json.loads(p.read_text())['cells'][0]['source'])
        out = re.search(r'^output-file:\s*(\S+)', src, flags=re.M)
        title = re.search(r'^title:\s*(.+)$', src, flags=re.M)
        pages.append((out[1] if out else p.stem + '.html', title[1].strip('"') if title else p.stem))
    for nb in nbs: print(_page(nb, pages))

if __name__ == '__main__': main(sys.argv[1:])
