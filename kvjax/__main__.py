"""``python -m kvjax``: see :mod:`kvjax.cli.main`."""

from kvjax.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
