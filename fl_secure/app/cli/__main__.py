"""``python -m fl_secure.app.cli``: ``fl-secure`` (how ``fl-secure train`` starts its clients)."""

import sys

from fl_secure.app.cli.console import main

if __name__ == "__main__":
    sys.exit(main())
