"""`python -m llmgw`: the `llmgw` command (tools/cli.py) under its old name. An entry point, not
the library: nothing imports it, and it is the one module of llmgw/ allowed to reach a tool."""

import sys

from tools.cli import main

sys.exit(main())
