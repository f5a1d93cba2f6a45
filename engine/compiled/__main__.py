"""python -m engine.compiled [--check | --no-retry]: build the compiled core for the current sources."""

import argparse
import sys

from engine.compiled import build, compiled_dir, source_key


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the compiled core (mypyc) for the current sources.")
    ap.add_argument("--check", action="store_true", help="only say whether a build for these sources exists")
    ap.add_argument("--no-retry", action="store_true",
                    help="fail at once if a build for these sources failed before (make setup; make compiled retries)")
    args = ap.parse_args()
    if args.check:
        found = (compiled_dir() / source_key() / "manifest.json").is_file()
        print(f"compiled core for these sources: {'built' if found else 'not built'} ({compiled_dir()})")
        sys.exit(0 if found else 1)
    print(f"compiled core: {build(retry_failed=not args.no_retry)}")


if __name__ == "__main__":
    main()
