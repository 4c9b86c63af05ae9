import sys

from ssd_jax.cli import main

sys.exit(main())
