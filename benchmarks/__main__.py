"""``python -m benchmarks NAME [ARGS...]``: run ``benchmarks/bench_NAME.py`` with ARGS (from the repository root).

    python -m benchmarks               # list the benchmarks
    python -m benchmarks codec --reps 5
    python -m benchmarks fleet --sizes 100,300
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nbenchmarks: " + ", ".join(names()))
        return 0
    name, rest = argv[0], argv[1:]
    script = HERE / f"bench_{name}.py"
    if not script.is_file():
        print(f"no benchmark {name!r}; choose one of: {', '.join(names())}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
