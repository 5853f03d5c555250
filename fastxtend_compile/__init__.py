"torch.compile for fastai Learners, through the whole training lifecycle"
from importlib.metadata import version as _version, PackageNotFoundError as _NotFound
try: __version__ = _version('fastxtend_compile')
except _NotFound: __version__ = 'unknown'

from .core import *
from .report import *
from .optimizer import *
from .callback import *
from .patches import *
from .explain import *
