"""`python -m fluxjoin` is the `fluxjoin` command (used to spawn local processes with this interpreter)."""

from fluxjoin.cli import main

main()
