"torch.compile for fastai Learners, through the whole training lifecycle"
from importlib.metadata import version as _version, PackageNotFoundError as _NotFound
try: __version__ = _version('fastxtend_compile')
except _NotFound: __version__ = 'unknown'

from . import core as _core, report as _report, optimizer as _optimizer, callback as _callback, patches as _patches, explain as _explain, cache as _cache, background as _background
from .core import *
from .report import *
from .optimizer import *
from .callback import *
from .patches import *
from .explain import *
from .cache import *
from .background import *

# The star import gives the public API: not the modules, nor `internals`, where torch's private API is kept
__all__ = [n for m in (_core, _report, _optimizer, _callback, _patches, _explain, _cache, _background) for n in m.__all__]
