"""`python -m dxr …` runs the same command line as the installed `dxr` script."""
from dxr.cli import main

main(prog_name="dxr")
