"""The old path of ``tests.support.downstream``, kept for the review scripts in
``../shared/repros/``, which import it by this name; the suite imports
``tests.support.downstream``, and both names are the one module."""

import sys

from tests.support import downstream

sys.modules[__name__] = downstream
