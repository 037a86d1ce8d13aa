"""``python -m eslm.cli COMMAND ...`` (and ``torchrun ... -m eslm.cli ...``): the same as the ``eslm`` command."""

import sys

from eslm.cli import main

sys.exit(main())
