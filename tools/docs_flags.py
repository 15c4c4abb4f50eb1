"""docs/flags.md from pretrain_moe.py's own argument parser: one table per flag group.

    python3 tools/docs_flags.py                          # print the page
    python3 tools/docs_flags.py --output docs/flags.md   # write it
    python3 tools/docs_flags.py --check docs/flags.md    # exit 1, saying so, when the file is stale

The logic is `cp_ext.cli.flags_reference`.
"""

import sys
import warnings

warnings.filterwarnings("ignore")  # megatron-core's import-time notices about optional packages

from cp_ext.cli.flags_reference import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
