"""``python -m mapper`` = the ``mapper`` command line."""

from .cli import main

if __name__ == "__main__":
    main()
