from ..cli import run_cli
from .cli import main

if __name__ == "__main__":  # --workers starts processes with spawn, which imports this module again
    run_cli(main)
