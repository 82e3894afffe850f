"""The old path of ``tests.support.testapp``, kept for the review scripts in
``../shared/repros/``, which import it by this name; the suite imports
``tests.support.testapp``, and both names are the one module."""

import sys

from tests.support import testapp

sys.modules[__name__] = testapp
