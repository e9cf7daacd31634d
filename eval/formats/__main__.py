from ..cli import run_cli
from .cli import main

if __name__ == "__main__":
    run_cli(main)
