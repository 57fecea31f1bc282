import sys

from gradaccum.cli import main

if __name__ == "__main__":  # `verify --world-size` starts processes that import this module
    sys.exit(main())
