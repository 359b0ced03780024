"""Entry point of ``python -m fedtier.embedded_broker``."""

from fedtier.embedded_broker.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
