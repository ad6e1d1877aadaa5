"""`python -m single_controller ...` is the `sc-grpo` command."""

from single_controller.runtime.cli import main

raise SystemExit(main())
