"""nbdev `show_doc` renderer with parameter tables, as the fastxtend docs show them (nbdev 3 prints only a signature).

Not used yet: to adopt it, copy this file to `fastxtend_compile/_showdoc.py` and add
`renderer = "fastxtend_compile._showdoc.TableRenderer"` under `[tool.nbdev]` in pyproject.toml.
"""
import enum, inspect, re, textwrap
from fastcore.docments import DocmentTbl
from nbdev.showdoc import BasicMarkdownRenderer
from nbdev.doclinks import NbdevLookup
from nbdev.config import get_config

def _anno(a):
    s = a if isinstance(a, str) else inspect.formatannotation(a)
    return re.sub(r'\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)', r'\1', s.strip("'")).replace('NoneType', 'None')

def _default(d): return d.__name__ if inspect.ismodule(d) or inspect.isfunction(d) else repr(d)

def _param(p):
    s = {p.VAR_POSITIONAL: '*', p.VAR_KEYWORD: '**'}.get(p.kind, '') + p.name
    if p.annotation is not p.empty: s += ':' + _anno(p.annotation)
    if p.default is not p.empty: s += '=' + _default(p.default)
    return s

class TableRenderer(BasicMarkdownRenderer):
    "`show_doc` as fastai's docs show it: a `name(params)` signature, the docstring, and a Type/Default/Details table"
    def _signature(self):
        if self.sig is None: return self.nm
        parts, star = [], False
        for p in self.sig.parameters.values():
            if p.name == 'self': continue
            if p.kind == p.KEYWORD_ONLY and not star: parts.append('*')
            star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
            parts.append(_param(p))
        ret = '' if self.sig.return_annotation is inspect.Signature.empty else f'->{_anno(self.sig.return_annotation)}'
        return textwrap.fill(f"{self.nm}({', '.join(parts)}){ret}", width=100, subsequent_indent=' '*(len(self.nm)+1),
                             break_long_words=False, break_on_hyphens=False)

    def _repr_markdown_(self):
        doc = '---\n\n'
        src = NbdevLookup().code(self.fn) if get_config().git_url else None # No repository URL: no broken link
        if src: doc += f'[source]({src}){{target="_blank" style="float:right; font-size:smaller"}}\n\n'
        doc += f"{'#'*self.title_level} {self.nm}\n\n"
        if inspect.isclass(self.sym) and issubclass(self.sym, enum.Enum): # Members, not Enum's call signature
            if self.docs: doc += f"*{self.docs.strip()}*\n\n"
            return doc + '| member | value |\n| --- | --- |\n' + ''.join(f'| `{m.name}` | `{m.value!r}` |\n' for m in self.sym)
        doc += f"```python\n{self._signature()}\n```\n\n"
        if self.docs: doc += f"*{self.docs.strip()}*\n\n"
        try: tbl = DocmentTbl(self.sym)._repr_markdown_()
        except Exception: tbl = ''
        return doc + (tbl + '\n' if tbl else '')
