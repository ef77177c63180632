"""``python -m interp_norm.cli``: the same as the ``interp-norm`` script."""

import sys

from interp_norm.cli import main

sys.exit(main())
