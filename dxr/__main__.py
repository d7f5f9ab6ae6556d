"""`python -m dxr …` runs the same command line as the installed `dxr` script."""
from dxr.cli import main

if __name__ == "__main__":
    main(prog_name="dxr")
