"""`python -m das_jax.cli ...`: the `das-jax` command."""
import sys

from das_jax.cli import main

sys.exit(main())
