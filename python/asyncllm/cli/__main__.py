"""`python -m asyncllm.cli ...`: the `asyncllm` command."""

import sys

from asyncllm.cli.main import main

sys.exit(main())
