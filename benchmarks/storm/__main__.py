"""``python -m benchmarks.storm``."""

from benchmarks.storm.cli import main

if __name__ == "__main__":
    main()
