"""Run the lade-export CLI from a checkout: ``python cli.py build …``."""

from lade_export.cli import run

if __name__ == "__main__":
    run()
