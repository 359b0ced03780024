"""``python -m fedtier`` is the ``fedtier`` command."""

from fedtier.cli import main

raise SystemExit(main())
