"""`python -m controller` is the `fluxjoin` command (used to spawn local processes with this interpreter)."""

from controller.cli import main

main()
