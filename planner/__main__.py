"""``python -m planner ...``: the same command line as the ``planner`` script."""

from planner.cli import main

if __name__ == "__main__":
    main()
